"""Benchmark: flashjvp against PyTorch SDPA and other JVP attention kernels
(``PYTHONPATH=src python -m benchmarks.bench`` from the repository root).

Every measurement is the median of ``triton.testing.do_bench``, converted to TFLOP/s with the
counts of :func:`attention_flops`, plus the peak memory the call allocates beyond its inputs
(:func:`benchmarks.harness.measure`). A failing measurement (unsupported shape, CUDA OOM, missing
backward) becomes a skipped row with its reason; the run itself never stops on one. The report
part (:func:`format_report`, :func:`write_report`, :func:`plot`) is pure: it works on a list of
:class:`Row` on any machine. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.harness import (
    Item,
    Measured,
    Report,
    add_run_options,
    fmt,
    load_function,
    math_memory_check,
    md_table,
    results_dir,
    run_items,
    run_metadata,
    skip_reason,
)

MODES = ("fwd", "fwd_jvp", "bwd", "scm", "jvp_bwd")
RUN_ORDER = ("fwd_jvp", "scm", "jvp_bwd", "fwd", "bwd")  # so a --time-limit cuts the least central modes
BUILTIN_PROVIDERS = ("flashjvp", "torch-flash", "torch-cudnn", "torch-math-jvp", "jvp-flash-attention",
                     "flashjvp-triton", "flashjvp-cudnn")
# What runs without --providers: flashjvp under its default policy and the other libraries.
DEFAULT_PROVIDERS = ("flashjvp", "torch-flash", "torch-cudnn", "torch-math-jvp", "jvp-flash-attention")
# flashjvp with its plain forward and backward forced onto one path (FLASHJVP_CUDNN, _cudnn.py);
# the forward+JVP is the same fused Triton kernel in both.
FLASHJVP_PATHS = {"flashjvp-triton": {"FLASHJVP_CUDNN": "0"}, "flashjvp-cudnn": {"FLASHJVP_CUDNN": "1"}}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """A named workload; ``all_tangents=False`` means tk = tv = None (only q has a tangent)."""

    id: str
    name: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: bool = False
    all_tangents: bool = True

    @property
    def dims(self) -> str:
        h = f"H{self.hq}" if self.hq == self.hkv else f"Hq{self.hq}/Hkv{self.hkv}"
        n = f"N{self.nq}" if self.nq == self.nk else f"Nq{self.nq}/Nk{self.nk}"
        return f"B{self.b} {h} {n} D{self.d}" + (" causal" if self.causal else "")

    @property
    def tangents(self) -> str:
        return "q,k,v" if self.all_tangents else "q"

    @property
    def scale(self) -> float:
        return self.d**-0.5

    def flops(self, mode: str) -> float:
        return attention_flops(self.b, self.hq, self.nq, self.nk, self.d, self.d, self.causal, mode,
                               self.all_tangents)


SHAPES = (
    Shape("1", "sa4k-d64", 4, 32, 32, 4096, 4096, 64),
    Shape("2", "sa4k-d64-causal", 4, 32, 32, 4096, 4096, 64, causal=True),
    Shape("3", "dit-image-d128", 2, 24, 24, 4096, 4096, 128),
    Shape("4", "wan1.3b-480p", 1, 12, 12, 32768, 32768, 128),
    Shape("5", "dit-xl2-256px", 32, 16, 16, 256, 256, 72),
    Shape("6", "dit-xl2-512px", 8, 16, 16, 1024, 1024, 72),
    Shape("7", "video-xattn-tq", 1, 40, 40, 32760, 512, 128, all_tangents=False),
    Shape("7b", "video-xattn-tqkv", 1, 40, 40, 32760, 512, 128),
    Shape("8", "gqa8k-causal", 2, 32, 8, 8192, 8192, 128, causal=True),
)


def attention_flops(b, hq, nq, nk, dqk, dv, causal, mode, all_tangents=True) -> float:
    """FLOPs credited to one call: forward = 2*B*Hq*Nq*Nk*(Dqk+Dv) (two matmuls), times the visible
    fraction when causal (1/2 for Nq == Nk); fwd_jvp = 3x forward (2x when tk = tv = None);
    bwd = 2.5x forward; scm = fwd_jvp + fwd + bwd; jvp_bwd (forward+JVP, then the gradients of o
    and to with respect to q, k, v and the tangents) = fwd_jvp + 10x forward (7x when tk = tv =
    None: the products of the second-order backward). Same count for every provider of a workload."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    frac = 1.0
    if causal:  # top-left: query i sees keys 0..i
        m = min(nq, nk)
        frac = 0.5 if nq == nk else (m * (m + 1) / 2 + (nq - m) * nk) / (nq * nk)
    fwd = 2.0 * b * hq * nq * nk * (dqk + dv) * frac
    jvp = (3.0 if all_tangents else 2.0) * fwd
    jvp_bwd = jvp + (10.0 if all_tangents else 7.0) * fwd
    return {"fwd": fwd, "fwd_jvp": jvp, "bwd": 2.5 * fwd, "scm": jvp + fwd + 2.5 * fwd, "jvp_bwd": jvp_bwd}[mode]


