"""flashjvp.integrations: transformers' ``attn_implementation`` and diffusers' attention backend
and processor, on tiny real models with random weights (no downloads).

Each model is compared with a float64 copy of itself on PyTorch's math SDPA (the only PyTorch
backend with forward-mode AD): the forward, ``torch.func.jvp`` (one fused launch per attention
layer) and a few optimizer steps of a loss through the tangent. transformers' padding masks and
packed batches are checked to take flashjvp's key-padding and varlen paths. Needs
``pip install transformers==5.23.0 diffusers==0.42.1``; skipped without them. On the CPU the
kernels run in Triton's interpreter, so the models are tiny.
"""

import copy
import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashjvp
from flashjvp._policy import interpreting
from flashjvp.sdpa import SDPAFallbackWarning
from helpers import Launches
from test_models import _import_torchvision, _spread_weights, assert_close_rel

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                reason="needs the kernels (a GPU, or TRITON_INTERPRET=1 on the CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_trains(model, loss_of, lr: float, steps: int = 4) -> None:
    """A few Adam steps on ``loss_of(model, float32)`` lower the loss."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model, torch.float32)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_import_flashjvp_imports_neither_library():
    code = ("import sys, flashjvp, flashjvp.integrations, flashjvp.distributed; "
            "bad = [m for m in ('diffusers', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


class Spy:
    """Counts the calls of flashjvp's entry points that the integrations use."""

    NAMES = ("attention", "attention_varlen", "sdpa")

    def __init__(self, monkeypatch):
        self.calls = {n: [] for n in self.NAMES}
        for name in self.NAMES:
            real = getattr(flashjvp, name)

            def spy(*a, _real=real, _name=name, **kw):
                self.calls[_name].append(kw)
                return _real(*a, **kw)

            monkeypatch.setattr(flashjvp, name, spy)

    def only(self, name, n):
        counts = {k: len(v) for k, v in self.calls.items()}
        assert counts == {k: (n if k == name else 0) for k in self.NAMES}, counts
        return self.calls[name]


def jvp_close(got, want, rtol=1e-4, rows=None):
    """(out, tangent) pairs, float32 against the float64 reference; ``rows``: a bool (B, N) mask
    of the positions to compare (padding positions are free)."""
    for g, w in zip(got, want):
        if rows is not None:
            g, w = g[rows], w[rows]
        assert_close_rel(g, w, rtol=rtol)


# --- transformers ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    _import_torchvision()  # transformers imports it
    transformers = pytest.importorskip("transformers")
    from flashjvp.integrations import transformers as fjt

    name = fjt.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=name)
    _spread_weights(model)
    ref = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == name == "fjvp"
    return model.to(DEVICE).eval(), ref.double().to(DEVICE).eval()


def _batch(case):
    """(kwargs for the model beyond inputs_embeds, positions to compare, expected entry point)."""
    b, n = (1, 12) if case == "cu_seqlens" else (2, 12)
    dev = DEVICE
    pos = torch.arange(n, device=dev).expand(b, n)
    rows = torch.ones(b, n, dtype=torch.bool, device=dev)
    if case == "causal":
        return dict(position_ids=pos), rows, "attention"
    if case in ("right_pad", "left_pad"):
        mask = torch.ones(b, n, dtype=torch.long, device=dev)
        mask[1, 8:] = 0 if case == "right_pad" else 1
        mask[1, :4] = 0 if case == "left_pad" else 1
        return dict(attention_mask=mask, position_ids=pos), mask.bool(), "attention"
    if case == "packed":  # row 0: sequences of 5 and 7 tokens; row 1: 3, 4, 5
        pos = torch.tensor([[*range(5), *range(7)], [*range(3), *range(4), *range(5)]], device=dev)
        return dict(position_ids=pos), rows, "attention_varlen"
    if case == "cu_seqlens":  # flash-attention style packed kwargs (DataCollatorWithFlattening)
        pos = torch.tensor([[*range(4), *range(6), *range(2)]], device=dev)
        cu = torch.tensor([0, 4, 10, 12], dtype=torch.int32, device=dev)
        return (dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6),
                rows, "attention_varlen")
    if case == "dense":  # a 4-d mask that is neither padding nor packing: read tile by tile
        keep = torch.rand(b, 1, n, n, generator=torch.Generator().manual_seed(3)) > 0.4
        keep = (keep | torch.eye(n, dtype=torch.bool)).to(dev)
        return dict(attention_mask=keep, position_ids=pos), rows, "sdpa"
    raise ValueError(case)


