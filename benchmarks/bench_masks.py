"""Benchmark of masked attention: ``PYTHONPATH=src python -m benchmarks.bench_masks`` from the
repository root.

Four cases, each a group of timings taken in the same run (bf16 on CUDA), run
in the order 1, 3, 2, 4 so that a ``--time-limit`` cuts the least important last:

1. ``varlen``: a packed batch of 8 sequences of mixed lengths (``attention_varlen*``) against the
   same batch padded to the longest (``attention*``, without padding information and with
   ``kv_lens``), causal and not.
2. ``xattn-pad``: key padding in cross-attention, 32760 queries x 512 text keys of which 256 are
   valid (``kv_lens``), against all 512 keys and against a dense call on the 256 valid keys.
3. ``window``: sliding windows over N = 32768 against full attention (and causal).
4. ``sdpa-mask``: ``flashjvp.sdpa`` with a (B, 1, 1, Nk) bool key-padding mask against PyTorch's
   SDPA (efficient and cuDNN backends; the math backend under ``torch.func.jvp``).

Modes: ``fwd`` (forward), ``fwd_jvp`` (forward + JVP; tangents as listed), ``fwd_bwd`` (forward with
grad, then ``backward``). Every number is the median of ``triton.testing.do_bench`` (the first call,
compilation and autotuning, is not timed) and the peak memory allocated beyond the inputs
(:func:`benchmarks.harness.measure`). ``ratio`` is the time over that of the case's baseline in the same
group and mode; ``ideal`` the ratio of the (query, key) pairs each call has to compute (what the
work would fall to if time were proportional to it). TFLOP/s count those pairs (a padded batch
counts its padding): ``fwd`` 4 * H * pairs * D, ``fwd_jvp`` 3x (2x with a q tangent only),
``fwd_bwd`` 3.5x. A failing measurement becomes a skipped row with its reason. Writes
``masks.json`` and ``masks.md`` to ``--out``. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.harness import (
    Item,
    Measured,
    Report,
    add_run_options,
    fmt,
    math_memory_check,
    md_table,
    measure_cpu,
    results_dir,
    run_items,
    run_metadata,
)

CASE_ORDER = ("varlen", "window", "xattn-pad", "sdpa-mask")  # run order: cases 1, 3, 2, 4
CASE_NUMBERS = {"1": "varlen", "2": "xattn-pad", "3": "window", "4": "sdpa-mask"}  # the cases' numbers
MODES = ("fwd_jvp", "fwd", "fwd_bwd")
ALL_TANGENTS, Q_TANGENT = "q,k,v", "q"
# Full-size workloads; --tiny (a CPU smoke test) scales them down.
VARLEN_LENGTHS = (8192, 512, 4096, 1024, 6000, 700, 2048, 3000)


@dataclass(frozen=True)
class Sizes:
    varlen_lengths: tuple[int, ...] = VARLEN_LENGTHS
    varlen_h: int = 16
    varlen_d: int = 128
    window_n: int = 32768
    window_h: int = 12
    window_d: int = 128
    window: int = 1024
    xattn_nq: int = 32760
    xattn_nk: int = 512
    xattn_valid: int = 256
    xattn_h: int = 40
    xattn_d: int = 128
    sdpa_shapes: tuple[tuple[int, int, int, int], ...] = ((4, 32, 4096, 64), (2, 24, 4096, 128))  # B, H, N, D


FULL = Sizes()
TINY = Sizes(varlen_lengths=(40, 5, 23), varlen_h=2, varlen_d=16, window_n=64, window_h=1, window_d=16,
             window=8, xattn_nq=30, xattn_nk=32, xattn_valid=16, xattn_h=2, xattn_d=16,
             sdpa_shapes=((2, 2, 32, 16), (2, 1, 16, 32)))


# --------------------------------------------------------------------------- pure helpers


def visible_pairs(nq: int, nk: int, *, causal: bool = False, window: tuple[int, int] | None = None,
                  kv_len: int | None = None, bottom_right: bool = False) -> int:
    """The (query, key) pairs one head of one sequence sees (flashjvp's rule, ``flashjvp.ref``):
    query i sees key j iff ``j < kv_len``, ``j <= i + off + right`` (right = 0 when causal) and
    ``j >= i + off - left`` (-1: unbounded), with ``off = nk - nq`` for bottom-right causal."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    off = nk - nq if (causal and bottom_right) else 0
    i = torch.arange(nq, dtype=torch.int64) + off
    hi = torch.full_like(i, (nk if kv_len is None else max(0, min(kv_len, nk))) - 1)
    lo = torch.zeros_like(i)
    if right >= 0:
        hi = torch.minimum(hi, i + right)
    if left >= 0:
        lo = torch.maximum(lo, i - left)
    return int((hi - lo + 1).clamp(min=0).sum())


def varlen_pairs(lengths, *, causal: bool = False, window=None) -> int:
    """Pairs of a packed batch (each sequence attends to itself: Nq = Nk = its length)."""
    return sum(visible_pairs(n, n, causal=causal, window=window) for n in lengths)


def padded_pairs(lengths, *, causal: bool = False, kv_lens: bool = False) -> int:
    """Pairs of the same batch padded to the longest, every query row computed; with ``kv_lens``
    the padded keys of each element are skipped (its padded queries still run)."""
    m = max(lengths)
    return sum(visible_pairs(m, m, causal=causal, kv_len=n if kv_lens else None) for n in lengths)


def ideal_ratio(lengths, *, causal: bool = False) -> float:
    """The packed batch's work over the padded batch's: sum(n_i^2) / (B * max^2) without causal."""
    return varlen_pairs(lengths, causal=causal) / padded_pairs(lengths, causal=causal)


def attention_flops(pairs: int, h: int, d_qk: int, d_v: int, mode: str, tangents: str = ALL_TANGENTS) -> float:
    """FLOPs of ``pairs`` (query, key) pairs over ``h`` heads (``benchmarks.bench`` conventions)."""
    fwd = 2.0 * h * pairs * (d_qk + d_v)
    if mode == "fwd":
        return fwd
    if mode == "fwd_jvp":
        return (3.0 if tangents == ALL_TANGENTS else 2.0) * fwd
    if mode == "fwd_bwd":
        return 3.5 * fwd
    raise ValueError(f"unknown mode {mode!r}")


@dataclass
class Row(Measured):
    """One measurement. ``ratio`` = ms / the ms of ``baseline`` in the same (case, group, dims,
    mode, tangents); ``ideal`` the ratio of pairs."""

    case: str
    group: str
    dims: str
    variant: str
    mode: str
    tangents: str
    baseline: str
    ideal: float | None = None
    ratio: float | None = None


def compute_ratios(rows: list[Row]) -> list[Row]:
    """Fill ``ratio`` of every measured row whose baseline was measured (in place; returns rows)."""
    base = {(r.case, r.group, r.dims, r.mode, r.tangents, r.variant): r.ms for r in rows if r.ms}
    for r in rows:
        b = base.get((r.case, r.group, r.dims, r.mode, r.tangents, r.baseline))
        r.ratio = r.ms / b if (r.ms and b) else None
    return rows


def format_report(rows: list[Row], meta: dict) -> str:
    """Markdown: a header with the run's metadata, then one table per case (in run order)."""
    parts = [f"# flashjvp masks benchmark: {meta.get('gpu', '?')}",
             f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, {meta.get('dtype', '?')}, "
             f"FLASHJVP_AUTOTUNE={meta.get('autotune', '?')}, {meta.get('date', '?')}"
             + (f", {meta['wall_s']:.0f} s" if meta.get("wall_s") is not None else "")
             + f"  \n`{meta.get('command', '')}`",
             "ratio = ms / ms of the case's baseline (same group, mode and tangents; < 1: faster); "
             "ideal = (query, key) pairs computed / those of the baseline. TFLOP/s count the pairs each "
             "call computes (padding included where it is computed). first call s: the untimed first "
             "call (compilation and autotuning when new)."]
    if meta.get("partial"):
        parts.append("**Partial report** (written while the run was going on).")
    cases = meta.get("cases", {})
    for case in dict.fromkeys([*cases, *(r.case for r in rows)]):
        sel = [r for r in rows if r.case == case]
        if not sel:
            continue
        info = cases.get(case, {})
        parts.append(f"## {info.get('title', case)}")
        if info.get("note"):
            parts.append(info["note"])
        body = [[r.group, r.dims, r.variant + (" (baseline)" if r.variant == r.baseline else ""), r.mode,
                 r.tangents, fmt(r.ms, ".3f"), fmt(r.tflops, ".1f"), fmt(r.peak_mib, ".0f"),
                 fmt(r.ratio, ".3f"), fmt(r.ideal, ".3f"), fmt(r.first_call_s, ".1f"), (r.skip or "")[:300]]
                for r in sel]
        header = ["group", "dims", "variant", "mode", "tangents", "ms", "TFLOP/s", "peak extra MiB",
                  "ratio", "ideal", "first call s", "skipped"]
        parts.append(md_table(header, body))
    return "\n\n".join(parts) + "\n"


REPORT = Report("masks", format_report)


def write_report(rows: list[Row], meta: dict, out_dir: Path) -> dict[str, Path]:
    """``masks.json`` (meta + rows) and ``masks.md`` in ``out_dir``; returns their paths."""
    return REPORT.write(compute_ratios(rows), meta, out_dir)


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    items: list[Item] = field(default_factory=list)
    inputs: dict[str, Callable[[], dict]] = field(default_factory=dict)
    cases: dict[str, dict] = field(default_factory=dict)  # case -> {"title", "note"}


def _build(mode: str, tangents: str, x: dict, fwd: Callable, jvp: Callable | None,
           names=("q", "k", "v", "tq", "tk", "tv", "do")) -> tuple[Callable, list]:
    """The timed callable of ``mode``: ``fwd(q, k, v) -> o``, ``jvp(q, k, v, tq, tk, tv) -> (o, to)``
    on the tensors ``x[name]``; ``fwd_bwd`` differentiates fresh leaves of q, k, v."""
    q, k, v, tq, tk, tv, do = (x[n] for n in names)
    if mode == "fwd":
        return (lambda: fwd(q, k, v)), []
    if mode == "fwd_jvp":
        if tangents != ALL_TANGENTS:
            tk = tv = None
        return (lambda: jvp(q, k, v, tq, tk, tv)), []
    if mode == "fwd_bwd":
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return (lambda: fwd(*leaves).backward(do)), leaves
    raise ValueError(f"unknown mode {mode!r}")


def _randn(device, dtype, *shape) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def _qkv(device, dtype, shape_q, shape_k) -> dict:
    """Standard-normal q, k, v, their tangents and the output gradient ``do``."""
    x = {n: _randn(device, dtype, *shape_q) for n in ("q", "tq", "do")}
    return x | {n: _randn(device, dtype, *shape_k) for n in ("k", "v", "tk", "tv")}


def _varlen_case(plan: Plan, s: Sizes, device, dtype) -> None:
    lens, h, d = s.varlen_lengths, s.varlen_h, s.varlen_d
    b, m, total = len(lens), max(lens), sum(lens)
    key = "varlen"

    def inputs() -> dict:
        x = {n: _randn(device, dtype, b, m, h, d) for n in ("q", "k", "v", "tq", "tk", "tv", "do")}  # bnhd, padded
        for n in list(x):  # the packed batch: the same valid rows, one after another
            x["p" + n] = torch.cat([x[n][i, :n_i] for i, n_i in enumerate(lens)])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        x |= {"cu": cu, "kv_lens": torch.tensor(lens, dtype=torch.int32, device=device)}
        return x

    plan.inputs[key] = inputs
    ideal = {c: f"{ideal_ratio(lens, causal=c):.3f}" for c in (False, True)}
    plan.cases[key] = {
        "title": "1. varlen: packed mixed lengths vs the dense padded batch",
        "note": f"B={b} sequences of lengths {list(lens)} (total {total}, padded to {m}), H={h}, D={d}, "
                f"bnhd. `dense` = (B, {m}) padded batch without padding information, `dense+kv_lens` = "
                "the same with kv_lens (key padding only: padded queries still run), `varlen` = "
                "attention_varlen / attention_varlen_jvp on the packed batch (includes its per-call "
                "read-back of cu_seqlens to the host). ideal for varlen = sum(n_i^2) / (B * max^2) = "
                f"{ideal[False]} ({ideal[True]} causal).",
    }
    dims = f"B{b} H{h} max{m} total{total} D{d}"
    for mode in MODES:
        for causal in (False, True):
            base = padded_pairs(lens, causal=causal)
            variants = {"dense": base, "dense+kv_lens": padded_pairs(lens, causal=causal, kv_lens=True),
                        "varlen": varlen_pairs(lens, causal=causal)}
            for variant, pairs in variants.items():
                row = Row(key, f"causal={causal}", dims, variant, mode, ALL_TANGENTS, "dense", pairs / base)
                plan.items.append(Item(row, key, _varlen_make(variant, mode, causal, m),
                                       attention_flops(pairs, h, d, d, mode)))


def _varlen_make(variant: str, mode: str, causal: bool, max_len: int) -> Callable:
    import flashjvp

    def make(x: dict):
        if variant == "varlen":
            cu = x["cu"]
            fwd = lambda q, k, v: flashjvp.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal)
            jvp = lambda q, k, v, tq, tk, tv: flashjvp.attention_varlen_jvp(
                q, k, v, cu, cu, max_len, max_len, tq, tk, tv, causal=causal)
            return _build(mode, ALL_TANGENTS, x, fwd, jvp, ("pq", "pk", "pv", "ptq", "ptk", "ptv", "pdo"))
        kw = dict(causal=causal, layout="bnhd", kv_lens=x["kv_lens"] if variant == "dense+kv_lens" else None)
        fwd = lambda q, k, v: flashjvp.attention(q, k, v, **kw)
        jvp = lambda q, k, v, tq, tk, tv: flashjvp.attention_jvp(q, k, v, tq, tk, tv, **kw)
        return _build(mode, ALL_TANGENTS, x, fwd, jvp)
    return make


