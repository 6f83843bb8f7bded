"""Packed variable-length batches (``attention_varlen``, flash-attn's convention): sequence ``b`` is
query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of
(total, H, D) tensors, each sequence attended on its own (causal alignment and window by its own
lengths). Sequences of 0 and 1 queries or keys, query lengths != key lengths, GQA, windows and
q, k, v and tangents each in its own memory layout; the forward, the fused tangent, the backward and the
second-order backward against the float64 reference, and against ``attention`` run on each sequence."""

import pytest
import torch

import flashjvp
from flashjvp.ref import attention_jvp_ref, attention_varlen_jvp_ref, attention_varlen_ref
from helpers import (
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    assert_close,
    check_second_order,
    cu_seqlens,
    make_varlen,
    varlen_grad_refs,
    varlen_jvp_refs,
)

# id: (query lengths, key lengths, Hq, Hkv, Dqk, Dv, window)
_CASES = {
    "self-mixed": ([17, 1, 0, 20], [17, 1, 0, 20], 2, 2, 32, 32, None),
    "xattn-gqa-d40x24": ([7, 0, 21, 1], [19, 4, 11, 0], 4, 2, 40, 24, None),
    "window3x2-mqa": ([13, 1, 26], [20, 5, 26], 2, 1, 16, 16, (3, 2)),
}
if ON_GPU:
    _CASES |= {
        "long-gqa-d128": ([1000, 1, 0, 2048, 513], [1024, 7, 3, 2048, 1], 8, 2, 128, 128, None),
        "long-window256-d128": ([1500, 0, 777, 1], [2048, 5, 777, 300], 4, 4, 128, 64, (256, 0)),
    }
CAUSAL = {False: "full", True: "top-left", "bottom_right": "bottom-right"}


def _params(every_causal=True):
    """Every case x causal x dtype on the GPU; on the CPU one dtype per (case, causal), cycled, and
    with ``every_causal=False`` one causal mode per case, cycled."""
    out, n = [], 0
    for c, (cid, case) in enumerate(_CASES.items()):
        for m, (causal, cname) in enumerate(CAUSAL.items()):
            if not (ON_GPU or every_causal or m == c % len(CAUSAL)):
                continue
            dtypes = DTYPES if ON_GPU else [DTYPES[n % len(DTYPES)]]
            n += 1
            out += [pytest.param(case, causal, d, id=f"{cid}-{cname}-{DTYPE_IDS[d]}") for d in dtypes]
    return out


def _inputs(case, dtype, tangents=True):
    lens_q, lens_k, hq, hkv, dqk, dv, window = case
    xs, cu_q, cu_k, mq, mk = make_varlen(lens_q, lens_k, hq, hkv, dqk, dv, dtype, tangents=tangents)
    return xs, (cu_q, cu_k, mq, mk), window


# ---- the kernels against the reference ----

@pytest.mark.parametrize(("case", "causal", "dtype"), _params())
def test_forward_and_jvp(case, causal, dtype):
    (q, k, v, tq, tk, tv), lens, window = _inputs(case, dtype)
    kw = dict(causal=causal, window=window)
    out = flashjvp.attention_varlen_jvp(q, k, v, *lens, tq, tk, tv, return_lse=True, **kw)
    truth, lowp = varlen_jvp_refs(q, k, v, *lens, tq, tk, tv, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, dtype)
    o = flashjvp.attention_varlen(q, k, v, *lens, **kw)
    assert_close("o (forward only)", o, truth[0], lowp[0], dtype)


