"""flashjvp.sdpa / flashjvp.patch_sdpa: a drop-in for torch.nn.functional.scaled_dot_product_attention.

Runs on the GPU when there is one, else on the CPU through Triton's interpreter
(TRITON_INTERPRET=1); shapes stay tiny either way. Every test of the kernel path counts the
kernel launches (LaunchLog), so it fails if flashjvp's kernels are not used. Fallbacks (dropout,
masks that take a derivative, ...) are compared with PyTorch's math backend, the one whose random
numbers they reproduce.
"""

import copy
import sys
import threading
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa_alias

import flashjvp
from flashjvp import patch_sdpa, sdpa
from flashjvp._policy import interpreting
from flashjvp.sdpa import SDPAFallbackWarning, _math_sdpa
from helpers import DEVICE, Launches, assert_close

sdpa_module = sys.modules["flashjvp.sdpa"]  # the package attribute `flashjvp.sdpa` is the function

pytestmark = [pytest.mark.usefixtures("fresh_sdpa_warnings"),
              pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                 reason="needs a GPU or TRITON_INTERPRET=1")]

TOL = dict(rtol=1e-5, atol=1e-5)


def fallback_warnings(record):
    return [w for w in record if issubclass(w.category, SDPAFallbackWarning)]


def rand(*shape, dtype=torch.float32, seed=None, device=DEVICE):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=dtype, generator=g).to(device)


def qkv(b, hq, hkv, nq, nk, d, dv, dtype=torch.float32, seed=0, device=DEVICE):
    return (rand(b, hq, nq, d, dtype=dtype, seed=seed, device=device),
            rand(b, hkv, nk, d, dtype=dtype, seed=seed + 1, device=device),
            rand(b, hkv, nk, dv, dtype=dtype, seed=seed + 2, device=device))


def ones_mask(*shape, dtype=torch.bool):
    return torch.ones(*shape, dtype=dtype, device=DEVICE)


