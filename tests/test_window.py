"""Sliding-window attention (``window=(left, right)``): query ``i`` sees key ``j`` iff
``i + off - left <= j <= i + off + right`` (``-1``: that side unbounded; causal attention is a right
bound of 0; ``off = Nk - Nq`` for bottom-right alignment, ``causal="bottom_right"`` or
``align="bottom_right"``, else 0), together with key padding. The
forward, the fused tangent, the backward and the second-order backward are checked against the float64
reference; the reference itself is checked against a dense mask built element by element."""

import pytest
import torch

import flashjvp
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

# id: ((B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout), window, causal, kv_lens[, align]): a window with Nq != Nk
# names its alignment (causal="bottom_right" or align)
_CASES = {
    "left3-self": ((2, 2, 2, 37, 37, 32, 32, "bhnd"), (3, 0), False, None),
    "right5-xattn-d40-bnhd": ((1, 2, 2, 37, 45, 40, 40, "bnhd"), (0, 5), False, None, "bottom_right"),
    "7x7-causal-gqa-d32x24": ((1, 4, 2, 45, 45, 32, 24, "bhnd"), (7, 7), True, None),
    "left16-bottom-right-mqa": ((1, 2, 1, 37, 45, 40, 40, "bnhd"), (16, -1), "bottom_right", None),
    "right4-kvlens": ((2, 2, 2, 37, 45, 16, 16, "bhnd"), (-1, 4), False, [20, 45], "bottom_right"),
    "diagonal-nq-gt-nk": ((1, 2, 2, 45, 37, 16, 16, "bnhd"), (0, 0), False, None, "top_left"),
    "wider-than-seq-bottom-right-kvlens": ((2, 2, 1, 37, 45, 32, 32, "bhnd"), (1000, 1000), "bottom_right", [0, 30]),
    "one-query-bottom-right": ((2, 2, 1, 1, 45, 40, 24, "bnhd"), (4, 2), "bottom_right", None),
    "one-key-causal": ((1, 2, 2, 37, 1, 16, 16, "bhnd"), (2, 0), True, None, "top_left"),
    "left5-causal-nq-gt-nk-kvlens": ((1, 2, 2, 45, 37, 24, 24, "bnhd"), (5, -1), True, [30], "bottom_right"),
    # Bounds one past a block edge (the interpreter's blocks are 16 wide): an off-by-one in the block
    # ranges (which blocks a row or key visits) shows only at such offsets.
    "1x1-self": ((1, 2, 2, 37, 37, 16, 16, "bhnd"), (1, 1), False, None),
    "17x17-self-bnhd": ((1, 2, 2, 37, 37, 16, 16, "bnhd"), (17, 17), False, None),
    "bottom-right-nk-nq-plus-1": ((1, 2, 2, 37, 38, 16, 16, "bhnd"), None, "bottom_right", None),
}
if ON_GPU:
    _CASES |= {
        # one past the GPU tiles' 64- and 128-wide edges on both sides
        "65x129-gqa-d64": ((1, 4, 2, 1000, 1100, 64, 64, "bhnd"), (65, 129), False, None, "bottom_right"),
        "left256-causal-gqa-1024-d128": ((2, 8, 2, 1000, 1024, 128, 128, "bnhd"), (256, 0), True, None, "top_left"),
        "128x128-2048-d128": ((1, 4, 4, 2048, 2048, 128, 128, "bhnd"), (128, 128), False, None),
        "left256-bottom-right-kvlens-d128": ((2, 4, 4, 1537, 2048, 128, 64, "bhnd"), (256, 0), "bottom_right",
                                             [1800, 2048]),
    }


def _params(ids=None):
    """One param per case and dtype: every dtype on the GPU, one dtype per case (cycled) on the CPU."""
    out = []
    for n, (cid, case) in enumerate(_CASES.items()):
        if ids is not None and cid not in ids:
            continue
        dtypes = DTYPES if ON_GPU else [DTYPES[n % len(DTYPES)]]
        out += [pytest.param(case, d, id=f"{cid}-{DTYPE_IDS[d]}") for d in dtypes]
    return out


def _inputs(case, dtype):
    (b, hq, hkv, nq, nk, dqk, dv, layout), window, causal, lens, *align = case
    xs = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype)
    kv_lens = None if lens is None else torch.tensor(lens, device=DEVICE)
    return xs, dict(layout=layout, causal=causal, window=window, kv_lens=kv_lens, align=(align or [None])[0])