def _llama_fn(model, kw, dtype):
    kw = dict(kw, use_cache=False)  # with a cache transformers does not look for packed sequences
    return lambda e: model(inputs_embeds=e.to(dtype), **kw).logits


@pytest.mark.parametrize("case", ["causal", "right_pad", "left_pad", "packed", "cu_seqlens", "dense"])
def test_transformers_llama_jvp(llama, case, monkeypatch):
    """Forward and torch.func.jvp of a Llama on attn_implementation="fjvp" against its float64
    copy on math SDPA; padding masks run flashjvp.attention (right padding: kv_lens), packed
    batches attention_varlen, other masks flashjvp.sdpa; one fused launch per layer."""
    model, ref = llama
    kw, rows, entry = _batch(case)
    b, n = rows.shape
    e = torch.randn(b, n, 32, device=DEVICE)
    t = torch.randn_like(e)
    spy = Spy(monkeypatch)
    with torch.no_grad(), Launches() as launches:
        got = torch.func.jvp(_llama_fn(model, kw, torch.float32), (e,), (t,))
    calls = spy.only(entry, 2)
    assert launches.fwd == 2, launches.fwd
    if case == "right_pad":
        assert calls[0]["kv_lens"].tolist() == [12, 8] and calls[0]["attn_mask"] is None
    if case == "left_pad":
        assert calls[0]["kv_lens"] is None and calls[0]["attn_mask"].shape == (2, 1, 1, 12)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jvp(_llama_fn(ref, kw, torch.float64), (e.double(),), (t.double(),))
    jvp_close(got, want, rows=rows)
    with torch.no_grad():
        assert_close_rel(_llama_fn(model, kw, torch.float32)(e)[rows], want[0][rows], rtol=1e-4)


def test_transformers_llama_trains(llama):
    """A consistency-style loss through the tangent (its gradient runs the second-order Triton
    backward): the first gradients match the float64 math model's, and four Adam steps on a
    padded batch lower the loss."""
    model, ref = llama
    model, ref = copy.deepcopy(model).train(), copy.deepcopy(ref).train()
    kw, rows, _ = _batch("right_pad")
    g = torch.Generator().manual_seed(7)
    e, t = torch.randn(2, 12, 32, generator=g).to(DEVICE), torch.randn(2, 12, 32, generator=g).to(DEVICE)
    target = torch.randn(2, 12, 64, generator=g).to(DEVICE)
    w = rows[..., None].float()

    def loss_of(m, dtype):
        out, dout = torch.func.jvp(_llama_fn(m, kw, dtype), (e.to(dtype),), (t.to(dtype),))
        return (((out - target) ** 2 + 0.1 * dout ** 2) * w).mean()

    for m, dtype in ((model, torch.float32), (ref, torch.float64)):
        with sdpa_kernel(SDPBackend.MATH):
            loss_of(m, dtype).backward()
    largest = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name  # embed_tokens: inputs_embeds bypass it
        if r.grad is not None:
            assert_close_rel(p.grad, r.grad, rtol=1e-3, floor=1e-2 * largest)
    assert_trains(model, loss_of, lr=3e-3)


