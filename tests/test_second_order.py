"""Gradients through the tangent (second order): the backward of forward+JVP against float64 double
differentiation of the math reference (``torch.autograd`` through ``torch.func.jvp`` of
``attention_ref``), for every output (o, to, lse, mu), every tangent subset, both causal
alignments, GQA, Dqk != Dv, cross-attention and sizes that are not multiples of a block."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import flashjvp
from flashjvp._launch import LaunchLog
from helpers import DTYPE_IDS, DTYPES, ON_GPU, assert_close, make_qkv

GRAD_NAMES = ("dq", "dk", "dv", "dtq", "dtk", "dtv")
# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout)
SHAPES = [
    pytest.param((1, 2, 2, 37, 37, 32, 32, "bhnd"), id="self-37"),
    pytest.param((2, 4, 2, 19, 45, 40, 24, "bnhd"), id="gqa-cross-d40x24-bnhd"),
    pytest.param((1, 3, 1, 50, 17, 16, 16, "bhnd"), id="mqa-nq50-nk17"),
]
if ON_GPU:
    SHAPES += [pytest.param((2, 8, 2, 999, 999, 128, 128, "bnhd"), id="gqa-999-d128"),
               pytest.param((1, 4, 4, 1, 300, 72, 72, "bhnd"), id="n1-d72"),
               pytest.param((2, 4, 4, 1024, 1024, 64, 64, "bhnd"), id="1024-d64")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("top_left", id="top-left"),
          pytest.param("bottom_right", id="bottom-right")]
SUBSETS = [pytest.param(s, id=s or "none") for s in ("qkv", "q", "k", "v", "qv", "")]


def _inputs(shape, dtype, given="qkv"):
    b, hq, hkv, nq, nk, dqk, dv, layout = shape
    q, k, v, tq, tk, tv = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype)
    tangents = [t if name in given else None for name, t in zip("qkv", (tq, tk, tv))]
    return [q, k, v, *tangents], layout


def _loss(fn, xs, cot, **kw):
    """<(o, to, lse, mu), cot> with ``fn`` = attention_jvp or attention_jvp_ref; lse's -inf rows
    (no visible key) contribute nothing."""
    o, to, lse, mu = fn(*xs, return_lse=True, **kw)
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return sum((out * c.to(out.dtype)).sum() for out, c in zip((o, to, lse, mu), cot))


def _grads(fn, xs, cot, dtype, **kw):
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_() for x in xs]
    _loss(fn, leaves, cot, **kw).backward()
    return [None if x is None else x.grad for x in leaves]


def _check(xs, cot, dtype, **kw):
    got = _grads(flashjvp.attention_jvp, xs, cot, dtype, **kw)
    truth = _grads(flashjvp.attention_jvp_ref, xs, cot, torch.float64, **kw)
    lowp = _grads(flashjvp.attention_jvp_ref, xs, cot, dtype, **kw)
    for name, g, t, lp in zip(GRAD_NAMES, got, truth, lowp):
        assert (g is None) == (t is None), name
        if g is not None:
            assert_close(name, g, t, lp, dtype)


def _cotangents(xs, layout, outputs="o,to,lse,mu"):
    q, v = xs[0], xs[2]
    b, nq, hq = q.shape[0], q.shape[2 if layout == "bhnd" else 1], q.shape[1 if layout == "bhnd" else 2]
    o_shape = (b, hq, nq, v.shape[-1]) if layout == "bhnd" else (b, nq, hq, v.shape[-1])
    want = outputs.split(",")

    def make(name, shape):
        return (torch.randn if name in want else torch.zeros)(shape, device=q.device)

    return [make("o", o_shape), make("to", o_shape), make("lse", (b, hq, nq)), make("mu", (b, hq, nq))]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES)
def test_second_order_matches_double_differentiation(shape, causal, dtype):
    xs, layout = _inputs(shape, dtype)
    _check(xs, _cotangents(xs, layout), dtype, causal=causal, layout=layout)


@pytest.mark.parametrize("given", SUBSETS)
def test_tangent_subsets(given):
    """None tangents stay None (no gradient) and their products are skipped in the backward."""
    xs, layout = _inputs((1, 2, 1, 29, 33, 16, 16, "bhnd"), torch.float32, given)
    cot = _cotangents(xs, layout, "o,to")
    with LaunchLog() as log:
        _check(xs, cot, torch.float32, causal="bottom_right", layout=layout)
    flags = [r.flags for r in log.launches if r.kernel == "_attn_bwd_jvp_dq_kernel"]
    assert flags, "the second-order backward did not run"
    assert all((f["HAS_TQ"], f["HAS_TK"], f["HAS_TV"]) == tuple(n in given for n in "qkv") for f in flags)


@pytest.mark.parametrize("outputs", ["to", "lse", "mu", "o,mu"])
def test_each_output_alone(outputs):
    xs, layout = _inputs((1, 2, 2, 21, 21, 16, 16, "bhnd"), torch.float32)
    _check(xs, _cotangents(xs, layout, outputs), torch.float32, causal=True, layout=layout)


def test_loss_without_to():
    """A loss of o, lse and mu that never touches to: autograd then hands the backward no cotangent
    for to at all (None, not zeros), and the lse and mu cotangents must still count."""
    xs, layout = _inputs((1, 2, 2, 21, 21, 16, 16, "bhnd"), torch.float32)
    g = torch.Generator().manual_seed(1)
    grads = {}
    for name, fn, dtype in (("got", flashjvp.attention_jvp, torch.float32),
                            ("truth", flashjvp.attention_jvp_ref, torch.float64),
                            ("lowp", flashjvp.attention_jvp_ref, torch.float32)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in xs]
        o, _, lse, mu = fn(*leaves, causal=True, layout=layout, return_lse=True)
        if name == "got":
            w = [torch.randn(t.shape, generator=g) for t in (o, lse, mu)]
        sum((t * wt.to(dtype)).sum() for t, wt in zip((o, lse, mu), w)).backward()
        grads[name] = [x.grad for x in leaves[:5]]  # tv: nothing used here depends on it
    for n, got, t, lp in zip(("dq", "dk", "dv", "dtq", "dtk"), grads["got"], grads["truth"], grads["lowp"]):
        assert_close(n, got, t, lp, torch.float32)


def _model_grads(attention, xs, w, dtype, use_forward_ad):
    """Gradients of <o, w0> + <to, w1> after a JVP of ``attention`` (the MeanFlow pattern without
    the detach; terminal velocity matching) by torch.func.jvp or forward_ad dual tensors."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in xs]
    q, k, v, tq, tk, tv = leaves
    if use_forward_ad:
        with fwAD.dual_level():
            o, to = fwAD.unpack_dual(attention(*[fwAD.make_dual(x, t) for x, t in zip((q, k, v), (tq, tk, tv))],
                                               causal=True))
    else:
        o, to = torch.func.jvp(lambda *a: attention(*a, causal=True), (q, k, v), (tq, tk, tv))
    ((o * w[0].to(dtype)).sum() + (to * w[1].to(dtype)).sum()).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("use_forward_ad", [False, True], ids=["func-jvp", "forward-ad"])