def _window_case(plan: Plan, s: Sizes, device, dtype) -> None:
    import flashjvp

    n, h, d, w = s.window_n, s.window_h, s.window_d, s.window
    key = "window"
    plan.inputs[key] = lambda: _qkv(device, dtype, (1, h, n, d), (1, h, n, d))
    variants = {  # name: (causal, window)
        "full": (False, None),
        "causal": (True, None),
        f"window=({w},{w})": (False, (w, w)),
        f"window=({w},0)": (False, (w, 0)),
        f"causal+window=({w},-1)": (True, (w, -1)),
    }
    full = visible_pairs(n, n)
    frac = {name: visible_pairs(n, n, causal=c, window=win) / full for name, (c, win) in variants.items()}
    plan.cases[key] = {
        "title": f"3. window: sliding window {w} over N={n}",
        "note": f"B=1, H={h}, N={n}, D={d}, bhnd, every ratio against full (non-causal) attention; "
                "ideal = the visible-key fraction: "
                + ", ".join(f"{k} {v:.4f}" for k, v in frac.items()) + ".",
    }
    dims = f"B1 H{h} N{n} D{d}"
    for mode in MODES:
        for name, (causal, window) in variants.items():
            kw = dict(causal=causal, window=window)
            fwd = lambda q, k, v, kw=kw: flashjvp.attention(q, k, v, **kw)
            jvp = lambda q, k, v, tq, tk, tv, kw=kw: flashjvp.attention_jvp(q, k, v, tq, tk, tv, **kw)
            pairs = visible_pairs(n, n, causal=causal, window=window)
            row = Row(key, f"N{n}", dims, name, mode, ALL_TANGENTS, "full", pairs / full)
            make = lambda x, mode=mode, fwd=fwd, jvp=jvp: _build(mode, ALL_TANGENTS, x, fwd, jvp)
            plan.items.append(Item(row, key, make, attention_flops(pairs, h, d, d, mode)))


