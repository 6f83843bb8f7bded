"""Real, unmodified models from PyPI under flashjvp.patch_sdpa: timm's VisionTransformer and
diffusers' DiTTransformer2DModel, forward-mode (torch.func.jvp) and backward.

The reference is the same model on PyTorch's math SDPA backend, the only one of PyTorch's SDPA
backends with forward-mode AD; it is itself checked against central finite differences in float64.
Needs ``pip install timm==1.0.31 torchvision==0.28.0 diffusers==0.42.1`` beside torch 2.13.0;
skipped without them. On the CPU the kernels run in Triton's interpreter, so the models are tiny.
"""

import contextlib
import copy
import sys
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from flashjvp import patch_sdpa
from flashjvp._policy import interpreting
from flashjvp.sdpa import SDPAFallbackWarning, _math_sdpa
from helpers import Launches

sdpa_module = sys.modules["flashjvp.sdpa"]
pytestmark = pytest.mark.usefixtures("fresh_sdpa_warnings")

# Schemas of the torchvision ops that torchvision registers fake kernels for unconditionally;
# kept alive here for the life of the test process.
_torchvision_ops = []


def _import_torchvision():
    """Import torchvision, which timm imports at import time.

    PyPI's torchvision wheel for Linux x86_64 is a CUDA build: beside a CPU build of torch its C
    extension cannot load, and ``import torchvision`` then fails while registering a fake kernel
    for ``torchvision::nms`` ("operator torchvision::nms does not exist"). Defining the schemas of
    the two ops it registers unconditionally (``nms``, ``qnms``) lets its pure-Python part import.
    timm's VisionTransformer uses no torchvision op. A missing torchvision is left to
    ``pytest.importorskip("timm...")``.
    """
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            if not hasattr(torch.ops.torchvision, op):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_ops.append(lib)
        import torchvision  # noqa: F401


@pytest.fixture(scope="module")
def vit_cls():
    _import_torchvision()
    return pytest.importorskip("timm.models.vision_transformer").VisionTransformer


@pytest.fixture(scope="module")
def dit_cls():
    _import_torchvision()  # diffusers imports it too, where installed
    return pytest.importorskip("diffusers").DiTTransformer2DModel


def _spread_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Redraw the weights with unit-gain scales: the libraries' small initialisations give nearly
    uniform attention at these sizes, which would hide errors in the softmax and its tangent."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.dim() >= 2 and p[0].numel() > 1:  # Linear / Conv weights: std 1/sqrt(fan_in)
                p.copy_(noise * 1.5 / p[0].numel() ** 0.5)
            else:
                p.add_(0.3 * noise)
    return model


def make_vit(vit_cls, *, img=16, patch=4, dim=32, depth=2, heads=2, attn_drop=0.0):
    """(B, 3, img, img) images -> (B, 5) logits; (img/patch)^2 + 1 tokens, head dim dim/heads."""
    torch.manual_seed(0)
    model = vit_cls(img_size=img, patch_size=patch, in_chans=3, num_classes=5, embed_dim=dim,
                    depth=depth, num_heads=heads, mlp_ratio=2.0, attn_drop_rate=attn_drop)
    return _spread_weights(model).eval()


def make_dit(dit_cls, *, sample=8, patch=2, heads=2, head_dim=8, layers=2):
    """(B, 4, sample, sample) latents -> same shape; (sample/patch)^2 tokens."""
    torch.manual_seed(0)
    model = dit_cls(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4,
                    out_channels=4, num_layers=layers, sample_size=sample, patch_size=patch,
                    num_embeds_ada_norm=10, norm_num_groups=32)
    return _spread_weights(model).eval()


def dit_fn(model, batch):
    timestep = torch.arange(batch, device=model.device) + 3
    labels = torch.arange(batch, device=model.device) % 10
    return lambda h: model(h, timestep=timestep, class_labels=labels).sample


