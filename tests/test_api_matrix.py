"""The public API as one matrix: every public function (dense, packed, sdpa, distributed, the
references) x layout (named or left to its default) x tangents (none, all, only tq) x causal kind x
window x alignment x mask / key padding x return_lse, each call against a float64 result computed
here from the documented rule (docs/semantics.md), independently of flashjvp.ref.

The cross product is sampled deterministically: every pair of values of any two axes occurs in at
least one case (a greedy all-pairs cover with a fixed seed), plus the cases of issue #37 by name.
Sizes are tiny (one 16-wide block in Triton's CPU interpreter). The distributed functions run on 2
and 4 gloo ranks, all their cases in one spawn per group size. `make test` runs a seeded sample of
these cases (tests/conftest.py: MATRICES, INNER_MATRICES), `make test-full` all of them.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import random
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashjvp
import flashjvp.distributed as fd
from helpers import assert_close, cu_seqlens

DTYPE = torch.float32
INF = float("inf")


def _kernels_run() -> bool:
    return flashjvp.interface._use_kernels(torch.empty(0))


pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not _kernels_run(),
                                reason="the CPU matrix: kernels in Triton's interpreter (TRITON_INTERPRET=1)")


# --------------------------------------------------------------------------- the rule, written out

def diagonal_offset(api: str, causal, align, n_q: int, n_k: int) -> int:
    """Query i's diagonal key is ``i + offset``. The packed API mirrors flash-attn (bottom-right
    unless top-left is named); the dense API and sdpa mirror PyTorch (top-left unless bottom-right
    is named)."""
    if api == "varlen":
        bottom = "top_left" not in (causal, align)
    else:
        bottom = "bottom_right" in (causal, align)
    return n_k - n_q if bottom else 0


def visible(n_q, n_k, causal, offset, window, kv_len=None) -> torch.Tensor:
    """(Nq, Nk) bool: query i sees key j iff j <= i + offset + right (right = 0 when causal),
    j >= i + offset - left (each where >= 0) and j < kv_len."""
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    vis = torch.ones(n_q, n_k, dtype=torch.bool)
    if right >= 0:
        vis &= j <= i + offset + right
    if left >= 0:
        vis &= j >= i + offset - left
    if kv_len is not None:
        vis &= j < kv_len
    return vis


def softmax_attention(q, k, v, vis, bias=None, scale=None):
    """(o, lse) of (B, Hq, Nq, D) queries against (B, Hkv, Nk, D) keys, ``vis`` broadcastable to
    (B, Hq, Nq, Nk), ``bias`` added to the scaled logits; rows that see no key: o = 0, lse = -inf
    (and zero derivatives)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias
    vis = vis.expand(s.shape)
    dead = ~vis.any(-1, keepdim=True)
    s = torch.where(dead, torch.zeros_like(s), s.masked_fill(~vis, -INF))
    p = torch.softmax(s, -1) * ~dead
    lse = torch.logsumexp(s, -1).masked_fill(dead[..., 0], -INF)
    return p @ v, lse


def with_tangents(fn, xs, ts, dtype):
    """``(outs, tangents)`` of ``fn(q, k, v) -> tuple`` in ``dtype`` (missing tangents: zero)."""
    xs = tuple(x.detach().to(dtype) for x in xs)
    ts = tuple(torch.zeros_like(x) if t is None else t.detach().to(dtype) for x, t in zip(xs, ts))
    return torch.func.jvp(fn, xs, ts)


def _expected(c, primal, tangent) -> dict:
    """The outputs case ``c`` returns, from the reference's ``(o, lse)`` and their tangents."""
    (o, lse), (to, mu) = primal, tangent
    out = {"o": o}
    if "jvp" in c["fn"] or c["tangents"] != "none":
        out["to"] = to
    if c["lse"]:
        out["lse"] = lse.float()
        if "to" in out:
            out["mu"] = mu.float()
    return out


def compare(got: dict, truth: dict, lowp: dict, label: str = ""):
    assert set(got) == set(truth), f"{label}outputs {sorted(got)}, expected {sorted(truth)}"
    for name in truth:
        assert_close(f"{label}{name}", got[name], truth[name], lowp[name], DTYPE)