def math_sdpa_torch(*args, **kwargs):
    """PyTorch's own SDPA on its math backend: the one that works under torch.func.jvp."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, is_causal, scale, enable_gqa)
KERNEL_CASES = [
    pytest.param(2, 2, 2, 16, 16, 16, 16, False, None, False, id="plain"),
    pytest.param(1, 2, 2, 13, 29, 8, 16, True, None, False, id="causal-Nq<Nk"),
    pytest.param(1, 2, 2, 29, 13, 16, 8, True, 0.3, False, id="causal-Nq>Nk-scale"),
    pytest.param(1, 4, 2, 16, 24, 16, 16, False, None, True, id="gqa"),
    pytest.param(1, 4, 1, 9, 17, 8, 8, True, 0.7, True, id="mqa-causal-scale"),
]


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, dv, causal, scale, gqa", KERNEL_CASES)
def test_forward_matches_torch_sdpa(b, hq, hkv, nq, nk, d, dv, causal, scale, gqa):
    q, k, v = qkv(b, hq, hkv, nq, nk, d, dv)
    with warnings.catch_warnings(record=True) as record, Launches() as n:
        warnings.simplefilter("always")
        out = sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    assert n.fwd == 1, "flashjvp's kernel was not launched"
    assert not fallback_warnings(record)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("shape_q, shape_kv", [
    ((13, 8), (21, 8)),  # (L, E): no batch, no heads
    ((3, 13, 8), (3, 21, 8)),  # (H, L, E)
    ((2, 3, 2, 13, 8), (2, 3, 2, 21, 8)),  # two batch dims
])
def test_leading_batch_dims(shape_q, shape_kv):
    q, k, v = rand(*shape_q, seed=0), rand(*shape_kv, seed=1), rand(*shape_kv, seed=2)
    with Launches() as n:
        out = sdpa(q, k, v, is_causal=True)
    assert n.fwd == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, dv, causal, scale, gqa", KERNEL_CASES[1:4])
def test_jvp_matches_math_reference(b, hq, hkv, nq, nk, d, dv, causal, scale, gqa):
    primals = qkv(b, hq, hkv, nq, nk, d, dv)
    tangents = qkv(b, hq, hkv, nq, nk, d, dv, seed=10)
    kw = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    with Launches() as n:
        out, tout = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, **kw), primals, tangents)
    ref, tref = torch.func.jvp(lambda q, k, v: math_sdpa_torch(q, k, v, **kw), primals, tangents)
    assert n.fwd == 1, "o and its tangent must come from one fused launch"
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)


def test_forward_ad_dual_tensors():
    q, k, v = qkv(1, 2, 2, 16, 20, 8, 8)
    tq, tk, tv = qkv(1, 2, 2, 16, 20, 8, 8, seed=7)
    with fwAD.dual_level(), Launches() as n:
        out = sdpa(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), fwAD.make_dual(v, tv), is_causal=True)
        out, tout = fwAD.unpack_dual(out)
    ref, tref = torch.func.jvp(lambda *x: math_sdpa_torch(*x, is_causal=True), (q, k, v), (tq, tk, tv))
    assert n.fwd == 1
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)


def packed_projection(b, n, h, d, seed):
    """q, k, v cut out of one (B, N, 3, H, D) projection, as a DiT block does: (B, H, N, D) views
    whose memory is in (B, N, H, D) order."""
    return rand(b, n, 3, h, d, seed=seed).permute(2, 0, 3, 1, 4).unbind(0)


@pytest.mark.parametrize("mode", ["plain", "jvp", "grad"])
def test_output_in_query_order(mode):
    """Like SDPA's fused kernels, flashjvp gives ``out`` (and its tangent) in the query's order of
    dimensions, so that a model's ``out.transpose(1, 2).reshape(B, N, H * D)`` is a view, not a
    copy; every element is written (outputs start as NaN) and right."""
    b, n, h, d = 2, 19, 3, 8
    primals = packed_projection(b, n, h, d, seed=3)
    tangents = packed_projection(b, n, h, d, seed=4)
    if mode == "grad":
        primals = tuple(x.detach().requires_grad_() for x in primals)
    with Launches() as launches:
        if mode == "jvp":
            out, tout = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, is_causal=True), primals, tangents)
        else:
            out = sdpa(*primals, is_causal=True)
    assert launches.fwd == 1
    ref, tref = torch.func.jvp(lambda *x: math_sdpa_torch(*x, is_causal=True), primals, tangents)
    assert out.transpose(1, 2).is_contiguous(), f"out strides {out.stride()}, not in the query's order"
    torch.testing.assert_close(out, ref, **TOL)
    if mode == "jvp":
        assert tout.stride() == out.stride()
        torch.testing.assert_close(tout, tref, **TOL)
    if mode == "grad":
        do = rand(*out.shape, seed=5)
        got = torch.autograd.grad(out, primals, do)
        want = torch.autograd.grad(math_sdpa_torch(*primals, is_causal=True), primals, do)
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, dv, causal, scale, gqa", KERNEL_CASES[1:5])
def test_backward_matches_torch_sdpa(b, hq, hkv, nq, nk, d, dv, causal, scale, gqa):
    kw = dict(is_causal=causal, scale=scale, enable_gqa=gqa)
    grads = []
    for fn in (sdpa, F.scaled_dot_product_attention):
        q, k, v = (x.requires_grad_() for x in qkv(b, hq, hkv, nq, nk, d, dv))
        with Launches() as n:
            out = fn(q, k, v, **kw)
            (out * rand(*out.shape, seed=5)).sum().backward()
        grads.append((q.grad, k.grad, v.grad, n))
    (dq, dk, dv_, n), (rq, rk, rv, _) = grads
    assert n.fwd == 1 and n.bwd == 1, "flashjvp's forward and backward kernels must both run"
    for got, want in ((dq, rq), (dk, rk), (dv_, rv)):
        torch.testing.assert_close(got, want, **TOL)


def test_no_interpreter_still_exact(monkeypatch):
    """CPU tensors without the interpreter: flashjvp runs its math reference, same answers."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = qkv(1, 4, 2, 13, 17, 8, 8, device="cpu")
    with Launches() as n:
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert n.fwd == 0
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               **TOL)


