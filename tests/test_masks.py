"""Attention masks (``attn_mask``): boolean and additive float masks of every broadcast shape, read
tile by tile by the forward+JVP, backward and second-order kernels, against the float64 reference
with the same mask; a key-padding-shaped mask takes the one-vector-per-tile path."""

import pytest
import torch

import flashjvp
from flashjvp._launch import LaunchLog
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    assert_close,
    check_second_order,
    grad_refs,
    jvp_refs,
    make_qkv,
)

# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout)
SHAPES = [
    pytest.param((2, 2, 2, 37, 45, 32, 32, "bhnd"), id="b2-37x45"),
    pytest.param((2, 4, 2, 19, 33, 40, 24, "bnhd"), id="gqa-d40x24-bnhd"),
]
if ON_GPU:
    SHAPES += [pytest.param((2, 8, 2, 999, 1024, 128, 128, "bnhd"), id="gqa-1024-d128"),
               pytest.param((2, 4, 4, 512, 700, 64, 64, "bhnd"), id="xattn-700-d64")]
CAUSAL = [pytest.param(False, id="full"), pytest.param("bottom_right", id="bottom-right")]


def _mask(kind: str, b: int, h: int, nq: int, nk: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(kind) + nq)
    if kind == "key-padding":  # (B, 1, 1, Nk); batch element 1 sees only its first key
        m = torch.rand(b, 1, 1, nk, generator=g) > 0.3
        m[1, ..., 1:] = False
        m[1, ..., 0] = True
    elif kind == "bool-per-head":  # with a row that sees nothing
        m = torch.rand(b, h, nq, nk, generator=g) > 0.5
        m[0, 0, 3] = False
    elif kind == "bool-query-rows":  # (B, 1, Nq, 1): whole rows on or off, read per row, not per key
        m = torch.rand(b, 1, nq, 1, generator=g) > 0.3
        m[0, 0, 2] = False
        m[0, 0, 0] = True
    elif kind == "bool-rows":  # (Nq, Nk): the same for every batch element and head
        m = torch.rand(nq, nk, generator=g) > 0.2
    elif kind == "float-heads":  # (1, H, Nq, Nk), with -inf entries
        m = torch.randn(1, h, nq, nk, generator=g)
        m[torch.rand(1, h, nq, nk, generator=g) > 0.8] = float("-inf")
        m = m.to(dtype)
    else:  # "float-keys": (Nk,)
        m = torch.randn(nk, generator=g).to(dtype)
    return m.to(DEVICE)


KINDS = ["key-padding", "bool-per-head", "bool-query-rows", "bool-rows", "float-heads", "float-keys"]


def _inputs(shape, kind, dtype):
    if not ON_GPU and dtype != torch.float32 and kind != "float-heads":
        pytest.skip("interpreter: half precision only with a half-precision mask (time)")
    b, hq, hkv, nq, nk, dqk, dv, layout = shape
    xs = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype)
    return xs, dict(layout=layout, attn_mask=_mask(kind, b, hq, nq, nk, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_jvp(shape, kind, causal, dtype):
    xs, kw = _inputs(shape, kind, dtype)
    with LaunchLog() as log:
        out = flashjvp.attention_jvp(*xs, causal=causal, return_lse=True, **kw)
    rows_vary = kind != "key-padding" and kind != "float-keys"
    assert log.count("_attn_fwd_kernel", HAS_MASK=True, MASK_ROWS=rows_vary) == 1
    truth, lowp = jvp_refs(*xs, causal=causal, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, dtype)
    o = flashjvp.attention(*xs[:3], causal=causal, **kw)
    assert_close("o (forward only)", o, truth[0], lowp[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[2:])
def test_backward(shape, kind, causal, dtype):
    xs, kw = _inputs(shape, kind, dtype)
    leaves = [x.detach().requires_grad_() for x in xs[:3]]
    o = flashjvp.attention(*leaves, causal=causal, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = grad_refs(*xs[:3], do, causal=causal, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


@pytest.mark.parametrize("kind", ["bool-per-head", "float-keys"])
def test_second_order(kind):
    xs, kw = _inputs((2, 2, 1, 21, 30, 16, 16, "bhnd"), kind, torch.float32)
    check_second_order(xs, **kw)


def test_func_jvp_with_a_mask_made_inside():
    """A mask built inside the transformed function (torch.func wraps it) runs the fused kernel."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 13, 17, 16, 16, "bhnd", torch.float32)
    lens = torch.tensor([9], device=DEVICE)

    def fn(q, k, v):
        mask = (torch.arange(17, device=DEVICE) < lens[:, None])[:, None, None, :]
        return flashjvp.attention(q, k, v, attn_mask=mask)

    with LaunchLog() as log:
        out, tout = torch.func.jvp(fn, (q, k, v), (tq, tk, tv))
    assert log.count("_attn_fwd_kernel", HAS_MASK=True, HAS_TQ=True) == 1
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, kv_lens=lens)
    assert_close("o", out, truth[0], lowp[0], torch.float32)
    assert_close("to", tout, truth[1], lowp[1], torch.float32)


def test_bad_masks():
    q, k, v = make_qkv(2, 2, 2, 5, 7, 8, 8, "bhnd", torch.float32, tangents=False)
    with pytest.raises(ValueError, match="^attn_mask: expected a shape broadcastable to"):
        flashjvp.attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="^attn_mask: expected dtype"):
        flashjvp.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="^attn_mask: expected dtype"):  # bytes are not booleans (SDPA's rule)
        flashjvp.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="^attn_mask: a mask that requires grad"):
        flashjvp.attention(q, k, v, attn_mask=torch.zeros(5, 7, device=DEVICE, requires_grad=True))
    with pytest.raises(TypeError, match="^attn_mask: expected a torch.Tensor"):
        flashjvp.attention(q, k, v, attn_mask=[[True]])
    mask, tmask = torch.zeros(5, 7, device=DEVICE), torch.ones(5, 7, device=DEVICE)
    with pytest.raises(ValueError, match="carries a forward tangent"):
        torch.func.jvp(lambda m: flashjvp.attention(q, k, v, attn_mask=m), (mask,), (tmask,))