def pairwise(axes: dict, keep, seed: int, tries: int = 300) -> list[dict]:
    """A deterministic sample of the product of ``axes`` (filtered by ``keep``) in which every pair
    of values of two axes that occurs in the product occurs in a case (greedy: of ``tries`` random
    candidates, the one covering the most pairs not yet covered)."""
    names = list(axes)
    every = [c for c in (dict(zip(names, vals)) for vals in itertools.product(*axes.values())) if keep(c)]

    def pairs(c):
        return frozenset((a, repr(c[a]), b, repr(c[b])) for a, b in itertools.combinations(names, 2))

    cover = [pairs(c) for c in every]
    need = set().union(*cover)
    rng, chosen = random.Random(seed), []
    while need:
        pick = max(rng.sample(range(len(every)), min(tries, len(every))), key=lambda i: len(cover[i] & need))
        if not cover[pick] & need:  # the sample missed the last pairs: take a case that has one
            pick = next(i for i, c in enumerate(cover) if c & need)
        chosen.append(every[pick])
        need -= cover[pick]
    return chosen


def full_product(axes: dict, full: tuple[str, ...], keep) -> list[dict]:
    """Every combination of the axes in ``full``, the other axes' values cycled through (each
    advancing at its own pace, so that they meet in different combinations); filtered by ``keep``."""
    names = list(axes)
    out = []
    for n, vals in enumerate(itertools.product(*(axes[a] for a in full))):
        c = dict(zip(full, vals))
        for step, a in enumerate(x for x in names if x not in full):
            c[a] = axes[a][(n // (step + 1) + step) % len(axes[a])]
        c = {a: c[a] for a in names}
        if keep(c):
            out.append(c)
    return out


def _unique(cases: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in cases:
        if case_id(c) not in seen:
            seen.add(case_id(c))
            out.append(c)
    return out


def _tag(x) -> str:
    if x is None:
        return "none"
    if isinstance(x, tuple):
        return "x".join(map(str, x))
    return str(x).replace("_", "-")


def case_id(c: dict) -> str:
    return "-".join(f"{k}={_tag(v)}" if k not in ("fn",) else _tag(v) for k, v in c.items())


def _randn(*shape):
    return torch.randn(*shape, dtype=DTYPE)


# --------------------------------------------------------------------------- dense: attention*, refs

_DENSE_FNS = ("attention", "attention_jvp", "attention_ref", "attention_jvp_ref")
_SHAPES = {"self": (2, 2, 2, 12, 12, 8), "cross-gqa": (2, 4, 2, 9, 13, 8)}  # B, Hq, Hkv, Nq, Nk, D
_DENSE_AXES = dict(
    fn=list(_DENSE_FNS), layout=["default", "bhnd", "bnhd"], tangents=["none", "all", "tq"],
    causal=[False, True, "top_left", "bottom_right"], window=[None, (3, 1), (2, -1)],
    align=[None, "top_left", "bottom_right"], mask=["none", "kv_lens", "bool", "float"],
    lse=[False, True], shape=list(_SHAPES),
)


def _dense_keep(c):
    return not (c["fn"] == "attention" and c["lse"])  # attention returns o alone


# all pairs of values, and every alignment-relevant combination (causal x window x align x shape)
_DENSE = _unique(pairwise(_DENSE_AXES, _dense_keep, seed=37)
                 + full_product(_DENSE_AXES, ("causal", "window", "align", "shape"), _dense_keep))


def _dense_error(c) -> str | None:
    """The ValueError the call must raise (a regex), or None."""
    _, _, _, n_q, n_k, _ = _SHAPES[c["shape"]]
    named = c["causal"] if isinstance(c["causal"], str) else None
    if named and c["align"] and named != c["align"]:
        return r"^align: expected None or"
    if c["window"] is not None and n_q != n_k and named is None and c["align"] is None:
        return r"^align: a window with Nq != Nk"
    return None


def _dense_masks(c, b, h, n_q, n_k):
    kv_lens = torch.tensor([n_k - 5, n_k])[:b] if c["mask"] == "kv_lens" else None
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(b, 1, n_q, n_k) > 0.3
    elif c["mask"] == "float":
        mask = _randn(1, h, n_q, n_k)
    return kv_lens, mask


def _dense_truth(c, xs, ts, kv_lens, mask, dtype):
    """Outputs of the call ``c`` in ``dtype`` from the rule above; o, to in the call's layout."""
    b, h, _, n_q, n_k, _ = _SHAPES[c["shape"]]
    off = diagonal_offset("dense", c["causal"], c["align"], n_q, n_k)
    lens = [n_k] * b if kv_lens is None else kv_lens.tolist()
    vis = torch.stack([visible(n_q, n_k, c["causal"], off, c["window"], n) for n in lens])[:, None]
    bias = None
    if mask is not None and mask.dtype == torch.bool:
        vis = vis & mask
    elif mask is not None:
        bias = mask.to(dtype)
    bnhd = c["layout"] == "bnhd"
    swap = (lambda x: x.transpose(1, 2)) if bnhd else (lambda x: x)  # noqa: E731

    def fn(q, k, v):
        o, lse = softmax_attention(swap(q), swap(k), swap(v), vis, bias)
        return swap(o), lse

    return _expected(c, *with_tangents(fn, xs, ts, dtype))


def _dense_call(c, xs, ts, kv_lens, mask) -> dict:
    fn = getattr(flashjvp, c["fn"])
    kw = dict(causal=c["causal"], window=c["window"], align=c["align"], kv_lens=kv_lens, attn_mask=mask)
    if c["layout"] != "default":
        kw["layout"] = c["layout"]
    if "jvp" in c["fn"]:
        out = fn(*xs, *ts, return_lse=c["lse"], **kw)
        return dict(zip(("o", "to", "lse", "mu"), out))
    if c["fn"] == "attention_ref":
        kw["return_lse"] = c["lse"]
    if c["tangents"] == "none":
        out = fn(*xs, **kw)
        return dict(zip(("o", "lse"), out)) if c["lse"] else {"o": out}
    tans = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(xs, ts))
    out, tout = torch.func.jvp(lambda *a: fn(*a, **kw), tuple(xs), tans)
    if c["lse"]:
        return {"o": out[0], "lse": out[1], "to": tout[0], "mu": tout[1]}
    return {"o": out, "to": tout}


@pytest.mark.parametrize("c", _DENSE, ids=[case_id(c) for c in _DENSE])
def test_dense(c, seed):
    b, h, hkv, n_q, n_k, d = _SHAPES[c["shape"]]
    shape = (lambda n, hh: (b, n, hh, d)) if c["layout"] == "bnhd" else (lambda n, hh: (b, hh, n, d))
    xs = [_randn(*shape(n_q, h)), _randn(*shape(n_k, hkv)), _randn(*shape(n_k, hkv))]
    ts = [_randn(*x.shape) for x in xs]
    ts = {"none": [None] * 3, "all": ts, "tq": [ts[0], None, None]}[c["tangents"]]
    kv_lens, mask = _dense_masks(c, b, h, n_q, n_k)
    error = _dense_error(c)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            _dense_call(c, xs, ts, kv_lens, mask)
        return
    got = _dense_call(c, xs, ts, kv_lens, mask)
    compare(got, _dense_truth(c, xs, ts, kv_lens, mask, torch.float64),
            _dense_truth(c, xs, ts, kv_lens, mask, torch.float32))


# --------------------------------------------------------------------------- packed: attention_varlen*, refs

_VARLEN_FNS = ("attention_varlen", "attention_varlen_jvp", "attention_varlen_ref", "attention_varlen_jvp_ref")
# (query lengths, key lengths, Hq, Hkv, D): sequences of 0 queries or keys; Nq != Nk per sequence
_LENS = {"equal": ([6, 11], [6, 11], 2, 2, 8), "mixed-gqa": ([5, 0, 9, 1], [7, 3, 6, 0], 4, 2, 8)}
_VARLEN_AXES = dict(
    fn=list(_VARLEN_FNS), tangents=["none", "all", "tq"], causal=[False, True, "top_left", "bottom_right"],
    window=[None, (3, 1), (2, -1), (1, 0)], align=[None, "top_left", "bottom_right"], lse=[False, True],
    lens=list(_LENS),
)


def _varlen_keep(c):
    return not (c["fn"] == "attention_varlen" and c["lse"])


_VARLEN = _unique(pairwise(_VARLEN_AXES, _varlen_keep, seed=38)
                  + full_product(_VARLEN_AXES, ("causal", "window", "align", "lens"), _varlen_keep))
# issue #37, defect 3: a packed batch, window (16, 16), a sequence of 64 queries and 70 keys
_LENS["issue37-64q-70k"] = ([64, 3], [70, 2], 2, 1, 8)
_VARLEN += [dict(fn=fn, tangents="all", causal=False, window=(16, 16), align=None, lse="jvp" in fn,
                 lens="issue37-64q-70k") for fn in _VARLEN_FNS]


def _varlen_truth(c, xs, ts, dtype):
    lens_q, lens_k, *_ = _LENS[c["lens"]]
    cq, ck = cu_seqlens(lens_q).tolist(), cu_seqlens(lens_k).tolist()

    def fn(q, k, v):
        outs, lses = [], []
        for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
            qs, ks, vs = (x[lo:hi].transpose(0, 1)[None] for x, lo, hi in
                          ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
            off = diagonal_offset("varlen", c["causal"], c["align"], n_q, n_k)
            o, lse = softmax_attention(qs, ks, vs, visible(n_q, n_k, c["causal"], off, c["window"]))
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    return _expected(c, *with_tangents(fn, xs, ts, dtype))


def _varlen_call(c, xs, ts, packed) -> dict:
    fn = getattr(flashjvp, c["fn"])
    kw = dict(causal=c["causal"], window=c["window"], align=c["align"])
    if "jvp" in c["fn"]:
        return dict(zip(("o", "to", "lse", "mu"), fn(*xs, *packed, *ts, return_lse=c["lse"], **kw)))
    if c["fn"] == "attention_varlen_ref":
        kw["return_lse"] = c["lse"]
    if c["tangents"] == "none":
        out = fn(*xs, *packed, **kw)
        return dict(zip(("o", "lse"), out)) if c["lse"] else {"o": out}
    tans = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(xs, ts))
    out, tout = torch.func.jvp(lambda *a: fn(*a, *packed, **kw), tuple(xs), tans)
    if c["lse"]:
        return {"o": out[0], "lse": out[1], "to": tout[0], "mu": tout[1]}
    return {"o": out, "to": tout}


@pytest.mark.parametrize("c", _VARLEN, ids=[case_id(c) for c in _VARLEN])
def test_varlen(c, seed):
    lens_q, lens_k, h, hkv, d = _LENS[c["lens"]]
    xs = [_randn(sum(lens_q), h, d), _randn(sum(lens_k), hkv, d), _randn(sum(lens_k), hkv, d)]
    ts = [_randn(*x.shape) for x in xs]
    ts = {"none": [None] * 3, "all": ts, "tq": [ts[0], None, None]}[c["tangents"]]
    packed = (cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k))
    named = c["causal"] if isinstance(c["causal"], str) else None
    if named and c["align"] and named != c["align"]:
        with pytest.raises(ValueError, match=r"^align: expected None or"):
            _varlen_call(c, xs, ts, packed)
        return
    got = _varlen_call(c, xs, ts, packed)
    compare(got, _varlen_truth(c, xs, ts, torch.float64), _varlen_truth(c, xs, ts, torch.float32))


# --------------------------------------------------------------------------- sdpa (PyTorch's semantics)

_SDPA_AXES = dict(rank=[3, 4], tangents=["none", "all"], is_causal=[False, True], mask=["none", "bool", "float"],
                  gqa=[False, True], shape=["self", "cross"])


def _sdpa_keep(c):
    return not (c["is_causal"] and c["mask"] != "none")  # SDPA itself refuses a mask with is_causal


_SDPA = _unique(pairwise(_SDPA_AXES, _sdpa_keep, seed=39)
                + full_product(_SDPA_AXES, ("is_causal", "mask", "shape", "gqa"), _sdpa_keep))


@pytest.mark.parametrize("c", _SDPA, ids=[case_id(c) for c in _SDPA])
def test_sdpa(c, seed):
    """flashjvp.sdpa mirrors PyTorch's SDPA: is_causal is top-left also with L != S."""
    n_q, n_k = (10, 10) if c["shape"] == "self" else (7, 12)
    hq, hkv = (4, 2) if c["gqa"] else (2, 2)
    lead = (2,) if c["rank"] == 4 else ()
    xs = [_randn(*lead, hq, n_q, 8), _randn(*lead, hkv, n_k, 8), _randn(*lead, hkv, n_k, 8)]
    ts = [_randn(*x.shape) for x in xs]
    mask = None
    if c["mask"] == "bool":
        mask = torch.rand(n_q, n_k) > 0.3
    elif c["mask"] == "float":
        mask = _randn(hq, n_q, n_k)
    kw = dict(attn_mask=mask, is_causal=c["is_causal"], enable_gqa=c["gqa"])
    if c["tangents"] == "none":
        got = {"o": flashjvp.sdpa(*xs, **kw)}
    else:
        o, to = torch.func.jvp(lambda *a: flashjvp.sdpa(*a, **kw), tuple(xs), tuple(ts))
        got = {"o": o, "to": to}

    def truth(dtype):
        vis = visible(n_q, n_k, c["is_causal"], 0, None)
        bias = None
        if mask is not None and mask.dtype == torch.bool:
            vis = vis & mask
        elif mask is not None:
            bias = mask.to(dtype)
        as4 = (lambda x: x) if c["rank"] == 4 else (lambda x: x[None])  # noqa: E731
        fn = lambda q, k, v: softmax_attention(as4(q), as4(k), as4(v), vis, bias)[0].reshape(  # noqa: E731
            *q.shape[:-1], v.shape[-1])
        o, to = with_tangents(lambda *a: (fn(*a),), xs, ts, dtype)
        return {"o": o[0], "to": to[0]} if c["tangents"] != "none" else {"o": o[0]}

    compare(got, truth(torch.float64), truth(torch.float32))


# --------------------------------------------------------------------------- one layout convention

_LAYOUT_FNS = {
    "flashjvp": [getattr(flashjvp, n) for n in flashjvp.__all__ if callable(getattr(flashjvp, n))],
    "flashjvp.distributed": [getattr(fd, n) for n in fd.__all__],
}


def test_every_layout_default_is_bhnd():
    """Every public function that takes a layout (or a sequence dim by layout) defaults to "bhnd"
    (issue #37, defect 2: the distributed functions defaulted to "bnhd")."""
    taking = {}
    for module, fns in _LAYOUT_FNS.items():
        for fn in fns:
            p = inspect.signature(fn).parameters.get("layout")
            if p is not None:
                taking[f"{module}.{fn.__name__}"] = p.default
    assert len(taking) >= 10, sorted(taking)
    assert {k: v for k, v in taking.items() if v != "bhnd"} == {}


def test_dense_and_packed_return_shapes():
    """The shapes the table in docs/semantics.md gives: dense o (B, Hq, Nq, Dv) in its layout, lse
    (B, Hq, Nq); packed o (total_q, Hq, Dv), lse (Hq, total_q) as flash-attn returns it."""
    q, k, v = _randn(2, 3, 5, 8), _randn(2, 3, 7, 8), _randn(2, 3, 7, 4)
    o, to, lse, mu = flashjvp.attention_jvp(q, k, v, q, None, None, return_lse=True)
    assert o.shape == to.shape == (2, 3, 5, 4) and lse.shape == mu.shape == (2, 3, 5)
    o, to, lse, mu = flashjvp.attention_jvp(*(x.transpose(1, 2) for x in (q, k, v)), layout="bnhd", return_lse=True)
    assert o.shape == to.shape == (2, 5, 3, 4) and lse.shape == mu.shape == (2, 3, 5)
    pq, pk, pv = _randn(9, 3, 8), _randn(11, 3, 8), _randn(11, 3, 4)
    packed = (cu_seqlens([4, 5]), cu_seqlens([6, 5]), 5, 6)
    o, to, lse, mu = flashjvp.attention_varlen_jvp(pq, pk, pv, *packed, return_lse=True)
    assert o.shape == to.shape == (9, 3, 4) and lse.shape == mu.shape == (3, 9)


# --------------------------------------------------------------------------- distributed, 2 and 4 gloo ranks

_DIST_FNS = ("ulysses_attention", "ulysses_attention_jvp", "ring_attention", "ring_attention_jvp")
_DIST_AXES = dict(fn=list(_DIST_FNS), layout=["default", "bhnd", "bnhd"], tangents=["none", "all", "tq"],
                  causal=[False, True], lse=[False, True])
# B, Hq, Hkv, N, D: N divisible by 2 x 4 ranks (zig-zag chunks), heads by 4 (Ulysses)
_DIST_SHAPE = (1, 4, 4, 16, 8)


def _dist_keep(c):
    return c["lse"] is False or c["fn"].endswith("_jvp")


_DIST = pairwise(_DIST_AXES, _dist_keep, seed=40) + full_product(_DIST_AXES, ("fn", "layout", "causal"), _dist_keep)
# issue #37, defect 1: ulysses_attention_jvp with layout="bhnd"; defect 2: every function's default
_DIST_ISSUE37 = [dict(fn="ulysses_attention_jvp", layout="bhnd", tangents="all", causal=False, lse=False)]
_DIST_ISSUE37 += [dict(fn=fn, layout="default", tangents="all", causal=True, lse=fn.endswith("_jvp"))
                  for fn in _DIST_FNS]
_DIST = _unique(_DIST + _DIST_ISSUE37)


def _dist_case(c, rank, world):
    b, h, hkv, n, d = _DIST_SHAPE
    g = torch.Generator().manual_seed(sum(map(ord, case_id(c))))  # the same whole tensors on every rank
    bnhd = c["layout"] == "bnhd"
    shape = (lambda hh: (b, n, hh, d)) if bnhd else (lambda hh: (b, hh, n, d))
    full = [torch.randn(shape(hh), generator=g) for hh in (h, hkv, hkv)]
    tans = [torch.randn(x.shape, generator=g) for x in full]
    tans = {"none": [None] * 3, "all": tans, "tq": [tans[0], None, None]}[c["tangents"]]
    kw = dict(causal=c["causal"])
    lay = {} if c["layout"] == "default" else {"layout": c["layout"]}
    seq = 1 if bnhd else 2
    if c["fn"].startswith("ring") and c["causal"]:
        shard = lambda x: None if x is None else fd.zigzag_shard(x, rank, world, **lay)  # noqa: E731
    else:
        shard = lambda x: None if x is None else x.narrow(seq, rank * (n // world), n // world)  # noqa: E731
    shard_lse = lambda x: shard(x.transpose(1, 2)).transpose(1, 2) if bnhd else shard(x)  # noqa: E731
    fn = getattr(fd, c["fn"])
    xs, ts = [shard(x) for x in full], [shard(t) for t in tans]
    if c["fn"].endswith("_jvp"):
        got = dict(zip(("o", "to", "lse", "mu"), fn(*xs, *ts, return_lse=c["lse"], **kw, **lay)))
    elif c["tangents"] == "none":
        got = {"o": fn(*xs, **kw, **lay)}
    else:
        zs = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(xs, ts))
        o, to = torch.func.jvp(lambda *a: fn(*a, **kw, **lay), tuple(xs), zs)
        got = {"o": o, "to": to}

    def whole(q, k, v):  # the whole sequence, top-left causal over global positions
        swap = (lambda x: x.transpose(1, 2)) if bnhd else (lambda x: x)  # noqa: E731
        o, lse = softmax_attention(swap(q), swap(k), swap(v), visible(n, n, c["causal"], 0, None))
        return swap(o), lse

    def truth(dtype):
        (o, lse), (to, mu) = with_tangents(whole, full, tans, dtype)
        out = {"o": shard(o)}
        if "to" in got:
            out["to"] = shard(to)
        if c["lse"]:
            out |= {"lse": shard_lse(lse.float()), "mu": shard_lse(mu.float())}
        return out

    compare(got, truth(torch.float64), truth(torch.float32), label=f"rank {rank}: ")


def _dist_worker(rank, world, rendezvous, out_dir, cases):
    """Every case of ``cases`` on this rank; writes {case id: None or the failure} to out_dir."""
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    results = {}
    try:
        for c in cases:
            try:
                _dist_case(c, rank, world)
                results[case_id(c)] = None
            except Exception as e:  # noqa: BLE001 - recorded per case, reported by the test
                results[case_id(c)] = f"{type(e).__name__}: {str(e)[:400]}"
            dist.barrier()  # a failing rank never leaves the others inside a collective of the next case
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


_DIST_TIMEOUT_S = 240


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"{w}-gloo-ranks")
def test_distributed(world, matrix_sample):
    """ulysses_attention(_jvp), ring_attention(_jvp) x layout x tangents x causal x return_lse
    against the whole-sequence float64 result, every rank's shard; the failures name their cases.
    A sampled run takes a sample of the cases (conftest.py: INNER_MATRICES), the issue's always."""
    cases = matrix_sample(_DIST, always=_DIST_ISSUE37)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_dist_worker, args=(world, os.path.join(tmp, "rendezvous"), tmp, cases), nprocs=world,
                       join=False)
        deadline = time.monotonic() + _DIST_TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.terminate()
                pytest.fail(f"the distributed matrix on {world} ranks ran past {_DIST_TIMEOUT_S} s")
        per_rank = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    failures = [f"{cid}: {res}" for cid in (case_id(c) for c in cases)
                for res in [next((r[cid] for r in per_rank if r.get(cid)), None)] if res]
    assert len(per_rank[0]) == len({case_id(c) for c in cases})
    assert not failures, f"{len(failures)} of {len(cases)} distributed cases failed:\n" + "\n".join(failures)


