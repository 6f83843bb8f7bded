"""Sequence parallelism on several ranks: correctness of Ulysses and ring attention against one
device, and (on CUDA GPUs) their scaling against benchmarks/sequence_parallel_model.py.

    torchrun --nproc-per-node 8 benchmarks/sequence_parallel.py                  # NCCL, GPUs
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/sequence_parallel.py \\
        --backend gloo --out /tmp/sp                                              # CPU: correctness only

Correctness (every case of Ulysses and ring: causal zig-zag or not, GQA or not, layouts bhnd and
bnhd): rank 0 draws the whole-sequence inputs with a fixed seed and broadcasts them; rank 0 runs
single-device flashjvp on them (forward+JVP, then the gradients of <o, w> + <to, w^2>, through the
tangent, or of <o, w> for the ring, which has no gradients through the tangent) and broadcasts the
result. Every rank checks its shard of the forward, the forward+JVP, the explicit-tangent form and
the gradients (summed over the ranks) against it, with the tests' tolerance (tests/helpers.py):
|out - single| <= 3 x |single - float64|_max + floor x max(1, |float64|_max). Every rank's verdict
is reduced, so every rank reports the same. Uneven and mismatched shards must raise the clear
ValueError on every rank. Scaling (CUDA only): forward+JVP and training-step times at Wan-like
shapes, the ring's overlap of communication with compute, the bytes exchanged per step.
Writes results/<gpu-slug>-x<P>/sequence_parallel.{json,md,png} (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sequence_parallel_model import flops_fwd_jvp, project  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp.distributed import (  # noqa: E402
    ring_attention,
    ring_attention_jvp,
    ulysses_attention,
    ulysses_attention_jvp,
    zigzag_shard,
)

FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}  # tests/helpers.py
FACTOR = 3.0
SCALING_SEQ_LENS = (32760, 65536, 131072)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# --------------------------------------------------------------------------- correctness


def cases(quick: bool):
    """(method, causal, gqa, layout) of every correctness case; ``quick``: each option once per method."""
    if quick:
        return [(m, c, c, "bnhd" if c else "bhnd") for m in ("ulysses", "ring") for c in (False, True)]
    return [(m, c, g, lay) for m in ("ulysses", "ring") for c in (False, True) for g in (False, True)
            for lay in ("bhnd", "bnhd")]


def _shape(b, h, n, d, layout):
    return (b, h, n, d) if layout == "bhnd" else (b, n, h, d)


def _seq(layout):
    return 2 if layout == "bhnd" else 1


def _inputs(case, dims, device, dtype, seed):
    """q, k, v, tq, tk, tv and the loss weight w (whole sequence), drawn on rank 0 and broadcast."""
    _, _, gqa, layout = case
    b, h, n, d = dims
    hkv = h // 2 if gqa else h
    shapes = [_shape(b, hh, n, d, layout) for hh in (h, hkv, hkv, h, hkv, hkv, h)]
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]
    for x in xs:
        dist.broadcast(x, src=0)
    return xs


def _run(fn, xs, layout, causal, through_tangent, shard):
    """(o, to, dq, dk, dv) of ``fn`` under torch.func.jvp on ``shard``-ed inputs; the gradients
    of <o, w> (+ <to, w^2>) w.r.t. the whole-sequence leaves."""
    leaves = [x.detach().clone().requires_grad_() for x in xs[:3]]
    o, to = torch.func.jvp(lambda *a: fn(*a, causal=causal, layout=layout), tuple(shard(x) for x in leaves),
                           tuple(shard(t) for t in xs[3:6]))
    w = shard(xs[6]).float()
    loss = (o.float() * w).sum()
    if through_tangent:
        loss = loss + (to.float() * w * w).sum()
    loss.backward()
    return [o.detach(), to.detach()] + [x.grad for x in leaves]


def _single(xs, layout, causal, through_tangent, dtype):
    """Rank 0's single-device flashjvp result and the float64 reference it is judged by."""
    ident = lambda x: x  # noqa: E731
    flash = _run(flashjvp.attention, xs, layout, causal, through_tangent, ident)
    ref = _run(flashjvp.attention_ref, [x.double() for x in xs], layout, causal, through_tangent, ident)
    return flash, [FACTOR * (f.double() - r).abs().max().item() + FLOOR[dtype] * max(1.0, r.abs().max().item())
                   for f, r in zip(flash, ref)]