# --- fallbacks: valid arguments the kernels lack -------------------------------------------------

def _bool_mask():
    m = torch.rand(12, 20, generator=torch.Generator().manual_seed(3)) > 0.4
    m[2] = False  # a row that sees no key: SDPA gives zeros there
    return m.to(DEVICE)


# --- masks: served by the kernels --------------------------------------------------------------

def _key_padding_mask():
    m = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    m[0, ..., 13:] = False
    m[1, ..., 1:] = False
    return m.to(DEVICE)


MASKS = {
    "bool-2d": _bool_mask,
    "bool-key-padding": _key_padding_mask,
    "bool-per-head": lambda: (rand(2, 2, 12, 20, seed=6) > 0).to(DEVICE),
    "float-broadcast-heads": lambda: rand(2, 1, 12, 20, seed=4),
    "float-keys-only": lambda: rand(20, seed=7),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_run_the_kernels(name):
    """Boolean and float masks of any broadcast shape: the kernels' forward, tangent and backward
    match PyTorch's math backend, and nothing falls back."""
    mask = MASKS[name]()
    primals, tangents = qkv(2, 2, 2, 12, 20, 8, 8), qkv(2, 2, 2, 12, 20, 8, 8, seed=10)
    with warnings.catch_warnings(record=True) as record, Launches() as n:
        warnings.simplefilter("always")
        out, tout = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, attn_mask=mask), primals, tangents)
        leaves = [x.clone().requires_grad_() for x in primals]
        sdpa(*leaves, attn_mask=mask).square().sum().backward()
    assert not fallback_warnings(record)
    assert n.fwd == 2 and n.bwd == 1
    ref, tref = torch.func.jvp(lambda q, k, v: math_sdpa_torch(q, k, v, attn_mask=mask), primals, tangents)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)
    refs = [x.clone().requires_grad_() for x in primals]
    math_sdpa_torch(*refs, attn_mask=mask).square().sum().backward()
    for name_, got, want in zip("qkv", leaves, refs):
        torch.testing.assert_close(got.grad, want.grad, **TOL, msg=lambda m, n_=name_: f"d{n_}: {m}")


FALLBACKS = {
    "dropout": dict(dropout_p=0.3),
    "negative_scale": dict(scale=-0.4),
    "zero_scale": dict(scale=0.0),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_matches_and_warns_once_per_call_site(name):
    kw = FALLBACKS[name]
    q, k, v = qkv(2, 2, 2, 12, 20, 8, 8)
    outs = []
    with warnings.catch_warnings(record=True) as record, Launches() as n:
        warnings.simplefilter("always")  # the once-per-call-site rule is flashjvp's own
        for _ in range(5):
            torch.manual_seed(0)
            outs.append(sdpa(q, k, v, **kw))
    assert n.fwd == 0
    got = fallback_warnings(record)
    assert len(got) == 1, [str(w.message) for w in got]
    assert got[0].filename == __file__, "the warning must point at the caller's line"
    torch.manual_seed(0)
    ref = math_sdpa_torch(q, k, v, **kw)
    for out in outs:
        torch.testing.assert_close(out, ref, **TOL)


def test_two_call_sites_warn_twice():
    q, k, v = qkv(1, 2, 2, 8, 8, 8, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            sdpa(q, k, v, scale=-0.5)
            sdpa(q, k, v, scale=-0.5)
            sdpa(q, k, v, dropout_p=0.1)
    assert len(fallback_warnings(record)) == 3


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_under_jvp(name):
    kw = FALLBACKS[name]
    primals, tangents = qkv(2, 2, 2, 12, 20, 8, 8), qkv(2, 2, 2, 12, 20, 8, 8, seed=10)
    torch.manual_seed(0)
    with pytest.warns(SDPAFallbackWarning):
        out, tout = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, **kw), primals, tangents)
    torch.manual_seed(0)
    ref, tref = torch.func.jvp(lambda q, k, v: math_sdpa_torch(q, k, v, **kw), primals, tangents)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)