# --------------------------------------------------------------------------- refusals found by the audit

@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (for checks that raise before any exchange)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


_X = _randn(1, 2, 8, 8)  # bhnd
_REFUSALS = [
    pytest.param(lambda: fd.ring_attention(_X, _X[:, :, :6], _X[:, :, :6], causal=True), ValueError,
                 r"^causal: causal ring attention needs Nq == Nk", id="ring-causal-cross"),
    pytest.param(lambda: fd.ring_attention(_X, _X, _X, causal="yes"), ValueError, r"^causal: expected",
                 id="ring-causal-string"),
    pytest.param(lambda: fd.ring_attention_jvp(_X, _X, _X, scale=True), TypeError, r"^scale: expected",
                 id="ring-scale-bool"),
    pytest.param(lambda: fd.ring_attention(_X, _X, _X, scale=0.0), ValueError, r"^scale: expected",
                 id="ring-scale-zero"),
    pytest.param(lambda: fd.ring_attention_jvp(_X.clone().requires_grad_(), _X, _X), ValueError,
                 r"^q: ring_attention_jvp's outputs are not differentiable", id="ring-jvp-requires-grad"),
    pytest.param(lambda: fd.ulysses_attention("q", _X, _X), TypeError, r"^q: expected a torch.Tensor",
                 id="ulysses-q-not-a-tensor"),
    pytest.param(lambda: fd.ulysses_attention_jvp(_X, _X, _X, tq=1.0), TypeError, r"^tq: expected a torch.Tensor",
                 id="ulysses-tq-not-a-tensor"),
    pytest.param(lambda: fd.ulysses_attention(_X, _X, _X, layout="nhd"), ValueError, r"^layout: expected",
                 id="ulysses-layout"),
]