def check_case(case, dims, device, dtype, rank, world, seed=0):
    """One correctness case on every rank: {name: worst |out - single| / tolerance over the ranks}."""
    method, causal, gqa, layout = case
    xs = _inputs(case, dims, device, dtype, seed)
    through = method == "ulysses"
    names = ["o", "to", "dq", "dk", "dv"]
    if rank == 0:
        single, tols = _single(xs, layout, causal, through, dtype)
    else:
        single, tols = [torch.empty_like(x) for x in (xs[0], xs[3], xs[0], xs[1], xs[2])], [0.0] * 5
    for t in single:
        dist.broadcast(t, src=0)
    tols_t = torch.tensor(tols, dtype=torch.float64, device=device)
    dist.broadcast(tols_t, src=0)
    tols = tols_t.tolist()
    seq = _seq(layout)
    if method == "ring" and causal:
        shard = lambda x: zigzag_shard(x, rank, world, layout=layout)  # noqa: E731
    else:
        shard = lambda x: x.narrow(seq, rank * (x.shape[seq] // world), x.shape[seq] // world)  # noqa: E731
    fn, fn_jvp = (ulysses_attention, ulysses_attention_jvp) if method == "ulysses" else (ring_attention,
                                                                                        ring_attention_jvp)
    got = _run(fn, xs, layout, causal, through, shard)
    for g in got[2:]:
        dist.all_reduce(g)  # every rank's gradient reaches the whole sequence
    ratios = {}
    for name, out, ref, tol in zip(names, got, single, tols):
        ref = ref if name.startswith("d") else shard(ref)
        ratios[f"fwd_jvp+bwd {name}"] = (out.double() - ref.double()).abs().max().item() / tol
    with torch.no_grad():
        o = fn(*(shard(x) for x in xs[:3]), causal=causal, layout=layout)
        o2, to2 = fn_jvp(*(shard(x) for x in xs[:6]), causal=causal, layout=layout)
    for name, out, ref, tol in (("fwd o", o, single[0], tols[0]), ("jvp o", o2, single[0], tols[0]),
                                ("jvp to", to2, single[1], tols[1])):
        ratios[name] = (out.double() - shard(ref).double()).abs().max().item() / tol
    if method == "ring":  # gradients through the tangent: refused, on every rank
        leaves = [shard(x).detach().clone().requires_grad_() for x in xs[:3]]
        _, to = torch.func.jvp(lambda *a: fn(*a, causal=causal, layout=layout), tuple(leaves),
                               tuple(shard(t) for t in xs[3:6]))
        try:
            to.sum().backward()
            ratios["through-tangent refused"] = float("inf")
        except NotImplementedError:
            ratios["through-tangent refused"] = 0.0
    worst = torch.tensor([v if v == v else float("inf") for v in ratios.values()], dtype=torch.float64,
                         device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(ratios, worst.tolist()))


def check_errors(device, rank, world):
    """Uneven and mismatched shards: the clear ValueError on every rank (no rank hangs)."""
    results = {}
    trials = {
        "uneven shards (ulysses)": (lambda: ulysses_attention(*(torch.randn(1, 4 * world + rank, world, 16,
                                                                            device=device),) * 3, layout="bnhd"),
                                    "same length"),
        "uneven shards (ring)": (lambda: ring_attention(*(torch.randn(1, 4 + 2 * rank, 2, 16, device=device),) * 3,
                                                       layout="bnhd"), "same length"),
        "heads not divisible (ulysses)": (lambda: ulysses_attention(*(torch.randn(1, 4, world + 1, 16,
                                                                                  device=device),) * 3,
                                                                    layout="bnhd"), "divisible by the group size"),
    }
    for name, (call, match) in trials.items():
        try:
            call()
            ok = False
        except ValueError as e:
            ok = match in str(e)
        flag = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        results[name] = bool(flag.item() == 1.0)
    return results


def correctness(rank, world, device, dtype, quick=False, time_limit=None, log=print):
    """Every correctness case; a list of rows {case, passed, ratios | error}. Never raises."""
    start = time.monotonic()
    # shard lengths divisible by 2 x world (zig-zag chunks); heads by world (Ulysses, GQA halves them)
    if device.type == "cpu":
        dims = (1, 2 * world, 4 * world, 16)
    else:
        dims = (2, 2 * world, 64 * world, 64)
    rows = []
    for i, case in enumerate(cases(quick)):
        name = "{} causal={} gqa={} {}".format(*case)
        if time_limit and time.monotonic() - start > time_limit:
            rows.append({"case": name, "passed": False, "error": "skipped: --time-limit reached"})
            continue
        try:
            ratios = check_case(case, dims, device, dtype, rank, world, seed=i)
            rows.append({"case": name, "passed": all(v <= 1.0 for v in ratios.values()), "ratios": ratios})
        except Exception as e:  # recorded, never fatal
            rows.append({"case": name, "passed": False, "error": f"{type(e).__name__}: {e}"})
            if rank == 0:
                traceback.print_exc()
        if rank == 0:
            log(f"[correctness] {name}: {'pass' if rows[-1]['passed'] else 'FAIL ' + str(rows[-1].get('error', ''))}")
    try:
        for name, ok in check_errors(device, rank, world).items():
            rows.append({"case": name, "passed": ok})
    except Exception as e:
        rows.append({"case": "error cases", "passed": False, "error": f"{type(e).__name__}: {e}"})
    return rows


# --------------------------------------------------------------------------- scaling (CUDA)


def _time_ms(fn, warmup=2, repeat=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / repeat * 1e3], device="cuda")
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return elapsed.item()


def _ring_comm_ms(shard_shape, world):
    """P - 1 hops of the k, v, tk, tv shards alone (the ring without its kernel)."""
    from flashjvp.distributed import _ring_step

    bufs = [torch.randn(shard_shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)]

    def ring():
        cur = bufs
        for _ in range(world - 1):
            cur, reqs = _ring_step(cur, None)
            for r in reqs:
                r.wait()

    return _time_ms(ring)


def _scale_row(row, n, method, world, b, h, d, link):
    """One scaling row, timed in place into ``row``."""
    if n % world:
        raise ValueError(f"N = {n} not divisible by P = {world}")
    shard = (b, n // world, h, d)
    xs = [torch.randn(shard, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    fn, fn_jvp = ((ulysses_attention, ulysses_attention_jvp) if method == "ulysses"
                  else (ring_attention, ring_attention_jvp))
    row["fwd_jvp_ms"] = _time_ms(lambda: fn_jvp(*xs, layout="bnhd"))
    leaves = [x.clone().requires_grad_() for x in xs[:3]]

    def step():
        o, to = torch.func.jvp(lambda *a: fn(*a, layout="bnhd"), tuple(leaves), tuple(xs[3:]))
        (o.float().sum() + (to.float().square().sum() if method == "ulysses" else 0)).backward()

    row["train_step_ms"] = _time_ms(step)
    row["train_step_loss"] = "<o,1> + |to|^2" if method == "ulysses" else "<o,1> (no grads through to)"
    elt = 2
    shard_bytes = b * (n // world) * h * d * elt
    if method == "ulysses":
        row["all_to_all_bytes_fwd_jvp"] = int(8 * shard_bytes * (world - 1) / world)
    else:
        row["p2p_bytes_fwd_jvp"] = int(4 * shard_bytes * (world - 1))
        block = [torch.randn(shard, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
        kern = _time_ms(lambda: flashjvp.attention_jvp(*block, layout="bnhd"))
        row["ring_compute_ms"] = world * kern
        row["ring_comm_ms"] = _ring_comm_ms(shard, world)
        hidden = row["ring_compute_ms"] + row["ring_comm_ms"] - row["fwd_jvp_ms"]
        row["overlap"] = max(0.0, hidden) / max(1e-9, min(row["ring_compute_ms"], row["ring_comm_ms"]))
    model = project(n, world, argparse.Namespace(batch=b, heads=h, dim=d, causal=False, tflops=580.0,
                                                 link_gbs=link, measure=False))
    mod = model[0] if method == "ulysses" else model[1]
    row["model_ms"] = None if mod is None else mod[2]
    row["model_assumes"] = f"{link:g} GB/s link, 580 TFLOP/s forward+JVP"
    row["tflops_fwd_jvp"] = flops_fwd_jvp(b, h, n, n, d, False) / world / (row["fwd_jvp_ms"] * 1e9)
    torch.cuda.empty_cache()


def scaling(rank, world, seq_lens, time_limit=None, log=print):
    """Per-rank times at B1 H40 D128 bf16, non-causal (Wan-like), against the model."""
    start = time.monotonic()
    b, h, d = 1, 40, 128
    link = 450.0
    rows = []
    for n in seq_lens:
        for method in ("ulysses", "ring"):
            row = {"N": n, "P": world, "method": method}
            rows.append(row)
            if time_limit and time.monotonic() - start > time_limit:
                row["error"] = "skipped: --time-limit reached"
                continue
            try:
                _scale_row(row, n, method, world, b, h, d, link)
            except Exception as e:  # recorded, never fatal
                row["error"] = f"{type(e).__name__}: {e}"
            if rank == 0:
                log(f"[scaling] {row}")
    return rows


# --------------------------------------------------------------------------- report


def _fmt(x):
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)


def write_report(out: Path, meta, correct, scale):
    out.mkdir(parents=True, exist_ok=True)
    (out / "sequence_parallel.json").write_text(json.dumps({**meta, "correctness": correct, "scaling": scale},
                                                           indent=1))
    lines = [f"# Sequence parallelism, {meta['gpu']} x{meta['world']} ({meta['backend']})", "",
             f"`{meta['command']}`; torch {meta['torch']}, {meta['date']}", "", "## Correctness", "",
             "| case | passed | worst error / tolerance | error |", "|---|---|---|---|"]
    for r in correct:
        worst = max(r["ratios"].values()) if r.get("ratios") else None
        lines.append(f"| {r['case']} | {'yes' if r['passed'] else 'NO'} | {_fmt(worst)} | {r.get('error', '')} |")
    lines += ["", "## Scaling", ""]
    if isinstance(scale, str):
        lines.append(scale)
    else:
        keys = ["N", "P", "method", "fwd_jvp_ms", "train_step_ms", "model_ms", "ring_compute_ms", "ring_comm_ms",
                "overlap", "all_to_all_bytes_fwd_jvp", "p2p_bytes_fwd_jvp", "error"]
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in scale]
        _plot(out, scale)
    (out / "sequence_parallel.md").write_text("\n".join(lines) + "\n")


def _plot(out, scale):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in ("ulysses", "ring"):
        rows = [r for r in scale if r["method"] == method and "fwd_jvp_ms" in r]
        ax.plot([r["N"] for r in rows], [r["fwd_jvp_ms"] for r in rows], "o-", label=f"{method} measured")
        ax.plot([r["N"] for r in rows], [r["model_ms"] for r in rows], "x--", label=f"{method} model")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("forward+JVP ms per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sequence_parallel.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with CUDA, else gloo")
    ap.add_argument("--quick", action="store_true", help="fewer correctness cases, the shortest scaling N only")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<gpu-slug>-x<P>)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per part; later rows are skipped")
    ap.add_argument("--correctness-only", action="store_true", help="skip the scaling part")
    ap.add_argument("--timeout", type=float, default=300.0, help="process group timeout, seconds")
    args = ap.parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        device = torch.device("cuda") if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        correct = correctness(rank, world, device, dtype, quick=args.quick, time_limit=args.time_limit)
        if args.correctness_only:
            scale = "skipped: --correctness-only."
        elif cuda:
            seq = SCALING_SEQ_LENS[:1] if args.quick else SCALING_SEQ_LENS
            scale = scaling(rank, world, seq, time_limit=args.time_limit)
        else:
            scale = "skipped: the scaling part needs CUDA GPUs on NCCL (this run: gloo on the CPU)."
        gpu = torch.cuda.get_device_name() if cuda else "cpu"
        if rank == 0:
            import triton

            meta = {"gpu": gpu, "world": world, "backend": backend, "dtype": str(dtype).replace("torch.", ""),
                    "torch": torch.__version__, "triton": triton.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["torchrun", f"--nproc-per-node {world}", "benchmarks/sequence_parallel.py",
                                         *(argv if argv is not None else sys.argv[1:])])}
            out = args.out or Path(__file__).resolve().parent / "results" / f"{slug(gpu)}-x{world}"
            write_report(out, meta, correct, scale)
            print(f"wrote {out}/sequence_parallel.{{json,md{',png' if cuda else ''}}}")
        passed = all(r["passed"] for r in correct)
        if rank == 0:
            print(f"correctness: {sum(r['passed'] for r in correct)}/{len(correct)} passed")
        return 0 if passed else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