@pytest.mark.parametrize(("case", "causal", "dtype"), _params(every_causal=False))
def test_backward(case, causal, dtype):
    (q, k, v), lens, window = _inputs(case, dtype, tangents=False)
    kw = dict(causal=causal, window=window)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention_varlen(*leaves, *lens, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = varlen_grad_refs(q, k, v, *lens, do, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


@pytest.mark.parametrize(("causal", "window"), [
    pytest.param(False, (2, 1), id="full-window2x1"),
    pytest.param("bottom_right", None, id="bottom-right"),
])
def test_second_order(causal, window):
    xs, lens, _ = _inputs(([6, 0, 11, 1], [9, 3, 11, 0], 2, 1, 16, 16, None), torch.float32)
    kw = dict(causal=causal, window=window)

    def packed(jvp_fn):
        return lambda q, k, v, tq, tk, tv, **kw_: jvp_fn(q, k, v, *lens, tq, tk, tv, **kw_)
    check_second_order(xs, packed(flashjvp.attention_varlen_jvp), packed(attention_varlen_jvp_ref), **kw)


_SMALL = ([5, 0, 14, 1], [9, 2, 14, 0], 2, 1, 24, 16, None)


@pytest.mark.parametrize("given", [("tq",), ("tk", "tv"), ()], ids=lambda g: "+".join(g) or "none")
def test_tangent_subsets(given):
    """Missing tangents are zero; with none at all, ``to`` and ``mu`` are zero."""
    (q, k, v, tq, tk, tv), lens, _ = _inputs(_SMALL, torch.float32)
    ts = {n: (t if n in given else None) for n, t in (("tq", tq), ("tk", tk), ("tv", tv))}
    out = flashjvp.attention_varlen_jvp(q, k, v, *lens, ts["tq"], ts["tk"], ts["tv"], causal=True,
                                        return_lse=True)
    truth, lowp = varlen_jvp_refs(q, k, v, *lens, ts["tq"], ts["tk"], ts["tv"], causal=True)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, torch.float32)
    if not given:
        assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[3]) == 0
    o, to = flashjvp.attention_varlen_jvp(q, k, v, *lens, ts["tq"], ts["tk"], ts["tv"], causal=True)
    assert_close("o (no lse)", o, truth[0], lowp[0], torch.float32)
    assert_close("to (no lse)", to, truth[1], lowp[1], torch.float32)


def test_func_jvp_of_attention_varlen():
    """``torch.func.jvp`` of ``attention_varlen`` gives the fused tangent."""
    (q, k, v, tq, tk, tv), (cu_q, cu_k, mq, mk), _ = _inputs(_SMALL, torch.float32)
    fn = lambda q_, k_, v_: flashjvp.attention_varlen(q_, k_, v_, cu_q, cu_k, mq, mk, causal=True)
    o, to = torch.func.jvp(fn, (q, k, v), (tq, tk, tv))
    truth, lowp = varlen_jvp_refs(q, k, v, cu_q, cu_k, mq, mk, tq, tk, tv, causal=True)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


@pytest.mark.parametrize(("causal", "window"), [
    pytest.param(False, None, id="full"),
    pytest.param("bottom_right", (4, -1), id="bottom-right-left4"),
])
def test_matches_attention_per_sequence(causal, window):
    """Property: the packed batch gives what ``attention_jvp`` gives on each sequence alone (within
    float32 rounding: the two may tile the work differently); rows of a sequence without keys are zero."""
    g = torch.Generator().manual_seed(7)
    lens_q = torch.randint(0, 20, (5,), generator=g).tolist() + [1, 0]
    lens_k = torch.randint(0, 20, (5,), generator=g).tolist() + [0, 6]
    (q, k, v, tq, tk, tv), (cu_q, cu_k, mq, mk), _ = _inputs((lens_q, lens_k, 2, 1, 16, 16, None), torch.float32)
    kw = dict(causal=causal, window=window)
    o, to, lse, mu = flashjvp.attention_varlen_jvp(q, k, v, cu_q, cu_k, mq, mk, tq, tk, tv, return_lse=True, **kw)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq = slice(cu_q[b].item(), cu_q[b + 1].item())
        rk = slice(cu_k[b].item(), cu_k[b + 1].item())
        if nq == 0:
            continue
        if nk == 0:
            assert torch.count_nonzero(o[rq]) == 0 and torch.count_nonzero(to[rq]) == 0
            assert torch.isneginf(lse[:, rq]).all() and torch.count_nonzero(mu[:, rq]) == 0
            continue
        seq = [x[None, r] for x, r in zip((q, k, v, tq, tk, tv), (rq, rk, rk) * 2)]
        want = flashjvp.attention_jvp(*seq, layout="bnhd", return_lse=True, **kw)
        got = (o[rq], to[rq], lse[:, rq], mu[:, rq])
        for name, x, w in zip(("o", "to", "lse", "mu"), got, want):
            w = w[0]
            torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5 * max(1.0, w.abs().max().item()),
                                       msg=lambda m, b=b, name=name: f"sequence {b}, {name}: {m}")


def _bad_args(what):
    (q, k, v), (cu_q, cu_k, mq, mk), _ = _inputs(([3, 5], [4, 4], 2, 2, 16, 16, None), torch.float32,
                                                 tangents=False)
    args = [q, k, v, cu_q, cu_k, mq, mk]
    if what == "int64":
        args[3] = cu_q.long()
    elif what == "max-short":
        args[5] = 4
    elif what == "last-offset":
        args[3] = cu_seqlens([3, 4])
    elif what == "q-2d":
        args[0] = q[:, 0]
    elif what == "cu-lengths-differ":
        args[4] = cu_seqlens([8])
    return args