# ---- the kernels against the reference ----

@pytest.mark.parametrize(("case", "dtype"), _params())
def test_forward_and_jvp(case, dtype):
    xs, kw = _inputs(case, dtype)
    out = flashjvp.attention_jvp(*xs, return_lse=True, **kw)
    truth, lowp = jvp_refs(*xs, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, dtype)
    o = flashjvp.attention(*xs[:3], **kw)
    assert_close("o (forward only)", o, truth[0], lowp[0], dtype)


_BACKWARD = ["left3-self", "7x7-causal-gqa-d32x24", "left16-bottom-right-mqa", "right4-kvlens",
             "diagonal-nq-gt-nk", "wider-than-seq-bottom-right-kvlens", "one-query-bottom-right",
             "left5-causal-nq-gt-nk-kvlens", "1x1-self", "17x17-self-bnhd", "bottom-right-nk-nq-plus-1",
             "65x129-gqa-d64", "left256-causal-gqa-1024-d128", "128x128-2048-d128"]


@pytest.mark.parametrize(("case", "dtype"), _params(_BACKWARD))
def test_backward(case, dtype):
    xs, kw = _inputs(case, dtype)
    leaves = [x.detach().requires_grad_() for x in xs[:3]]
    o = flashjvp.attention(*leaves, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = grad_refs(*xs[:3], do, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


@pytest.mark.parametrize(("window", "causal", "lens"), [
    pytest.param((5, 3), False, [11, 30], id="5x3-kvlens"),
    pytest.param((4, -1), "bottom_right", [30, 0], id="left4-bottom-right-kvlens"),
])
def test_second_order(window, causal, lens):
    xs = make_qkv(2, 2, 1, 21, 30, 16, 16, "bhnd", torch.float32)
    kw = dict(causal=causal, window=window, kv_lens=torch.tensor(lens, device=DEVICE), align="bottom_right")
    check_second_order(xs, **kw)


def test_func_jvp_of_attention():
    """``torch.func.jvp`` of the windowed ``attention`` gives the fused tangent."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 29, 29, 16, 16, "bnhd", torch.float32)
    kw = dict(causal=True, window=(6, 0), layout="bnhd")
    o, to = torch.func.jvp(lambda q_, k_, v_: flashjvp.attention(q_, k_, v_, **kw), (q, k, v), (tq, tk, tv))
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, **kw)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


def test_unbounded_window_is_no_window():
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 19, 23, 16, 16, "bhnd", torch.float32)
    plain = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal="bottom_right", return_lse=True)
    unbounded = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal="bottom_right", return_lse=True,
                                       window=(-1, -1))
    for name, a, b in zip(("o", "to", "lse", "mu"), plain, unbounded):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


_BAD = [
    pytest.param((-2, 0), ValueError, id="negative"),
    pytest.param((0, -2), ValueError, id="negative-right"),
    pytest.param((1,), TypeError, id="one-int"),
    pytest.param("x", TypeError, id="string"),
    pytest.param((1.0, 2), TypeError, id="float"),
]


@pytest.mark.parametrize(("window", "exc"), _BAD)
def test_bad_window(window, exc):
    q = torch.randn(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(exc, match=r"^window: "):
        flashjvp.attention(q, q, q, window=window)
    with pytest.raises(exc, match=r"^window: "):
        flashjvp.attention_jvp(q, q, q, q, window=window)


# ---- the reference against a dense mask built element by element ----

def _dense_mask(nq, nk, window, causal, kv_len, align=None):
    """The visibility rule, written out: query i sees key j iff j < kv_len, j <= i + off + right
    (right >= 0; causal: right = 0) and j >= i + off - left (left >= 0)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    off = nk - nq if "bottom_right" in (causal, align) else 0
    mask = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            mask[i, j] = (j < kv_len and (right < 0 or j <= i + off + right)
                          and (left < 0 or j >= i + off - left))
    return mask


def _dense_attention(q, k, v, mask, scale):
    """(B, H, N, D) float64 softmax attention with a per-batch (B, Nq, Nk) mask; empty rows: o = 0, lse = -inf."""
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


_REF_WINDOWS = [None, (3, 0), (0, 5), (7, 7), (16, -1), (-1, 4), (0, 0), (100, 100)]


@pytest.mark.parametrize("window", _REF_WINDOWS, ids=str)
@pytest.mark.parametrize(("causal", "align"), [
    (False, "top_left"), (False, "bottom_right"), (True, "top_left"), (True, "bottom_right"), ("bottom_right", None),
], ids=["full-top-left", "full-bottom-right", "top-left", "causal-align-bottom-right", "bottom-right"])
@pytest.mark.parametrize(("nq", "nk"), [(13, 21), (21, 13), (1, 9)], ids=["nq<nk", "nq>nk", "one-query"])
def test_reference_matches_dense_mask(nq, nk, causal, align, window):
    b, h, d = 2, 2, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for n in (nq, nk, nk))
    lens = [nk, max(1, nk - 4)]
    mask = torch.stack([_dense_mask(nq, nk, window, causal, n, align) for n in lens])
    o_want, lse_want = _dense_attention(q, k, v, mask, d ** -0.5)
    o, lse = flashjvp.attention_ref(q, k, v, causal=causal, window=window, return_lse=True,
                                    kv_lens=torch.tensor(lens), align=align)
    torch.testing.assert_close(o, o_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), lse_want.float().double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(lse), ~mask.any(-1)[:, None].expand_as(lse))
    chunked = flashjvp.attention_ref(q, k, v, causal=causal, window=window, block_q=4, kv_lens=torch.tensor(lens),
                                     align=align)
    torch.testing.assert_close(chunked, o, rtol=0, atol=1e-12)