def test_float_mask_tangent_and_backward():
    q, k, v = qkv(1, 2, 2, 12, 20, 8, 8)
    mask, tmask = rand(1, 2, 12, 20, seed=4), rand(1, 2, 12, 20, seed=5)
    fn = lambda m, fn_=sdpa: fn_(q, k, v, attn_mask=m)  # noqa: E731
    with pytest.warns(SDPAFallbackWarning):
        out, tout = torch.func.jvp(fn, (mask,), (tmask,))
    ref, tref = torch.func.jvp(lambda m: fn(m, math_sdpa_torch), (mask,), (tmask,))
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)
    m1, m2 = mask.clone().requires_grad_(), mask.clone().requires_grad_()
    fn(m1).square().sum().backward()  # same call site as above: no second warning
    math_sdpa_torch(q, k, v, attn_mask=m2).square().sum().backward()
    torch.testing.assert_close(m1.grad, m2.grad, **TOL)


def test_dropout_applies_in_no_grad_and_eval_like_sdpa():
    q, k, v = qkv(1, 2, 2, 8, 8, 8, 8)
    with torch.no_grad(), pytest.warns(SDPAFallbackWarning):
        torch.manual_seed(1)
        out = sdpa(q, k, v, dropout_p=0.5)
        torch.manual_seed(1)
        ref = math_sdpa_torch(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(out, ref, **TOL)
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("case", ["float64", "head_dim_300", "kv_heads_differ"])
def test_other_fallbacks(case):
    kw = {}
    if case == "float64":
        q, k, v = qkv(1, 2, 2, 9, 11, 8, 8, dtype=torch.float64)
    elif case == "head_dim_300":
        q, k, v = qkv(1, 1, 1, 5, 6, 300, 260)
    else:  # SDPA allows it with enable_gqa; the kernels do not
        q, k, v = rand(1, 4, 9, 8, seed=0), rand(1, 2, 11, 8, seed=1), rand(1, 1, 11, 8, seed=2)
        kw = dict(enable_gqa=True)
    tangents = tuple(rand(*x.shape, dtype=x.dtype, seed=20 + i) for i, x in enumerate((q, k, v)))
    with pytest.warns(SDPAFallbackWarning), Launches() as n:
        out, tout = torch.func.jvp(lambda *x: sdpa(*x, **kw), (q, k, v), tangents)
    ref, tref = torch.func.jvp(lambda *x: math_sdpa_torch(*x, **kw), (q, k, v), tangents)
    assert n.fwd == 0
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(tout, tref, **TOL)


def test_math_sdpa_matches_torch_math_backend_exactly_enough():
    """_math_sdpa is PyTorch's math backend in plain ops: bool/float masks, causal, GQA, scale."""
    q, k, v = qkv(2, 4, 2, 12, 20, 8, 16, dtype=torch.float64)
    for kw in (dict(is_causal=True, enable_gqa=True, scale=0.2), dict(attn_mask=_bool_mask(), enable_gqa=True),
               dict(attn_mask=rand(2, 1, 12, 20, dtype=torch.float64, seed=9), enable_gqa=True)):
        torch.testing.assert_close(_math_sdpa(q, k, v, **kw), math_sdpa_torch(q, k, v, **kw),
                                   rtol=1e-12, atol=1e-12)


# --- arguments SDPA rejects or defines itself: the same outcome as PyTorch's SDPA ----------------

def _bad_cases():
    q, k, v = qkv(1, 4, 4, 8, 8, 8, 8)
    k2, k3, k1 = rand(1, 2, 8, 8), rand(1, 3, 8, 8), rand(1, 1, 8, 8)
    return {
        "dtype_mismatch": ((q, k.half(), v), {}),
        "rank_1": ((q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]), {}),
        "long_dtype": ((q.long(), k.long(), v.long()), {}),
        "dropout_above_1": ((q, k, v), dict(dropout_p=1.5)),
        "gqa_not_dividing": ((q, k3, k3), dict(enable_gqa=True)),
        "gqa_without_flag": ((q, k2, k2), {}),
        "int_mask": ((q, k, v), dict(attn_mask=ones_mask(8, 8, dtype=torch.int32))),
        "head_dim_mismatch": ((q, rand(1, 4, 8, 4), v), {}),
        "key_not_tensor": ((q, [1.0], v), {}),
        "is_causal_int": ((q, k, v), dict(is_causal=1)),
        "scale_str": ((q, k, v), dict(scale="0.5")),
        # valid for SDPA, served by PyTorch itself
        "mqa_broadcast_without_flag": ((q, k1, k1), {}),
        "broadcast_batch": ((rand(2, 4, 8, 8), k, v), {}),
        "empty_query": ((q[:, :, :0], k, v), {}),
        "mask_and_causal": ((q, k, v), dict(attn_mask=ones_mask(8, 8), is_causal=True)),
    }