def test_transformers_errors(llama):
    from flashjvp.integrations import transformers as fjt

    with pytest.raises(ValueError, match="must not contain 'flash'"):
        fjt.register("flashjvp")
    with pytest.raises(TypeError, match="non-empty str"):
        fjt.register("")
    q = torch.randn(2, 4, 6, 8)
    module = llama[0].model.layers[0].self_attn
    with pytest.raises(ValueError, match="softcap"):
        fjt.attention_forward(module, q, q, q, None, softcap=30.0)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch size must be 1, got 2"):
        fjt.attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


# --- diffusers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def diffusers_mod():
    _import_torchvision()
    return pytest.importorskip("diffusers")


@pytest.fixture
def native_backend(diffusers_mod):
    """``set_attention_backend`` also sets diffusers' global active backend: restore it."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    yield
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def make_flux(diffusers_mod):
    torch.manual_seed(0)
    model = diffusers_mod.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    return _spread_weights(model).eval()


def flux_fn(model, batch, dtype, n_txt=8):
    """(B, 16, 4) image tokens (a 4 x 4 grid) -> the same shape; n_txt text tokens."""
    g = torch.Generator().manual_seed(11)
    dev = next(model.parameters()).device
    enc = torch.randn(batch, n_txt, 16, generator=g)
    pooled = torch.randn(batch, 8, generator=g)
    grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
    img_ids = torch.stack(grid, -1).reshape(-1, 3)
    kw = dict(encoder_hidden_states=enc, pooled_projections=pooled, timestep=torch.linspace(0.2, 0.8, batch),
              img_ids=img_ids, txt_ids=torch.zeros(n_txt, 3))
    kw = {k: v.to(device=dev, dtype=dtype) for k, v in kw.items()}
    return lambda h: model(h.to(dtype), **kw, return_dict=False)[0]  # CP hooks need tensor outputs


def make_wan(diffusers_mod):
    """One Wan 2.1 block at toy size: self-attention over the video tokens with RoPE and RMS q/k
    norms, cross-attention to text tokens."""
    torch.manual_seed(0)
    model = diffusers_mod.WanTransformer3DModel(
        num_layers=1, patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, cross_attn_norm=True, qk_norm="rms_norm_across_heads")
    return _spread_weights(model).eval()


def wan_fn(model, batch, dtype, n_txt=8):
    """(B, 4, 2, 4, 8) latents (2 frames of 4 x 8, 16 tokens after patching) -> the same shape."""
    g = torch.Generator().manual_seed(13)
    dev = next(model.parameters()).device
    enc = torch.randn(batch, n_txt, 16, generator=g).to(device=dev, dtype=dtype)
    step = torch.linspace(300.0, 700.0, batch).to(device=dev, dtype=dtype)
    return lambda h: model(h.to(dtype), timestep=step, encoder_hidden_states=enc, return_dict=False)[0]


def test_diffusers_backend_registration(diffusers_mod, native_backend):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from flashjvp.integrations import diffusers as fjd

    assert fjd.register_backend() == fjd.register_backend() == "flashjvp"  # idempotent
    member = AttentionBackendName("flashjvp")
    assert member is AttentionBackendName.FLASHJVP and "FLASHJVP" in AttentionBackendName.__members__
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    model = make_flux(diffusers_mod)
    model.set_attention_backend("flashjvp")  # diffusers' own validation accepts the name
    assert {p._attention_backend for p in model.attn_processors.values()} == {member}
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fjd.apply("model")


@pytest.mark.parametrize("name", ["flux_backend", "wan_backend", "dit_processor"])
def test_diffusers_jvp(diffusers_mod, name, native_backend, monkeypatch):
    """torch.func.jvp of a Flux transformer and of a Wan block on the "flashjvp" backend
    (set_attention_backend) and of a DiT on FlashJVPAttnProcessor (apply) against their float64
    copies on math SDPA."""
    from flashjvp.integrations import diffusers as fjd
    from test_models import dit_fn, make_dit

    if name in ("flux_backend", "wan_backend"):  # two attention calls each (Wan: self and cross)
        make, make_fn, shape = {"flux_backend": (make_flux, flux_fn, (2, 16, 4)),
                                "wan_backend": (make_wan, wan_fn, (2, 4, 2, 4, 8))}[name]
        model = make(diffusers_mod)
        ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
        fjd.register_backend()
        model.set_attention_backend("flashjvp")
        ref.set_attention_backend("native")
        base.set_attention_backend("native")
        # the inputs made below follow the weights' device
        model, ref, base = model.to(DEVICE), ref.to(DEVICE), base.to(DEVICE)
        fn, fn64, x, n_attn = make_fn(model, 2, torch.float32), make_fn(ref, 2, torch.float64), torch.randn(shape), 2
        fn32 = make_fn(base, 2, torch.float32)
        entry = "attention"
    else:
        model = make_dit(diffusers_mod.DiTTransformer2DModel)
        ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
        fjd.apply(model)
        assert {type(m.processor) for m in model.modules() if hasattr(m, "processor")} == {fjd.FlashJVPAttnProcessor}
        model, ref, base = model.to(DEVICE), ref.to(DEVICE), base.to(DEVICE)
        fn, fn64, x, n_attn = dit_fn(model, 2), dit_fn(ref, 2), torch.randn(2, 4, 8, 8), 2
        fn32 = dit_fn(base, 2)
        entry = None  # the processor calls flashjvp.sdpa (its kernels are counted below), not the spied names
        # and pushes no TorchFunctionMode, which would cost Python in each of its torch calls
        modes = []
        for m in model.modules():
            if isinstance(getattr(m, "processor", None), fjd.FlashJVPAttnProcessor):
                m.to_q.register_forward_hook(
                    lambda *_: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    x = x.to(DEVICE)
    t = torch.randn_like(x)
    spy = Spy(monkeypatch)
    with torch.no_grad(), Launches() as launches, warnings.catch_warnings():
        warnings.simplefilter("error", SDPAFallbackWarning)
        got = torch.func.jvp(fn, (x,), (t,))
    assert launches.fwd == n_attn, launches.fwd  # one fused forward+JVP launch per attention layer
    if name == "dit_processor":
        assert modes == [0] * n_attn, modes
    if entry is not None:
        spy.only(entry, n_attn)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jvp(lambda h: fn64(h.double()), (x.double(),), (t.double(),))
        baseline = torch.func.jvp(fn32, (x,), (t,))
    for g, w, b in zip(got, want, baseline):
        assert_close_rel(g, w, rtol=1e-4, base=b)


def test_diffusers_dit_meanflow_trains(diffusers_mod):
    """MeanFlow steps of a DiT on FlashJVPAttnProcessor: the first gradients match the float64
    math model's, and a few Adam steps lower the loss."""
    from flashjvp.integrations import diffusers as fjd
    from test_models import make_dit

    model = make_dit(diffusers_mod.DiTTransformer2DModel).train()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    fjd.apply(model)
    model, ref, base = model.to(DEVICE), ref.to(DEVICE), base.to(DEVICE)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 8, 8, generator=g).to(DEVICE)
    e = torch.randn(2, 4, 8, 8, generator=g).to(DEVICE)
    r, t = torch.tensor([0.1, 0.3], device=DEVICE), torch.tensor([0.6, 0.9], device=DEVICE)
    labels = torch.tensor([1, 2], device=DEVICE)

    def loss_of(m, dtype):
        tt, rr = t.to(dtype), r.to(dtype)
        z = (1 - tt[:, None, None, None]) * x.to(dtype) + tt[:, None, None, None] * e.to(dtype)
        v = e.to(dtype) - x.to(dtype)
        fn = lambda z, tt: m(z, timestep=tt * 999, class_labels=labels).sample[:, :4]  # noqa: E731
        u, dudt = torch.func.jvp(fn, (z, tt), (v, torch.ones_like(tt)))
        target = v - (tt - rr)[:, None, None, None] * dudt
        return ((u - target.detach()) ** 2).mean()

    for m, dtype in ((model, torch.float32), (ref, torch.float64), (base, torch.float32)):
        with sdpa_kernel(SDPBackend.MATH):
            loss_of(m, dtype).backward()
    largest = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    for (name, p), q, b in zip(model.named_parameters(), ref.parameters(), base.parameters()):
        if q.grad is not None:
            try:
                assert_close_rel(p.grad, q.grad, rtol=1e-3, floor=1e-2 * largest, base=b.grad)
            except AssertionError as e:
                raise AssertionError(f"gradient of {name}: {e}") from None
    assert_trains(model, loss_of, lr=1e-3)