def _xattn_case(plan: Plan, s: Sizes, device, dtype) -> None:
    import flashjvp

    nq, nk, nv, h, d = s.xattn_nq, s.xattn_nk, s.xattn_valid, s.xattn_h, s.xattn_d
    key = "xattn-pad"

    def inputs() -> dict:
        x = _qkv(device, dtype, (1, nq, h, d), (1, nk, h, d))
        for n in ("k", "v", "tk", "tv"):  # the valid keys alone, contiguous
            x[n + "_valid"] = x[n][:, :nv].contiguous()
        x["kv_lens"] = torch.tensor([nv], dtype=torch.int32, device=device)
        return x

    plan.inputs[key] = inputs
    plan.cases[key] = {
        "title": f"2. xattn-pad: key padding in cross-attention, {nq} queries x {nk} keys, {nv} valid",
        "note": f"q (1, {nq}, {h}, {d}) bnhd, k/v (1, {nk}, {h}, {d}); `all {nk} keys` = kv_lens=None, "
                f"`kv_lens={nv}` = the second half of the keys is padding, `dense {nv} keys` = a call on the "
                f"{nv} valid keys alone (what key padding should cost at best). ideal = {nv / nk:.3f}.",
    }
    dims = f"B1 H{h} Nq{nq} Nk{nk} D{d}"
    base_name = f"all {nk} keys"
    variants = {base_name: (nk, None), f"kv_lens={nv}": (nv, "kv_lens"), f"dense {nv} keys": (nv, "valid")}
    for mode, tangents in (("fwd_jvp", Q_TANGENT), ("fwd_jvp", ALL_TANGENTS), ("fwd_bwd", ALL_TANGENTS)):
        for name, (keys, kind) in variants.items():
            names = ("q", "k", "v", "tq", "tk", "tv", "do")
            if kind == "valid":
                names = ("q", "k_valid", "v_valid", "tq", "tk_valid", "tv_valid", "do")

            def make(x, mode=mode, tangents=tangents, kind=kind, names=names):
                kw = dict(layout="bnhd", kv_lens=x["kv_lens"] if kind == "kv_lens" else None)
                fwd = lambda q, k, v: flashjvp.attention(q, k, v, **kw)
                jvp = lambda q, k, v, tq, tk, tv: flashjvp.attention_jvp(q, k, v, tq, tk, tv, **kw)
                return _build(mode, tangents, x, fwd, jvp, names)

            row = Row(key, "", dims, name, mode, tangents, base_name, keys / nk)
            plan.items.append(Item(row, key, make, attention_flops(nq * keys, h, d, d, mode, tangents)))


