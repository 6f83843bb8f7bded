"""Triton backward (dq, dk, dv) against float64 math gradients."""

import pytest
import torch

import flashjvp
import flashjvp._bwd
import flashjvp._fwd
import flashjvp._launch
from helpers import (
    DTYPE_IDS,
    DTYPES,
    MEMORY_KINDS,
    Launches,
    assert_close,
    grad_refs,
    jvp_refs,
    make_qkv,
    make_tensor,
    shape_of,
)

SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 16, 16), id="n1"),
    pytest.param((2, 2, 2, 37, 37, 40, 40), id="n37-d40"),
    pytest.param((1, 4, 2, 37, 19, 72, 24), id="gqa2-37x19-d72x24"),
    pytest.param((1, 3, 1, 19, 53, 96, 72), id="mqa-19x53-d96x72"),
    pytest.param((1, 1, 1, 17, 9, 256, 200), id="d256x200"),
    pytest.param((1, 2, 2, 5, 7, 1, 3), id="d1x3"),
]
CAUSAL = [pytest.param(c, id=f"causal={c}") for c in (False, "top_left", "bottom_right")]
DT = [pytest.param(d, id=DTYPE_IDS[d]) for d in DTYPES]


def _grads(shape, causal, dtype, layout, kinds):
    q, k, v = make_qkv(*shape, layout, dtype, kinds, tangents=False)
    b, hq, _, nq, _, _, dv = shape
    do = make_tensor(shape_of(b, hq, nq, dv, layout), kinds[-1], dtype)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention(*leaves, causal=causal, layout=layout)
    grads = torch.autograd.grad(o, leaves, do)
    return (q, k, v, do), grads


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_match_reference(shape, causal, dtype):
    i = sum(shape) % len(MEMORY_KINDS)
    layout, kinds = ("bhnd", "bnhd")[i % 2], MEMORY_KINDS[i:] + MEMORY_KINDS[:i]
    (q, k, v, do), grads = _grads(shape, causal, dtype, layout, kinds)
    truth, lowp = grad_refs(q, k, v, do, causal=causal, layout=layout)
    for name, x, g, ref, ref_lp in zip(("dq", "dk", "dv"), (q, k, v), grads, truth, lowp):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert_close(name, g, ref, ref_lp, dtype)


def test_gqa_gradients_are_deterministic():
    shape, kinds = (1, 6, 2, 29, 45, 32, 32), MEMORY_KINDS
    torch.manual_seed(0)
    _, g1 = _grads(shape, "top_left", torch.float32, "bnhd", kinds)
    torch.manual_seed(0)
    _, g2 = _grads(shape, "top_left", torch.float32, "bnhd", kinds)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_rows_without_visible_keys_get_zero_gradients():
    nq, nk = 20, 6
    q, k, v = make_qkv(1, 2, 2, nq, nk, 16, 16, "bhnd", torch.float32, tangents=False)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention(*leaves, causal="bottom_right")
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert torch.count_nonzero(dq[:, :, : nq - nk]) == 0
    truth, lowp = grad_refs(q, k, v, do, causal="bottom_right")
    for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), (dq, dk, dv), truth, lowp):
        assert_close(name, g, ref, ref_lp, torch.float32)


def _saved_count(fn):
    count = [0]

    def pack(x):
        count[0] += 1
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return count[0]


def test_saves_for_backward_only_when_needed():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, 16, "bhnd", torch.float32, tangents=False)
    assert _saved_count(lambda: flashjvp.attention(q, k, v)) == 0
    assert flashjvp.attention(q, k, v).grad_fn is None
    v.requires_grad_()
    assert _saved_count(lambda: flashjvp.attention(q, k, v)) == 5  # q, k, v, o, lse


def test_gradient_through_tangent_output():
    """A gradient reaching ``to`` runs the second-order backward (one launch of its kernels; a
    gradient of ``o`` alone the plain backward), with the float64 double-differentiation result
    (tests/test_second_order.py covers the shapes and outputs)."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 9, 9, 16, 16, "bhnd", torch.float32)
    wo, wt = torch.randn_like(q), torch.randn_like(q)
    grads = {}
    for name, dtype in (("got", torch.float32), ("truth", torch.float64), ("lowp", torch.float32)):
        fn = flashjvp.attention_jvp if name == "got" else flashjvp.attention_jvp_ref
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, tq)]
        with Launches() as n:
            o, to = fn(*leaves, tk.to(dtype), tv.to(dtype))[:2]
            (o * wo.to(dtype)).sum().backward(retain_graph=True)
            first = n.count("_attn_bwd_jvp_dq_kernel"), n.count("_attn_bwd_dq_kernel")
            (to * wt.to(dtype)).sum().backward()
        if name == "got":
            assert first == (0, 1), first  # o alone: the plain backward
            assert n.count("_attn_bwd_jvp_dq_kernel") == 1
        grads[name] = [x.grad for x in leaves]
    for label, g, t, lp in zip(("dq", "dk", "dv", "dtq"), grads["got"], grads["truth"], grads["lowp"]):
        assert_close(label, g, t, lp, torch.float32)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_aligned_rows_vector_path(layout, monkeypatch):
    """Head dims 72/40 with strides that are multiples of 8 but not 16: the kernels run with
    ALIGN=8 (vectorized loads, see ``vector_align``), forward+JVP and backward both exact."""
    seen = []

    def spy(*args):
        seen.append(flashjvp._launch.vector_align(*args))
        return seen[-1]

    for mod in (flashjvp._fwd, flashjvp._bwd):
        monkeypatch.setattr(mod, "vector_align", spy)
    shape = (1, 4, 2, 29, 45, 72, 40)
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, torch.float32, ("contiguous", "swapped"))
    o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal="bottom_right", layout=layout)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal="bottom_right", layout=layout)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)
    (q, k, v, do), grads = _grads(shape, "bottom_right", torch.float32, layout, ("contiguous", "swapped"))
    truth, lowp = grad_refs(q, k, v, do, causal="bottom_right", layout=layout)
    for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), grads, truth, lowp):
        assert_close(name, g, ref, ref_lp, torch.float32)
    assert seen == [8, 8, 8], seen  # fwd+JVP, forward, backward