@dataclass
class Row(Measured):
    """One measurement of a (shape, provider, mode)."""

    shape: str
    name: str
    dims: str
    tangents: str
    provider: str
    mode: str


@dataclass
class Inputs:
    """Random inputs of one shape (tk, tv None for q-only shapes)."""

    s: Shape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tq: torch.Tensor
    tk: torch.Tensor | None
    tv: torch.Tensor | None
    do: torch.Tensor


@dataclass
class Provider:
    """``fwd(x) -> o`` and ``jvp(x) -> (o, to)``; ``check(shape)`` returns a skip reason or None;
    ``zero_fill``: absent tangents are passed as zero tensors (allocated outside the timing);
    ``env``: environment variables set while this provider is built, measured and logged (its
    backward included; :attr:`benchmarks.harness.Item.env`)."""

    name: str
    modes: tuple[str, ...]
    fwd: Callable | None = None
    jvp: Callable | None = None
    check: Callable[[Shape], str | None] | None = None
    zero_fill: bool = False
    env: dict[str, str] | None = None


def _sdpa(backends) -> Callable:
    """PyTorch SDPA restricted to ``backends`` (GQA through ``enable_gqa``), as a provider ``fwd``."""
    from torch.nn.attention import sdpa_kernel

    def fwd(x: Inputs):
        gqa = {"enable_gqa": True} if x.s.hq != x.s.hkv else {}
        with sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(
                x.q, x.k, x.v, is_causal=x.s.causal, scale=x.s.scale, **gqa)
    return fwd


def _math_jvp(x: Inputs):
    """Math SDPA under ``torch.func.jvp``: what plain PyTorch offers for a forward-mode derivative."""
    from torch.nn.attention import SDPBackend

    f = _sdpa(SDPBackend.MATH)
    if x.tk is None and x.tv is None:  # differentiate w.r.t. q only: the zero tangents cost nothing
        return torch.func.jvp(lambda q: f(replace(x, q=q)), (x.q,), (x.tq,))
    return torch.func.jvp(lambda q, k, v: f(replace(x, q=q, k=k, v=v)), (x.q, x.k, x.v), (x.tq, x.tk, x.tv))


def _math_check(s: Shape) -> str | None:
    """Skip reason when the math JVP's score matrices would not fit comfortably (estimate)."""
    return math_memory_check(s.b, s.hq, s.nq, s.nk)