def math_jvp(fn, x, t):
    with sdpa_kernel(SDPBackend.MATH):
        return torch.func.jvp(fn, (x,), (t,))


class PlainMathSDPA(TorchFunctionMode):
    """SDPA as plain torch ops (``flashjvp.sdpa._math_sdpa``, ATen's math algorithm), so that
    under autocast the baseline's attention runs as PyTorch's own ops in the autocast dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _math_sdpa(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def plain_math_jvp(fn, x, t):
    with PlainMathSDPA():
        return torch.func.jvp(fn, (x,), (t,))


def finite_difference(fn64, x, t, eps=1e-6):
    x, t = x.double(), t.double()
    return (fn64(x + eps * t) - fn64(x - eps * t)) / (2 * eps)


def assert_close_rel(got, want, rtol, floor=0.0, base=None, factor=2.0):
    """Max error relative to the reference's largest entry (outputs of different scales), or to
    ``floor`` where that is larger (gradients that are zero in exact arithmetic). ``base``: the
    same model in got's dtype on PyTorch's math attention; ``factor`` times its error is allowed
    on top (flash-attn's rule: on CUDA the rest of a model alone can be far from float64)."""
    want = want.float()
    err = (got.float() - want).abs().max().item()
    scale = max(want.abs().max().item(), floor)
    if base is None:
        assert err <= rtol * scale, f"max error {err:.3g} > {rtol} * {scale:.3g}"
        return
    allowed = factor * (base.float() - want).abs().max().item() + rtol * scale
    assert err <= allowed, f"max error {err:.3g} > {factor} * math's error + {rtol} * {scale:.3g} = {allowed:.3g}"


def check_model_jvp(fn, fn64, x, t, n_attn):
    """torch.func.jvp of the model inside patch_sdpa vs on the math backend (and that vs finite
    differences in float64). One fused launch per attention layer, no fallback."""
    ref, tref = math_jvp(fn, x, t)
    assert_close_rel(tref, finite_difference(fn64, x, t), rtol=1e-4)
    with warnings.catch_warnings(record=True) as record, patch_sdpa(), Launches() as n:
        warnings.simplefilter("always")
        out, tout = torch.func.jvp(fn, (x,), (t,))
    assert not [w for w in record if issubclass(w.category, SDPAFallbackWarning)]
    assert n.fwd == n_attn, f"expected {n_attn} fused launches (one per attention layer), got {n.fwd}"
    assert_close_rel(out, ref, rtol=1e-5)
    assert_close_rel(tout, tref, rtol=1e-5)
    assert tout.abs().max() > 0


def check_model_backward(model, fn, x, n_attn):
    """Gradients w.r.t. the input and every parameter, patched vs PyTorch's SDPA."""
    grads = []
    for patched in (True, False):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        w = torch.randn(fn(x).shape, generator=torch.Generator().manual_seed(1))
        with (patch_sdpa() if patched else sdpa_kernel(SDPBackend.MATH)), Launches() as n:
            (fn(xi) * w).sum().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
        if patched:
            assert (n.fwd, n.bwd) == (n_attn, n_attn), (n.fwd, n.bwd)
    # e.g. the bias of the keys gets a zero gradient (softmax is shift-invariant): rounding noise
    floor = 1e-3 * max(g.abs().max().item() for g in grads[1])
    for got, want in zip(*grads):
        assert_close_rel(got, want, rtol=1e-4, floor=floor)


needs_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU tests need TRITON_INTERPRET=1")


@needs_interpreter
def test_timm_vit_jvp(vit_cls):
    model = make_vit(vit_cls)
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        check_model_jvp(model, model64, x, t, n_attn=2)


@needs_interpreter
def test_timm_vit_backward(vit_cls):
    model = make_vit(vit_cls)
    check_model_backward(model, model, torch.randn(2, 3, 16, 16), n_attn=2)


@needs_interpreter
def test_timm_vit_attention_dropout_falls_back_once_per_call_site(vit_cls):
    """Training mode with attention dropout: the math fallback (one warning for timm's single
    SDPA call site, shared by both blocks), with PyTorch's random numbers and a correct JVP."""
    model = make_vit(vit_cls, attn_drop=0.2).train()
    x, t = torch.randn(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    torch.manual_seed(5)
    ref, tref = math_jvp(model, x, t)
    with warnings.catch_warnings(record=True) as record, patch_sdpa(), Launches() as n:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.manual_seed(5)
            out, tout = torch.func.jvp(model, (x,), (t,))
    got = [w for w in record if issubclass(w.category, SDPAFallbackWarning)]
    assert len(got) == 1 and "dropout_p" in str(got[0].message)
    assert "timm" in got[0].filename
    assert n.fwd == 0
    assert_close_rel(out, ref, rtol=1e-5)
    assert_close_rel(tout, tref, rtol=1e-5)


@needs_interpreter
def test_diffusers_dit_jvp(dit_cls):
    model = make_dit(dit_cls)
    x, t = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        check_model_jvp(dit_fn(model, 2), dit_fn(model64, 2), x, t, n_attn=2)


@needs_interpreter
def test_diffusers_dit_backward(dit_cls):
    model = make_dit(dit_cls)
    check_model_backward(model, dit_fn(model, 2), torch.randn(2, 4, 8, 8), n_attn=2)


def test_diffusers_dit_compiled_under_patch_sdpa(dit_cls):
    """torch.compile of a DiT step inside patch_sdpa, with the timestep computed in the compiled
    region: it compiles (the mode's redispatch of F.* functions once made Dynamo fail with
    "to() received ... dtype=torch.Size") and matches the eager model."""
    torch._dynamo.reset()
    model = make_dit(dit_cls)
    x, t = torch.randn(2, 4, 8, 8), torch.rand(2)
    labels = torch.arange(2) % 10
    step = lambda x, t: model(x, timestep=1000 * t, class_labels=labels).sample  # noqa: E731
    eager = step(x, t)
    with patch_sdpa():
        out = torch.compile(step)(x, t)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


# --- GPU ---------------------------------------------------------------------------------------

def _peak_mib(fn):
    """(result, peak memory allocated by fn beyond what was allocated before, in MiB)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20


_NO_GPU = ("needs a CUDA GPU" if not torch.cuda.is_available()
           else "needs TRITON_INTERPRET=0 (compiled kernels)" if interpreting() else "")


@pytest.mark.gpu
@pytest.mark.skipif(bool(_NO_GPU), reason=_NO_GPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["timm_vit", "diffusers_dit"])
def test_models_on_cuda(name, dtype, request, capsys):
    """The same comparison on CUDA at a realistic size; prints the peak memory of each path.

    bf16 runs under ``torch.autocast`` with float32 weights, as mixed-precision training does
    (attention then sees bf16 q, k, v). A model cast with ``.to(torch.bfloat16)`` failed under
    torch.func.jvp on the H200 (torch 2.11) on PyTorch's math path too: a float32 tangent met a
    bf16 weight in a Linear (our guess: LayerNorm's float32 statistics on CUDA). flashjvp's error
    against the float32 MATH-backend reference must stay within twice that of the same model
    with plain-torch math attention under the same autocast (plus a small floor)."""
    if name == "timm_vit":
        model = make_vit(request.getfixturevalue("vit_cls"), img=224, patch=16, dim=384, depth=4, heads=6)
        x = torch.randn(16, 3, 224, 224)
        fn_of = lambda m: m  # noqa: E731
    else:
        model = make_dit(request.getfixturevalue("dit_cls"), sample=32, patch=2, heads=6, head_dim=64,
                         layers=4)
        x = torch.randn(8, 4, 32, 32)
        fn_of = lambda m: dit_fn(m, 8)  # noqa: E731
    model = model.cuda().requires_grad_(False)
    x = x.cuda()
    t = torch.randn_like(x)
    fn = fn_of(model)

    def run(jvp, flash=False):  # one autocast region per call: its weight-cast cache dies with it
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            with patch_sdpa() if flash else contextlib.nullcontext():
                return jvp(fn, x, t)

    flash_jvp = lambda f, x, t: torch.func.jvp(f, (x,), (t,))  # noqa: E731
    with torch.no_grad():
        (ref, tref), ref_mib = _peak_mib(lambda: math_jvp(fn, x, t))  # float32, MATH backend
        (m_out, m_tout), math_mib = _peak_mib(lambda: run(plain_math_jvp))
        run(flash_jvp, flash=True)  # compile and autotune outside the measured call
        with Launches() as n:
            (out, tout), flash_mib = _peak_mib(lambda: run(flash_jvp, flash=True))
    assert n.fwd == 4
    with capsys.disabled():
        print(f"\n{name} {dtype}: peak memory of torch.func.jvp: flashjvp {flash_mib:.1f} MiB, "
              f"plain-torch math attention {math_mib:.1f} MiB, "
              f"PyTorch MATH backend (float32) {ref_mib:.1f} MiB")
    if dtype == torch.float32:
        assert_close_rel(out, ref, rtol=1e-4)
        assert_close_rel(tout, tref, rtol=1e-4)
    else:
        for got, base, want in ((out, m_out, ref), (tout, m_tout, tref)):
            err = (got.float() - want).abs().max().item()
            base_err = (base.float() - want).abs().max().item()
            assert err <= 2 * base_err + 1e-3 * want.abs().max().item(), (err, base_err)


# --- torch.compile -----------------------------------------------------------------------------

@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()), reason="needs the kernels")
@pytest.mark.parametrize("name", ["timm_vit", "diffusers_dit"])
def test_models_compiled_match_eager(name, request):
    """``torch.compile`` of an unmodified model inside ``patch_sdpa()``: the forward, the
    gradients and ``torch.func.jvp`` of the compiled model match the eager patched model, and
    flashjvp's kernels ran (Inductor on a GPU, AOTAutograd on the CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch._dynamo.reset()
    if name == "timm_vit":
        model = make_vit(request.getfixturevalue("vit_cls"))
        x = torch.randn(2, 3, 16, 16)
        fn_of = lambda m: m  # noqa: E731
    else:
        model = make_dit(request.getfixturevalue("dit_cls"))
        x = torch.randn(2, 4, 8, 8)
        fn_of = lambda m: dit_fn(m, 2)  # noqa: E731
    model, x = model.to(device), x.to(device)
    t = torch.randn_like(x)
    fn = fn_of(model)
    compiled = torch.compile(fn, backend="inductor" if device == "cuda" else "aot_eager")
    results = []
    for f in (fn, compiled):
        model.zero_grad(set_to_none=True)
        with patch_sdpa(), Launches() as n:
            out = f(x)
            out.square().sum().backward()
            with torch.no_grad():
                jvp = torch.func.jvp(f, (x,), (t,))
        assert n.fwd >= 2 and n.bwd >= 2, (n.fwd, n.bwd)
        results.append([out.detach(), *jvp] + [p.grad for p in model.parameters() if p.grad is not None])
    for got, want in zip(results[1][:3], results[0][:3]):  # output, jvp output and tangent
        assert_close_rel(got, want, rtol=1e-4, floor=1e-6 * want.abs().max().item())
    # Gradients: Inductor fuses the rest of the model (norms, activations) in another order than
    # eager, so a gradient that is small or zero in exact arithmetic keeps rounding noise on the
    # scale of the others: each is compared with the largest gradient of the model.
    largest = max(g.abs().max().item() for g in results[0][3:])
    for got, want in zip(results[1][3:], results[0][3:]):
        assert_close_rel(got, want, rtol=1e-3, floor=largest)
    torch._dynamo.reset()