_BAD = [
    pytest.param("int64", TypeError, r"^cu_seqlens_q: ", id="cu-int64"),
    pytest.param("max-short", ValueError, r"^max_seqlen_q: .*5", id="max-seqlen-too-small"),
    pytest.param("last-offset", ValueError, r"^cu_seqlens_q: .*8", id="last-offset-not-total"),
    pytest.param("q-2d", ValueError, r"^q: .*3-d", id="q-2d"),
    pytest.param("cu-lengths-differ", ValueError, r"^cu_seqlens_k: expected shape \(3,\)", id="cu-lengths-differ"),
]


@pytest.mark.parametrize(("what", "exc", "msg"), _BAD)
def test_bad_arguments(what, exc, msg):
    args = _bad_args(what)
    with pytest.raises(exc, match=msg):
        flashjvp.attention_varlen(*args)
    with pytest.raises(exc, match=msg):
        flashjvp.attention_varlen_jvp(*args, return_lse=True)


# ---- the reference against per-sequence attention_ref ----

@pytest.mark.parametrize("causal", [*CAUSAL, "top_left"], ids=[*CAUSAL.values(), "named-top-left"])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 5), (-1, 1)], ids=str)
def test_reference_is_per_sequence_reference(window, causal):
    """Each sequence as attention_jvp_ref on its own, aligned bottom-right (flash-attn's convention)
    unless causal names top-left."""
    lens_q, lens_k = [4, 0, 7, 1, 3], [6, 2, 7, 0, 1]
    (q, k, v, tq, tk, tv), (cu_q, cu_k, mq, mk), _ = _inputs((lens_q, lens_k, 4, 2, 8, 6, window), torch.float64)
    kw = dict(causal=causal, window=window)
    o, to, lse, mu = attention_varlen_jvp_ref(q, k, v, cu_q, cu_k, mq, mk, tq, tk, tv, return_lse=True, **kw)
    assert o.shape == to.shape == (sum(lens_q), 4, 6)
    assert lse.shape == mu.shape == (4, sum(lens_q)) and lse.dtype == mu.dtype == torch.float32
    o_only, lse_only = attention_varlen_ref(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kw)
    assert torch.equal(o_only, o) and torch.equal(lse_only, lse)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq = slice(cu_q[b].item(), cu_q[b + 1].item())
        rk = slice(cu_k[b].item(), cu_k[b + 1].item())
        if nq == 0:
            continue
        if nk == 0:
            want = (torch.zeros_like(o[rq]),) * 2 + (torch.full_like(lse[:, rq], float("-inf")),
                                                     torch.zeros_like(mu[:, rq]))
        else:
            seq = [x[None, r] for x, r in zip((q, k, v, tq, tk, tv), (rq, rk, rk) * 2)]
            align = None if isinstance(causal, str) else "bottom_right"
            want = [w[0] for w in attention_jvp_ref(*seq, layout="bnhd", return_lse=True, align=align, **kw)]
        for name, got, w in zip(("o", "to", "lse", "mu"), (o[rq], to[rq], lse[:, rq], mu[:, rq]), want):
            torch.testing.assert_close(got, w, rtol=0, atol=0, msg=f"sequence {b}, {name}")


def test_reference_gradients():
    """Reverse mode through the reference: finite, zero for rows of a sequence without keys and for keys
    of a sequence without queries; float64 gradcheck of a small batch."""
    lens_q, lens_k = [3, 2, 0, 4], [3, 0, 2, 5]
    (q, k, v), (cu_q, cu_k, mq, mk), _ = _inputs((lens_q, lens_k, 2, 1, 4, 3, None), torch.float64,
                                                 tangents=False)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o, lse = attention_varlen_ref(*leaves, cu_q, cu_k, mq, mk, causal="bottom_right", window=(1, 1),
                                  return_lse=True)
    (o.square().sum() + torch.where(torch.isinf(lse), 0, lse).sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    assert torch.count_nonzero(leaves[0].grad[3:5]) == 0  # sequence 1: no keys
    assert torch.count_nonzero(leaves[1].grad[3:5]) == 0 and torch.count_nonzero(leaves[2].grad[3:5]) == 0
    fn = lambda q_, k_, v_: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, mq, mk, causal=True, window=(2, 0))
    assert torch.autograd.gradcheck(fn, [x.detach().contiguous().requires_grad_() for x in (q, k, v)])


def test_reference_bad_arguments():
    for what, exc, msg in [p.values for p in _BAD]:
        with pytest.raises(exc, match=msg):
            attention_varlen_ref(*_bad_args(what))
        with pytest.raises(exc, match=msg):
            attention_varlen_jvp_ref(*_bad_args(what))