def builtin_provider(name: str) -> Provider:
    """A built-in provider; raises ImportError when its package is missing."""
    from torch.nn.attention import SDPBackend

    if name == "flashjvp" or name in FLASHJVP_PATHS:  # the paths: the modes a plain fwd/bwd is in
        import flashjvp

        return Provider(name, MODES if name == "flashjvp" else ("fwd", "bwd", "scm"),
                        fwd=lambda x: flashjvp.attention(x.q, x.k, x.v, causal=x.s.causal, scale=x.s.scale),
                        jvp=lambda x: flashjvp.attention_jvp(x.q, x.k, x.v, x.tq, x.tk, x.tv,
                                                             causal=x.s.causal, scale=x.s.scale),
                        env=FLASHJVP_PATHS.get(name))
    if name == "torch-flash":
        return Provider(name, ("fwd", "bwd"), fwd=_sdpa(SDPBackend.FLASH_ATTENTION))
    if name == "torch-cudnn":
        return Provider(name, ("fwd", "bwd"), fwd=_sdpa(SDPBackend.CUDNN_ATTENTION))
    if name == "torch-math-jvp":  # scm: math JVP, then fused SDPA forward + backward
        fused = _sdpa([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                       SDPBackend.EFFICIENT_ATTENTION])
        return Provider(name, ("fwd_jvp", "scm", "jvp_bwd"), fwd=fused, jvp=_math_jvp, check=_math_check)
    if name == "jvp-flash-attention":
        from jvp_flash_attention.jvp_attention import JVPAttn

        def jvp(x: Inputs):
            f = lambda q, k, v: JVPAttn.fwd_dual(q, k, v, causal=x.s.causal, sm_scale=x.s.scale)
            return torch.func.jvp(f, (x.q, x.k, x.v), (x.tq, x.tk, x.tv))

        return Provider(name, MODES, fwd=lambda x: JVPAttn.fwd(x.q, x.k, x.v, causal=x.s.causal,
                                                               sm_scale=x.s.scale),
                        jvp=jvp, zero_fill=True,
                        check=lambda s: None if s.nq == s.nk and s.hq == s.hkv else
                        "jvp-flash-attention: self-attention without GQA only (needs Nq == Nk, Hq == Hkv)")
    raise ValueError(f"unknown provider {name!r}")


def load_kernel(spec: str) -> tuple[Provider, str]:
    """``NAME=path/to/file.py:attr`` -> (provider, note). ``attr(q, k, v, tq, tk, tv, causal, scale)
    -> (o, to)`` in bhnd layout. A failing ``flash_attn`` import is replaced by a stub (its
    forward + JVP still runs; anything calling flash_attn, e.g. the backward, is skipped)."""
    name, fn, note = load_function(spec)
    call = lambda x: fn(x.q, x.k, x.v, x.tq, x.tk, x.tv, x.s.causal, x.s.scale)
    return Provider(name, ("fwd_jvp", "bwd", "scm"), fwd=lambda x: call(x)[0], jvp=call, zero_fill=True), note


def make_inputs(s: Shape, dtype: torch.dtype, device="cuda") -> Inputs:
    """Fresh standard-normal inputs, tangents and output gradient (never zeros)."""
    r = lambda h, n: torch.randn(s.b, h, n, s.d, device=device, dtype=dtype)
    tk, tv = (r(s.hkv, s.nk), r(s.hkv, s.nk)) if s.all_tangents else (None, None)
    return Inputs(s, r(s.hq, s.nq), r(s.hkv, s.nk), r(s.hkv, s.nk), r(s.hq, s.nq), tk, tv, r(s.hq, s.nq))


def build(p: Provider, mode: str, x: Inputs) -> tuple[Callable, list[torch.Tensor]]:
    """The callable to time for ``mode`` and the leaves whose ``.grad`` is reset between calls."""
    if p.zero_fill:
        x = replace(x, tk=torch.zeros_like(x.k) if x.tk is None else x.tk,
                    tv=torch.zeros_like(x.v) if x.tv is None else x.tv)
    if mode == "fwd":
        return (lambda: p.fwd(x)), []
    if mode == "fwd_jvp":
        return (lambda: p.jvp(x)), []
    g = replace(x, q=x.q.detach().requires_grad_(), k=x.k.detach().requires_grad_(),
                v=x.v.detach().requires_grad_())
    leaves = [g.q, g.k, g.v]
    if mode == "bwd":
        o = p.fwd(g)
        return (lambda: o.backward(x.do, retain_graph=True)), leaves
    if mode == "jvp_bwd":  # gradients through o and its tangent (second order), tangents as leaves
        g = replace(g, **{n: t.detach().requires_grad_() for n in ("tq", "tk", "tv")
                          if (t := getattr(x, n)) is not None})
        leaves += [t for t in (g.tq, g.tk, g.tv) if t is not None]

        def jvp_backward():
            o, to = p.jvp(g)[:2]
            torch.autograd.backward((o, to), (x.do, x.do))
        return jvp_backward, leaves

    def scm_step():  # sCM: JVP without grad for the target, then a training forward + backward
        with torch.no_grad():
            p.jvp(g)
        p.fwd(g).backward(x.do)
    return scm_step, leaves