def _sdpa_providers(mask_of: Callable[[dict], torch.Tensor]) -> dict[str, dict]:
    """name -> {mode: make(x)} for flashjvp.sdpa and PyTorch's SDPA backends, masked."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashjvp

    def torch_sdpa(backend):
        def fwd(x):
            mask = mask_of(x)

            def f(q, k, v):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return f
        return fwd

    def ours(x):
        mask = mask_of(x)
        return lambda q, k, v: flashjvp.sdpa(q, k, v, attn_mask=mask)

    def under_jvp(fwd_of):
        def jvp(x):
            f = fwd_of(x)
            return lambda q, k, v, tq, tk, tv: torch.func.jvp(f, (q, k, v), (tq, tk, tv))
        return jvp

    plain = lambda fwd_of: {m: (lambda x, m=m: _build(m, ALL_TANGENTS, x, fwd_of(x), None))
                            for m in ("fwd", "fwd_bwd")}
    jvp_only = lambda fwd_of: {"fwd_jvp": lambda x: _build("fwd_jvp", ALL_TANGENTS, x, None, under_jvp(fwd_of)(x))}
    return {
        "flashjvp.sdpa": plain(ours) | jvp_only(ours),
        "torch-efficient": plain(torch_sdpa(SDPBackend.EFFICIENT_ATTENTION)),
        "torch-cudnn": plain(torch_sdpa(SDPBackend.CUDNN_ATTENTION)),
        "torch-math": jvp_only(torch_sdpa(SDPBackend.MATH)),
    }


def key_padding_mask(b: int, n: int, device) -> torch.Tensor:
    """(B, 1, 1, N) bool, True = attend: the second half of the batch has its last N/2 keys masked."""
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=device)
    mask[b // 2:, ..., n // 2:] = False
    return mask


def _sdpa_case(plan: Plan, s: Sizes, device, dtype) -> None:
    key = "sdpa-mask"
    plan.cases[key] = {
        "title": "4. sdpa-mask: flashjvp.sdpa with a (B, 1, 1, Nk) bool key-padding mask vs PyTorch SDPA",
        "note": "bhnd; the second half of the batch has its last Nk/2 keys masked (mask True = attend). "
                "torch-efficient / torch-cudnn: torch.nn.functional.scaled_dot_product_attention under "
                "sdpa_kernel(EFFICIENT_ATTENTION / CUDNN_ATTENTION); fwd_jvp: torch.func.jvp of "
                "flashjvp.sdpa vs of PyTorch's math backend (skipped when its Nq x Nk buffers would not "
                "fit). ratio against flashjvp.sdpa (> 1: flashjvp faster); no ideal.",
    }
    providers = _sdpa_providers(lambda x: x["mask"])
    for b, h, n, d in s.sdpa_shapes:
        inputs = f"{key}:{b}x{h}x{n}x{d}"

        def make_inputs(b=b, h=h, n=n, d=d):
            return _qkv(device, dtype, (b, h, n, d), (b, h, n, d)) | {"mask": key_padding_mask(b, n, device)}

        plan.inputs[inputs] = make_inputs
        pairs = (b - b // 2) * n * n + (b // 2) * n * (n // 2)
        dims = f"B{b} H{h} N{n} D{d}"
        for mode in ("fwd", "fwd_bwd", "fwd_jvp"):
            for name, modes in providers.items():
                if mode not in modes:
                    continue
                check = (lambda b=b, h=h, n=n: math_memory_check(b, h, n, n, device)) if name == "torch-math" else None
                row = Row(key, "", dims, name, mode, ALL_TANGENTS if mode == "fwd_jvp" else "", "flashjvp.sdpa")
                plan.items.append(Item(row, inputs, modes[mode], attention_flops(pairs, h, d, d, mode), check))


CASE_BUILDERS = {"varlen": _varlen_case, "window": _window_case, "xattn-pad": _xattn_case, "sdpa-mask": _sdpa_case}


def make_plan(cases=CASE_ORDER, sizes: Sizes = FULL, device="cuda", dtype=torch.bfloat16) -> Plan:
    """Every measurement of ``cases`` (in that order), nothing allocated yet."""
    plan = Plan()
    for case in cases:
        CASE_BUILDERS[case](plan, sizes, device, dtype)
    return plan


# --------------------------------------------------------------------------- running


def run(plan: Plan, *, quick: bool = False, time_limit: float = 0.0, log: Callable = print,
        clock: Callable[[], float] = time.perf_counter, timer: Callable | None = None,
        checkpoint: Callable[[list[Row]], None] | None = None) -> list[Row]:
    """Every item of ``plan`` in order (:func:`benchmarks.harness.run_items`); past ``time_limit``
    seconds (0: none) of ``clock`` the remaining ones are recorded as skipped. Inputs are made when
    an item needs a new input set (the previous set is freed first); ``checkpoint(rows)`` runs
    before each new set."""
    label = lambda r: f"{r.case:<9} {(r.group or r.dims)[:20]:<20} {r.variant[:22]:<22} {r.mode:<7} {r.tangents:<5}"
    note = lambda r: ("" if r.ratio is None or r.variant == r.baseline else f"  ratio {r.ratio:.3f}"
                      + ("" if r.ideal is None else f" (ideal {r.ideal:.3f})"))
    rows = run_items(plan.items, plan.inputs, label=label, note=note, annotate=compute_ratios, quick=quick,
                     time_limit=time_limit, log=log, clock=clock, timer=timer, checkpoint=checkpoint)
    return compute_ratios(rows)


# --------------------------------------------------------------------------- command line


def select_cases(keys: list[str] | None) -> list[str]:
    """Case names or numbers (1 varlen, 2 xattn-pad, 3 window, 4 sdpa-mask) in the given order;
    all in CASE_ORDER (1, 3, 2, 4) when empty."""
    keys = [k for key in keys or [] for k in key.split(",") if k]
    if not keys:
        return list(CASE_ORDER)
    table = {c: c for c in CASE_ORDER} | CASE_NUMBERS
    unknown = [k for k in keys if k not in table]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; known: " + ", ".join(f"{i}={c}" for i, c in CASE_NUMBERS.items()))
    return list(dict.fromkeys(table[k] for k in keys))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_masks",
                                 description="Benchmark flashjvp's varlen, window, key-padding and masked "
                                             "SDPA paths; see benchmarks/README.md.",
                                 epilog="cases (run in the order 1, 3, 2, 4): "
                                        + ", ".join(f"{i}={c}" for i, c in CASE_NUMBERS.items()))
    ap.add_argument("--cases", nargs="+", help="case numbers or names (space/comma separated); default all")
    add_run_options(ap, time_limit=240.0)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # CPU smoke test, tiny shapes
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        cases = select_cases(args.cases)
    except ValueError as e:
        ap.error(str(e))

    from flashjvp._policy import interpreting

    if args.tiny:
        device, dtype, sizes, timer = "cpu", torch.float32, TINY, measure_cpu
        gpu = "cpu (--tiny: " + ("Triton interpreter" if interpreting() else "math reference path") + ")"
    elif not torch.cuda.is_available():
        print("benchmarks.bench_masks needs a CUDA GPU", file=sys.stderr)
        return 2
    else:
        device, dtype, sizes, timer = "cuda", torch.bfloat16, FULL, None
        gpu = torch.cuda.get_device_name()
    torch.manual_seed(0)
    plan = make_plan(cases, sizes, device, dtype)
    meta = {**run_metadata(gpu, "benchmarks.bench_masks", argv),
            "dtype": str(dtype).removeprefix("torch."), "quick": args.quick, "time_limit": args.time_limit,
            "autotune": os.environ.get("FLASHJVP_AUTOTUNE", "1"), "cases": plan.cases, "sizes": asdict(sizes)}
    measure = lambda **kw: run(plan, quick=args.quick, time_limit=args.time_limit, timer=timer, **kw)
    return REPORT.run(measure, meta, args.out or results_dir(gpu))


if __name__ == "__main__":
    sys.exit(main())