# --- diffusers context parallelism ---------------------------------------------------------------

def _cp_worker(rank, world, path, ring, ulysses):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        _import_torchvision()
        import diffusers
        from diffusers import ContextParallelConfig

        from flashjvp.integrations import diffusers as fjd

        # diffusers computes the device as rank % torch.accelerator.device_count(), 0 on a CPU.
        torch.accelerator.device_count = lambda: 1
        model = make_flux(diffusers)
        ref = copy.deepcopy(model).double()
        x = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(1))
        t = torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(2))
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            want = torch.func.jvp(flux_fn(ref, 2, torch.float64), (x.double(),), (t.double(),))
        fjd.register_backend()
        model.set_attention_backend("flashjvp")
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))
        with torch.no_grad(), Launches() as launches:
            out = flux_fn(model, 2, torch.float32)(x)
        assert launches.fwd > 0
        assert_close_rel(out, want[0], rtol=1e-4)
        with torch.no_grad():  # through diffusers' output gather: enable_context_parallel_jvp
            got = torch.func.jvp(flux_fn(model, 2, torch.float32), (x,), (t,))
        jvp_close(got, want)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ring,ulysses", [(1, 2), (2, 1), (2, 2)], ids=["ulysses", "ring", "unified"])
def test_diffusers_context_parallel(diffusers_mod, ring, ulysses):
    """A Flux transformer under diffusers' enable_parallelism(ContextParallelConfig) on the
    "flashjvp" backend, on ``ring * ulysses`` CPU processes (gloo): its forward and its
    torch.func.jvp match the float64 single-process model."""
    if not interpreting():
        pytest.skip("the CPU ranks run the kernels through TRITON_INTERPRET=1")
    world = ring * ulysses
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_cp_worker, args=(world, os.path.join(tmp, "rendezvous"), ring, ulysses), nprocs=world)