def run(shapes, providers, modes, dtype, quick=False, time_limit=0.0, log=print,
        checkpoint=None) -> list[Row]:
    """Every (mode, shape, provider) the provider supports, modes in ``RUN_ORDER`` (the JVP first);
    past ``time_limit`` seconds (0: none) the remaining ones are recorded as skipped.
    ``checkpoint(rows)`` runs whenever the inputs change (one shape done)."""
    items = [Item(Row(s.id, s.name, s.dims, s.tangents, p.name, m), s.id, lambda x, p=p, m=m: build(p, m, x),
                  s.flops(m), (lambda p=p, s=s: p.check(s)) if p.check else None, p.env)
             for m in RUN_ORDER if m in modes for s in shapes for p in providers if m in p.modes]
    inputs = {s.id: (lambda s=s: make_inputs(s, dtype)) for s in shapes}
    return run_items(items, inputs, label=lambda r: f"{r.mode:<7} {r.shape:>2} {r.name:<17} {r.provider:<20}",
                     quick=quick, time_limit=time_limit, log=log, checkpoint=checkpoint)


def speedups(rows: list[Row], mode: str = "fwd_jvp", base: str = "flashjvp") -> dict[tuple[str, str], float]:
    """{(shape, provider): provider ms / base ms} for ``mode`` rows measured for both (>1: base faster)."""
    ms = {(r.shape, r.provider): r.ms for r in rows if r.mode == mode and r.ms}
    return {(sh, p): t / ms[(sh, base)] for (sh, p), t in ms.items() if p != base and (sh, base) in ms}


def path_speedups(rows: list[Row], slow: str = "flashjvp-triton",
                  fast: str = "flashjvp-cudnn") -> dict[tuple[str, str], float]:
    """{(shape, mode): slow ms / fast ms} where both providers measured (>1: ``fast`` is faster);
    by default flashjvp's Triton-only path against its cuDNN dispatch."""
    ms = {(r.shape, r.mode, r.provider): r.ms for r in rows if r.ms}
    return {(sh, m): t / ms[(sh, m, fast)] for (sh, m, p), t in ms.items() if p == slow and (sh, m, fast) in ms}


def skip_speedups(rows: list[Row]) -> list[tuple[str, str, str, float, float, float]]:
    """fwd_jvp with tk = tv = None against the same shape with all tangents, per provider:
    (provider, q-only shape, all-tangents shape, ms q-only, ms all, speedup)."""
    by = {(r.dims, r.tangents, r.provider): r for r in rows if r.mode == "fwd_jvp" and r.ms}
    out = []
    for (dims, tangents, p), r in by.items():
        twin = by.get((dims, "q,k,v", p))
        if tangents == "q" and twin is not None:
            out.append((p, r.shape, twin.shape, r.ms, twin.ms, twin.ms / r.ms))
    return out