def test_backward_through_jvp_of_attention(use_forward_ad):
    xs, _ = _inputs((2, 2, 2, 23, 23, 16, 16, "bhnd"), torch.float32)
    w = [torch.randn_like(xs[0]) for _ in range(2)]
    with LaunchLog() as log:
        got = _model_grads(flashjvp.attention, xs, w, torch.float32, use_forward_ad)
    assert log.count("_attn_fwd_kernel") == 1 and log.count("_attn_bwd_jvp_dq_kernel") == 1
    truth = _model_grads(flashjvp.attention_ref, xs, w, torch.float64, use_forward_ad)
    lowp = _model_grads(flashjvp.attention_ref, xs, w, torch.float32, use_forward_ad)
    for name, g, t, lp in zip(GRAD_NAMES, got, truth, lowp):
        assert_close(name, g, t, lp, torch.float32)


def test_cpu_math_path_agrees(monkeypatch):
    """Without the interpreter CPU tensors take the math path: it computes the same gradients."""
    xs, layout = _inputs((1, 2, 1, 15, 18, 16, 16, "bhnd"), torch.float32)
    cot = _cotangents(xs, layout)
    kernel = _grads(flashjvp.attention_jvp, xs, cot, torch.float32, causal=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if ON_GPU:
        xs = [x.cpu() for x in xs]
        cot = [c.cpu() for c in cot]
    math = _grads(flashjvp.attention_jvp, xs, cot, torch.float32, causal=True)
    for name, a, b in zip(GRAD_NAMES, kernel, math):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=name)