def _outcome(fn, args, kwargs):
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - comparing whatever SDPA raises
        return None, e


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_or_unusual_arguments_behave_like_sdpa(name):
    args, kwargs = _bad_cases()[name]
    want, want_err = _outcome(F.scaled_dot_product_attention, args, kwargs)
    with warnings.catch_warnings(record=True) as record, Launches() as n:
        warnings.simplefilter("always")
        got, got_err = _outcome(sdpa, args, kwargs)
    assert n.fwd == 0
    if want_err is not None:
        assert type(got_err) is type(want_err) and str(got_err) == str(want_err), (got_err, want_err)
        assert not fallback_warnings(record), "no warning before an error"
    else:
        assert got_err is None, got_err
        torch.testing.assert_close(got, want, **TOL)
        assert len(fallback_warnings(record)) == 1


# --- patch_sdpa ----------------------------------------------------------------------------------

def test_patch_catches_attribute_and_alias():
    q, k, v = qkv(1, 2, 2, 16, 16, 8, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with patch_sdpa(), Launches() as n:
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = sdpa_alias(q, k, v, is_causal=True)
        c = torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, True)  # positional
    assert n.fwd == 3
    for out in (a, b, c):
        torch.testing.assert_close(out, ref, **TOL)


def test_nothing_changes_outside_the_context():
    q, k, v = qkv(1, 2, 2, 16, 16, 8, 8)
    original = F.scaled_dot_product_attention
    depth = torch.overrides._len_torch_function_stack()
    with patch_sdpa():
        assert torch.overrides._len_torch_function_stack() == depth + 1
    assert F.scaled_dot_product_attention is original is sdpa_alias
    assert torch.overrides._len_torch_function_stack() == depth
    with Launches() as n:
        F.scaled_dot_product_attention(q, k, v)
        sdpa_alias(q, k, v)
    assert n.fwd == 0


def test_patch_is_removed_after_an_exception():
    depth = torch.overrides._len_torch_function_stack()
    with pytest.raises(ZeroDivisionError), patch_sdpa():
        1 / 0  # noqa: B018
    assert torch.overrides._len_torch_function_stack() == depth