def test_reference_attn_mask_agrees_with_window():
    """The reference's attn_mask: a bool mask (or its 0 / -inf float form) equal to a window's dense mask
    gives the window's result; a finite float mask is added to the scaled logits; both combine with the window."""
    b, h, nq, nk, d = 2, 2, 11, 14, 8
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.float64) for n in (nq, nk, nk))  # bnhd
    window, causal = (2, 3), "bottom_right"
    dense = torch.stack([_dense_mask(nq, nk, window, causal, nk)] * b)  # (B, Nq, Nk)
    want, want_lse = flashjvp.attention_ref(q, k, v, causal=causal, window=window, layout="bnhd", return_lse=True)
    for mask in (dense[:, None], torch.zeros(dense.shape).masked_fill(~dense, float("-inf"))[:, None]):
        got, lse = flashjvp.attention_ref(q, k, v, attn_mask=mask, layout="bnhd", return_lse=True, block_q=4)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    keep = torch.rand(b, 1, nq, nk) > 0.3  # a bool mask combines with the window: both must allow a pair
    got = flashjvp.attention_ref(q, k, v, causal=causal, window=window, attn_mask=keep, layout="bnhd")
    want = flashjvp.attention_ref(q, k, v, attn_mask=dense[:, None] & keep, layout="bnhd")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    bias = torch.randn(h, nq, nk)  # broadcast over the batch
    got = flashjvp.attention_ref(q, k, v, causal=causal, window=window, attn_mask=bias, layout="bnhd")
    s = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * d ** -0.5 + bias
    p = torch.softmax(s.masked_fill(~dense[:, None], float("-inf")), dim=-1)
    torch.testing.assert_close(got, (p @ v.transpose(1, 2)).transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_reference_jvp_and_gradients_of_empty_rows():
    """Rows left of a one-key window that is all padding: o, to, mu and every gradient are zero."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 9, 9, 8, 8, "bhnd", torch.float64, device="cpu")
    kw = dict(window=(0, 0), kv_lens=torch.tensor([4]))  # rows 4.. see no key
    o, to, lse, mu = flashjvp.attention_jvp_ref(q, k, v, tq, tk, tv, return_lse=True, **kw)
    assert torch.isneginf(lse[..., 4:]).all() and torch.isfinite(lse[..., :4]).all()
    for x in (o[..., 4:, :], to[..., 4:, :], mu[..., 4:]):
        assert torch.count_nonzero(x) == 0
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    flashjvp.attention_ref(*leaves, **kw).square().sum().backward()
    assert torch.count_nonzero(leaves[0].grad[..., 4:, :]) == 0
    assert torch.count_nonzero(leaves[1].grad[..., 4:, :]) == 0  # keys 4.. are padding
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize(("window", "exc"), _BAD)
def test_reference_bad_window(window, exc):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(exc, match=r"^window: "):
        flashjvp.attention_ref(q, q, q, window=window)