def test_gradcheck_float32():
    """``torch.autograd.gradcheck`` of every output with respect to every input (float32: the
    kernels take no float64; finite differences with a matching step and tolerance)."""
    q, k, v, tq, tk, tv = (x.detach().requires_grad_() for x in
                           make_qkv(1, 1, 1, 5, 6, 16, 16, "bhnd", torch.float32))

    def fn(*a):
        o, to, lse, mu = flashjvp.attention_jvp(*a, causal="bottom_right", return_lse=True)
        return o, to, lse, mu

    assert torch.autograd.gradcheck(fn, (q, k, v, tq, tk, tv), eps=1e-2, atol=2e-2, rtol=2e-2,
                                    nondet_tol=1e-5, fast_mode=True)


def test_comparison_catches_a_wrong_gradient(monkeypatch):
    """The comparison can fail: doubling dtk in the launcher's result is caught, by name."""
    from flashjvp import _autograd

    real = _autograd.attn_bwd_jvp

    def wrong(*args):
        g = list(real(*args))
        g[4] = g[4] * 2
        return tuple(g)

    monkeypatch.setattr(_autograd, "attn_bwd_jvp", wrong)
    xs, layout = _inputs((1, 2, 2, 17, 17, 16, 16, "bhnd"), torch.float32)
    with pytest.raises(AssertionError, match="dtk"):
        _check(xs, _cotangents(xs, layout), torch.float32, layout=layout)


def test_inputs_are_not_modified():
    xs, layout = _inputs((1, 2, 2, 17, 17, 16, 16, "bnhd"), torch.float32)
    before = [x.clone() for x in xs]
    _grads(flashjvp.attention_jvp, xs, _cotangents(xs, layout), torch.float32, layout=layout)
    for a, b in zip(xs, before):
        assert torch.equal(a, b)


def test_inputs_are_read_in_place(monkeypatch):
    """The second-order backward reads q, k, v, the tangents, o, to and the cotangents through their
    own strides: each reaches the kernels as a view of its own memory (no contiguous copy), whatever
    its layout; only a tensor whose head dim is not unit-stride is copied."""
    from flashjvp import _bwd_jvp

    seen = []
    real = _bwd_jvp.launch_tuned

    def spy(kernel, grid, *args, **kwargs):
        seen.append([x for x in args if isinstance(x, torch.Tensor)])
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_bwd_jvp, "launch_tuned", spy)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 19, 23, 16, 16, "bnhd", torch.float32,
                                   kinds=("swapped", "sliced", "contiguous", "strided"))
    leaves = [x.detach().requires_grad_() for x in (q, k, v, tq, tk, tv)]
    o, to = flashjvp.attention_jvp(*leaves, layout="bnhd")
    (o.sum() + (to * to).sum()).backward()
    assert len(seen) == 2, "the second-order backward did not run"
    ptrs = {x.data_ptr() for x in seen[0]}
    for name, x in zip(("q", "k", "v", "tq", "tk", "tv"), (q, k, v, tq, tk, tv)):
        if x.stride(-1) == 1:
            assert x.data_ptr() in ptrs, f"{name} ({x.stride()}) was copied"
    assert o.data_ptr() in ptrs and to.data_ptr() in ptrs