# --- the example -------------------------------------------------------------------------------

def test_meanflow_dit_finetune_smoke(diffusers_mod, tmp_path):
    """examples/meanflow_dit_finetune.py end to end for a few steps in a subprocess without
    TRITON_INTERPRET (flashjvp's CPU math fallback), then a fine-tune from the saved DiT."""
    pytest.importorskip("sklearn", reason="the example needs scikit-learn")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join((os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"),
                                         *filter(None, [os.environ.get("PYTHONPATH")])))
    # test_models' torchvision workaround (PyPI's CUDA torchvision beside a CPU torch), then the example
    run = ("import sys, runpy; from test_models import _import_torchvision; _import_torchvision(); "
           "runpy.run_path(sys.argv[1])['main'](sys.argv[2:])")
    script = os.path.join(ROOT, "examples", "meanflow_dit_finetune.py")
    for extra in (["--save", str(tmp_path / "dit")], ["--init", str(tmp_path / "dit")]):
        proc = subprocess.run([sys.executable, "-c", run, script, "--steps", "4", "--batch-size", "16",
                               "--device", "cpu", "--out", str(tmp_path), *extra],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "PyTorch math fallback" in proc.stdout and "1-step samples classified" in proc.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 4 and 0.0 <= metrics["accuracy_1step"] <= 1.0 and metrics["last_loss"] > 0