def test_decorator_forms():
    q, k, v = qkv(1, 2, 2, 16, 16, 8, 8)

    @patch_sdpa
    def bare(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    @patch_sdpa()
    def called(q, k, v):
        return sdpa_alias(q, k, v)

    with Launches() as n:
        a, b = bare(q, k, v), called(q, k, v)
    assert n.fwd == 2 and bare.__name__ == "bare"
    torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(TypeError, match="patch_sdpa: expected a callable or no argument, got int"):
        patch_sdpa(3)


def test_nested_and_reentrant_use():
    q, k, v = qkv(1, 2, 2, 16, 16, 8, 8)
    depth = torch.overrides._len_torch_function_stack()
    cm = patch_sdpa()

    @cm
    def recurse(i):
        out = F.scaled_dot_product_attention(q, k, v)
        return out if i == 0 else recurse(i - 1)

    with Launches() as n, cm, cm, patch_sdpa():
        F.scaled_dot_product_attention(q, k, v)  # one launch, not one per active mode
        recurse(2)
    assert n.fwd == 4
    assert torch.overrides._len_torch_function_stack() == depth


def test_fallback_inside_nested_patches_does_not_recurse():
    q, k, v = qkv(1, 4, 4, 8, 8, 8, 8)
    k1 = rand(1, 1, 8, 8)
    with warnings.catch_warnings(record=True) as record, patch_sdpa(), patch_sdpa():
        warnings.simplefilter("always")
        a = F.scaled_dot_product_attention(q, k, v, scale=-0.5)  # math fallback
        b = F.scaled_dot_product_attention(q, k1, k1)  # served by PyTorch's SDPA itself
    assert len(fallback_warnings(record)) == 2
    torch.testing.assert_close(a, F.scaled_dot_product_attention(q, k, v, scale=-0.5), **TOL)
    torch.testing.assert_close(b, F.scaled_dot_product_attention(q, k1, k1), **TOL)


def test_patch_is_thread_local():
    q, k, v = qkv(1, 2, 2, 16, 16, 8, 8)
    seen = {}

    def other():
        with Launches() as n:
            F.scaled_dot_product_attention(q, k, v)
        seen["fwd"] = n.fwd

    with patch_sdpa():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["fwd"] == 0


@pytest.mark.parametrize("redispatch", ["skip_one_hop", "rebound_globals"])
def test_patch_under_jvp_and_through_torch_modules(redispatch, monkeypatch):
    """nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward (itself a torch
    function): the patch must reach it, and torch.func.jvp must run the fused kernel. Both ways
    of reaching it: torch._C._skip_one_hop_torch_function where PyTorch has it (2.13), and the
    copy with rebound globals used without it (2.11)."""
    if redispatch == "rebound_globals":
        monkeypatch.setattr(sdpa_module, "_redispatch", None)
    elif sdpa_module._redispatch is None:
        pytest.skip("this PyTorch has no torch._C._skip_one_hop_torch_function")
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True).to(DEVICE)
    x, t = rand(2, 8, 16, seed=1), rand(2, 8, 16, seed=2)
    fn = lambda x: mha(x, x, x, need_weights=False, is_causal=False)[0]  # noqa: E731
    mha64 = copy.deepcopy(mha).double()
    fn64 = lambda x: mha64(x, x, x, need_weights=False, is_causal=False)[0]  # noqa: E731
    with sdpa_kernel(SDPBackend.MATH):
        ref, tref = torch.func.jvp(fn, (x,), (t,))
        truth, ttruth = torch.func.jvp(fn64, (x.double(),), (t.double(),))
    with patch_sdpa(), Launches() as n:
        out, tout = torch.func.jvp(fn, (x,), (t,))
    assert n.fwd == 1
    # within 3x the error of the same float32 model on PyTorch's math SDPA (+ floor), vs float64
    assert_close("out", out, truth, ref, torch.float32)
    assert_close("tout", tout, ttruth, tref, torch.float32)


def test_exports():
    assert flashjvp.sdpa is sdpa and flashjvp.patch_sdpa is patch_sdpa
    assert {"sdpa", "patch_sdpa"} <= set(flashjvp.__all__)


def test_vmap_and_jacfwd():
    """Under vmap (and so jacfwd) flashjvp runs its math reference: still SDPA's numbers."""
    q, k = rand(3, 2, 8, 4, seed=0), rand(3, 2, 8, 4, seed=1)
    out = torch.func.vmap(lambda a, b: sdpa(a, b, b, is_causal=True))(q, k)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, is_causal=True), **TOL)
    q, k = q[:1], k[:1]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jac = torch.func.jacfwd(lambda a: sdpa(a, k, k))(q)
    assert not fallback_warnings(record)
    torch.testing.assert_close(jac, torch.func.jacfwd(lambda a: math_sdpa_torch(a, k, k))(q), **TOL)