def format_report(rows: list[Row], meta: dict) -> str:
    """Markdown: a table per mode, then flashjvp's speedups and the zero-tangent speedup."""
    versions = f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, {meta.get('dtype', '?')}"
    runs = meta.get("runs") or []
    if len(runs) > 1:  # a merged report: each run on its own line, a later measurement wins
        head = [f"{versions}; {len(runs)} runs, a later measurement replacing an earlier one:",
                "\n".join(f"{i}. {r.get('date', '?')}: `{r.get('command', '')}`" for i, r in enumerate(runs, 1))]
    else:
        head = [f"{versions}, {meta.get('date', '?')}  \n`{meta.get('command', '')}`"]
    parts = [f"# flashjvp benchmark: {meta.get('gpu', '?')}", *head]
    notes = [f"- {k}: not available ({v})" for k, v in meta.get("unavailable", {}).items()]
    notes += [f"- kernel {k}: {v}" for k, v in meta.get("kernels", {}).items()]
    parts += ["\n".join(notes)] if notes else []
    for mode in MODES:
        sel = [r for r in rows if r.mode == mode]
        if sel:
            body = [[f"{r.shape} {r.name}", r.dims, r.tangents if mode in ("fwd_jvp", "scm", "jvp_bwd") else "",
                     r.provider, fmt(r.ms, ".3f"), fmt(r.tflops, ".1f"), fmt(r.peak_mib, ".0f"),
                     (r.skip or "")[:160]] for r in sel]
            header = ["shape", "dims", "tangents", "provider", "ms", "TFLOP/s", "peak extra MiB", "skipped"]
            parts += [f"## {mode}", md_table(header, body)]
    for mode in ("fwd_jvp", "scm", "jvp_bwd"):
        sp = speedups(rows, mode)
        others = list(dict.fromkeys(p for _, p in sp))
        if others:
            shapes = list(dict.fromkeys(sh for sh, _ in sp))
            body = [[sh] + [fmt(sp.get((sh, p)), ".2f") + ("x" if (sh, p) in sp else "") for p in others]
                    for sh in shapes]
            parts += [f"## flashjvp speedup, {mode} (provider ms / flashjvp ms)",
                      md_table(["shape"] + others, body)]
    ps = path_speedups(rows)
    if ps:
        shapes = list(dict.fromkeys(sh for sh, _ in ps))
        modes = [m for m in MODES if any(m == mm for _, mm in ps)]
        body = [[sh] + [fmt(ps.get((sh, m)), ".2f") + ("x" if (sh, m) in ps else "") for m in modes]
                for sh in shapes]
        parts += ["## flashjvp's cuDNN dispatch (flashjvp-triton ms / flashjvp-cudnn ms; > 1: cuDNN faster)",
                  md_table(["shape"] + modes, body)]
    sk = skip_speedups(rows)
    if sk:
        body = [[p, f"{a} vs {b}", f"{ta:.3f}", f"{tb:.3f}", f"{x:.2f}x"] for p, a, b, ta, tb, x in sk]
        parts += ["## fwd_jvp with tK = tV = None vs all tangents",
                  md_table(["provider", "shapes", "ms tq only", "ms all", "speedup"], body)]
    return "\n\n".join(parts) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    """Bar chart of TFLOP/s per shape, grouped by provider, one panel per mode (skips: no bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    shapes = list(dict.fromkeys((r.shape, r.name) for r in rows))
    color = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r.provider for r in rows))}
    tf = {(r.shape, r.provider, r.mode): r.tflops for r in rows if r.tflops}
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8.0, 1.3 * len(shapes) + 2), 3.4 * len(modes)),
                             squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        providers = list(dict.fromkeys(r.provider for r in rows if r.mode == mode))
        width = 0.8 / len(providers)
        for i, p in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, [tf.get((sh, p, mode), 0.0) for sh, _ in shapes], width, label=p, color=color[p])
        ax.set_xticks(range(len(shapes)), [f"{sh}\n{name}" for sh, name in shapes], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode} (no bar: skipped)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=min(3, len(providers)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


REPORT = Report("bench", format_report, plot)


def write_report(rows: list[Row], meta: dict, out_dir: Path, with_plot: bool = True) -> dict[str, Path]:
    """Write ``bench.json`` (meta + rows), ``bench.md`` and, with matplotlib, ``bench.png``;
    returns their paths (no "png" when the plot could not be made)."""
    return REPORT.write(rows, meta, out_dir, with_plot)


def merge_reports(paths: list[Path]) -> tuple[list[Row], dict]:
    """Rows and meta of several ``bench.json`` files (runs split across GPU sessions) as one
    report. A later file's measurement replaces an earlier one of the same (shape, provider,
    mode); a later skip never replaces a measurement. Every run's command and date are kept, and
    every run's kernel notes; a provider is listed as unavailable only if no run measured it."""
    rows: dict[tuple[str, str, str], Row] = {}
    runs, meta, kernels, unavailable = [], {}, {}, {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data.pop("rows"):
            row = Row(**r)
            key = (row.shape, row.provider, row.mode)
            if row.skip is None or key not in rows or rows[key].skip is not None:
                rows[key] = row
        runs.extend(data.pop("runs", None) or [{k: data.get(k) for k in ("date", "command", "wall_s")}])
        kernels.update(data.pop("kernels", None) or {})
        unavailable.update(data.pop("unavailable", None) or {})
        meta = {**meta, **data}
    measured = {r.provider for r in rows.values() if r.skip is None}
    meta["kernels"] = kernels
    meta["unavailable"] = {k: v for k, v in unavailable.items() if k not in measured}
    meta.pop("partial", None)
    meta["runs"] = runs
    meta["date"] = " / ".join(str(r["date"]) for r in runs)
    meta["command"] = "`; `".join(str(r["command"]) for r in runs)
    return list(rows.values()), meta


def select_shapes(keys: list[str] | None) -> list[Shape]:
    """Shapes by id ("1", "7b") or name, in the given order; all when ``keys`` is empty."""
    keys = [k for key in keys or [] for k in key.split(",") if k]
    if not keys:
        return list(SHAPES)
    table = {s.id: s for s in SHAPES} | {s.name: s for s in SHAPES}
    unknown = [k for k in keys if k not in table]
    if unknown:
        known = ", ".join(f"{s.id}={s.name}" for s in SHAPES)
        raise ValueError(f"unknown shape(s) {unknown}; known: {known}")
    return list(dict.fromkeys(table[k] for k in keys))


def build_parser() -> argparse.ArgumentParser:
    shapes = "; ".join(f"{s.id}={s.name} ({s.dims}, tangents {s.tangents})" for s in SHAPES)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", epilog=f"shapes: {shapes}",
                                 description="Benchmark flashjvp against PyTorch SDPA and other JVP "
                                             "attention kernels; see benchmarks/README.md.")
    ap.add_argument("--shapes", nargs="+", help="shape ids or names (space/comma separated); default all")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--providers", nargs="+", choices=BUILTIN_PROVIDERS, default=list(DEFAULT_PROVIDERS),
                    help="built-in providers (default: all but flashjvp-triton and flashjvp-cudnn, flashjvp "
                         "with FLASHJVP_CUDNN=0 / =1 in modes fwd, bwd, scm; kernels given with --kernel always run)")
    ap.add_argument("--kernel", action="append", default=[], metavar="NAME=FILE.py:ATTR",
                    help="extra kernel attr(q, k, v, tq, tk, tv, causal, scale) -> (o, to); repeatable")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    add_run_options(ap, time_limit=480.0)
    ap.add_argument("--merge", nargs="+", type=Path, metavar="BENCH.json",
                    help="measure nothing: merge these reports (later ones win) into --out")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.merge:
        if args.out is None:
            ap.error("--merge needs --out")
        rows, meta = merge_reports(args.merge)
        paths = write_report(rows, meta, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    try:
        shapes = select_shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("benchmarks.bench needs a CUDA GPU", file=sys.stderr)
        return 2

    providers, unavailable, kernels = [], {}, {}
    for name in args.providers:
        try:
            providers.append(builtin_provider(name))
        except ImportError as e:
            unavailable[name] = f"not importable: {e}"
    for spec in args.kernel:
        try:
            p, kernels[spec.partition("=")[0]] = load_kernel(spec)
            providers.append(p)
        except Exception as e:  # noqa: BLE001 - reported, the other providers still run
            unavailable[spec] = skip_reason(e, [])
    gpu = torch.cuda.get_device_name()
    meta = {**run_metadata(gpu, "benchmarks.bench", argv), "dtype": args.dtype,
            "quick": args.quick, "unavailable": unavailable, "kernels": kernels,
            "shapes": [asdict(s) | {"dims": s.dims} for s in shapes]}
    for k, v in {**unavailable, **kernels}.items():
        print(f"{k}: {v}", flush=True)
    measure = lambda **kw: run(shapes, providers, args.modes, DTYPES[args.dtype], args.quick, args.time_limit, **kw)
    return REPORT.run(measure, meta, args.out or results_dir(gpu))


if __name__ == "__main__":
    sys.exit(main())