@pytest.mark.parametrize(("call", "exc", "msg"), _REFUSALS)
def test_distributed_refusals(one_rank_group, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize(("call", "exc", "msg"), [
    pytest.param(lambda: fd.zigzag_shard(torch.zeros(1, 2, 10, 4), 0, 2), ValueError,
                 r"^x: expected a length divisible by 2 \* world = 4 along dim 2", id="zigzag-uneven"),
    pytest.param(lambda: fd.zigzag_shard(torch.zeros(1, 2, 8, 4), 0, 2, dim=1.0), TypeError, r"^dim: expected",
                 id="zigzag-dim-float"),
    pytest.param(lambda: flashjvp.attention(_X, _X, _X, align="bottom"), ValueError, r"^align: expected None, ",
                 id="align-unknown"),
    pytest.param(lambda: flashjvp.attention_varlen(_X[0], _X[0], _X[0], cu_seqlens([2]), cu_seqlens([2]), 2, 2,
                                                   causal="top_left", align="bottom_right"),
                 ValueError, r"^align: expected None or 'top_left'", id="varlen-align-conflict"),
])
def test_refusals(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_zigzag_shard_follows_the_layout():
    """zigzag_shard cuts the sequence dim of its layout: dim 2 for the default "bhnd", 1 for "bnhd"."""
    x = torch.arange(2 * 3 * 8).reshape(1, 2, 8, 3)
    assert torch.equal(fd.zigzag_shard(x, 0, 2), torch.cat((x[:, :, 0:2], x[:, :, 6:8]), dim=2))
    assert torch.equal(fd.zigzag_shard(x.transpose(1, 2), 0, 2, layout="bnhd"),
                       fd.zigzag_shard(x, 0, 2).transpose(1, 2))
    shards = [fd.zigzag_shard(x, r, 2) for r in range(2)]
    assert torch.equal(fd.zigzag_unshard(shards), x)
