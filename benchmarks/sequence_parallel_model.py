"""Projected per-layer time of sequence-parallel forward+JVP attention (Ulysses, ring) on P GPUs.

For each whole sequence length N and rank count P the model takes, per rank and attention call:

* compute: the forward+JVP kernel time of the rank's work. Ulysses: the whole sequence for H/P
  heads, one launch. Ring: P launches of an (N/P queries x N/P keys) block for all H heads (a
  causal zig-zag ring does half of that work on every rank), as the ring runs with
  ``kv_blocks_per_launch=1``. With ``--measure`` (a CUDA GPU) the
  kernel times are measured with ``triton.testing.do_bench`` at exactly those shapes; otherwise
  they are the FLOPs over ``--tflops`` (a rate measured elsewhere, e.g. the suite's).
* communication, bytes sent per rank: Ulysses moves q, k, v, their tangents and o, to through
  all-to-alls, (P-1)/P of each shard; the ring sends the k, v shards and their tangents P-1
  times. Time = bytes / ``--link-gbs`` (per-GPU bandwidth in one direction).
* total: Ulysses compute + communication (the exchanges and the kernel do not overlap);
  ring max(compute, communication) (the transfer of the next shard runs during the kernel).

With ``--ring-batching`` (one CUDA GPU, no torch.distributed) it times instead one rank's ring
compute, forward+JVP, as the ring runs it (``flashjvp.distributed._rank_compute`` fed the P kv
shards a rank receives; the communication is not simulated) for ``kv_blocks_per_launch`` 1 (a
launch and a merge per shard) against the automatic choice (several shards per launch), causal
zig-zag and not, at N = 32768 and P = 8, 16, 32, 64 by default; writes ring_batching.{json,md}.

    python -m benchmarks.sequence_parallel_model --tflops 580                      # no GPU: FLOP model
    PYTHONPATH=src python -m benchmarks.sequence_parallel_model --measure          # on one GPU
    FLASHJVP_AUTOTUNE=0 PYTHONPATH=src python -m benchmarks.sequence_parallel_model --ring-batching
"""

import argparse
import sys
from pathlib import Path


def flops_fwd_jvp(b, h, nq, nk, d, causal) -> float:
    """Forward+JVP with all tangents counted as 3 forwards of 4 B H Nq Nk D FLOPs (benchmarks.bench)."""
    return 3 * 4.0 * b * h * nq * nk * d * (0.5 if causal else 1.0)


def kernel_ms(b, h, nq, nk, d, causal, args) -> float:
    if not args.measure:
        return flops_fwd_jvp(b, h, nq, nk, d, causal) / (args.tflops * 1e12) * 1e3
    import torch
    import triton.testing

    import flashjvp

    x = [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for n in (nq, nk, nk) * 2]
    return triton.testing.do_bench(lambda: flashjvp.attention_jvp(*x, causal=causal, layout="bnhd"),
                                   warmup=5, rep=20, return_mode="median")


def project(n, p, args):
    b, h, d, elt = args.batch, args.heads, args.dim, 2
    shard = b * (n // p) * h * d * elt  # bytes of one (B, N/P, H, D) bf16 shard
    if h % p == 0:
        ul_compute = kernel_ms(b, h // p, n, n, d, args.causal, args)
        ul_comm = 8 * shard * (p - 1) / p / (args.link_gbs * 1e9) * 1e3  # q k v tq tk tv in, o to out
        ulysses = (ul_compute, ul_comm, ul_compute + ul_comm)
    else:
        ulysses = None  # heads not divisible by the ranks
    block = kernel_ms(b, h, n // p, n // p, d, False, args)
    ring_compute = p * block * (0.5 if args.causal else 1.0)
    ring_comm = 4 * shard * (p - 1) / (args.link_gbs * 1e9) * 1e3  # k v tk tv, P-1 hops
    return ulysses, (ring_compute, ring_comm, max(ring_compute, ring_comm))


def ring_batching_rows(args, device="cuda", dtype=None, timer=None) -> list[dict]:
    """Rows of one rank's ring compute (forward+JVP, rank 0 of P) for kv_blocks_per_launch 1 and
    automatic, causal and not, over the P shards it receives; ``timer(fn, leaves, quick)`` as
    ``benchmarks.harness.measure`` (the default; ``measure_cpu`` for a CPU smoke run)."""
    import functools
    import time

    import torch

    from benchmarks.harness import measure
    from flashjvp._launch import LaunchLog
    from flashjvp.distributed import _blocks_per_launch, _rank_compute

    timer, dtype = timer or measure, dtype or torch.bfloat16
    b, h, d = args.batch, args.heads, args.dim
    rows, t0 = [], time.perf_counter()
    for n in args.seq_lens:
        whole = [torch.randn(b, n, h, d, device=device, dtype=dtype) for _ in range(6)]  # q k v tq tk tv
        for causal in (False, True):
            for p in args.ranks:
                m, rank = n // p, 0
                q, tq = whole[0][:, :m], whole[3][:, :m]
                # the shards in the ring's arrival order; the work depends on their source ranks only
                shards = [(src, tuple(x[:, src * m:(src + 1) * m] for x in whole[1:3] + whole[4:]))
                          for src in ((rank - step) % p for step in range(p))]
                base = None
                for g in (1, None):
                    row = dict(n=n, ranks=p, causal=causal, shard_keys=m, setting="1" if g == 1 else "auto",
                               blocks_per_launch=_blocks_per_launch(g, m, p), launches=None, ms=None, speedup=None,
                               peak_mib=None, flops_ms=flops_fwd_jvp(b, h, m, n, d, causal) / (args.tflops * 1e9))
                    if args.time_limit and time.perf_counter() - t0 > args.time_limit:
                        row["skip"] = f"time limit reached (--time-limit {args.time_limit:g} s)"
                        rows.append(row)
                        continue
                    fn = functools.partial(_rank_compute, q, tq, shards, rank, p, causal, d ** -0.5, g)
                    try:
                        row["ms"], row["peak_mib"], _ = timer(fn, [], args.quick)
                        with LaunchLog() as log:
                            fn()
                        row["launches"] = len(log.launches)
                        base = row["ms"] if g == 1 else base
                        row["speedup"] = base / row["ms"] if base else None
                    except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
                        row["skip"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                    rows.append(row)
                    print(row, flush=True)
        del whole
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def ring_batching_markdown(rows, meta, args) -> str:
    from benchmarks.harness import md_table

    f = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    table = md_table(["N", "P", "causal", "keys/shard", "kv_blocks_per_launch (g)", "flashjvp launches", "ms",
                      f"FLOPs at {args.tflops:g} TFLOP/s, ms", "speedup vs g = 1", "peak MiB", "note"],
                     [[str(r["n"]), str(r["ranks"]), str(r["causal"]), str(r["shard_keys"]),
                       f"{r['setting']} ({r['blocks_per_launch']})", f(r["launches"], "d"), f(r["ms"], ".3f"),
                       f(r["flops_ms"], ".3f"), f(r["speedup"], ".2f"), f(r["peak_mib"], ".0f"), r.get("skip", "")]
                      for r in rows])
    return (f"# One rank's ring compute, forward+JVP, by kv_blocks_per_launch\n\n{meta['gpu']}, "
            f"B{args.batch} H{args.heads} D{args.dim} bf16, rank 0 of P simulated on one GPU (its compute loop "
            f"over the P shards it receives, no communication); `{meta['command']}`\n\n{table}\n")


def ring_batching(args, argv) -> int:
    """``--ring-batching``: the rows measured on this CUDA GPU, printed and written to
    ``--out``/ring_batching.{json,md}."""
    import json
    import time

    import torch

    if not torch.cuda.is_available():
        print("sequence_parallel_model --ring-batching times kernels on a CUDA GPU; none is visible "
              "(the FLOP model runs without --ring-batching)", file=sys.stderr)
        return 1
    from benchmarks.harness import results_dir, run_metadata

    gpu = torch.cuda.get_device_name()
    out = args.out or results_dir(gpu)
    meta = run_metadata(gpu, "benchmarks.sequence_parallel_model", argv)
    t0 = time.perf_counter()
    rows = ring_batching_rows(args)
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    md = ring_batching_markdown(rows, meta, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ring_batching.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / "ring_batching.md").write_text(md)
    print("\n" + md + f"\nwrote {out / 'ring_batching.json'}, {out / 'ring_batching.md'} ({meta['wall_s']:.0f} s)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+",
                    help="default 32768 65536 131072 262144; with --ring-batching 32768")
    ap.add_argument("--ranks", type=int, nargs="+", help="default 8 64; with --ring-batching 8 16 32 64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tflops", type=float, default=580.0, help="forward+JVP rate without --measure")
    ap.add_argument("--link-gbs", type=float, nargs="+", default=[450.0, 50.0],
                    help="per-GPU one-way bandwidth in GB/s for each --ranks entry (NVLink in a node, "
                         "400 Gb/s InfiniBand across nodes)")
    ap.add_argument("--measure", action="store_true", help="time the kernels on this CUDA GPU")
    ap.add_argument("--ring-batching", action="store_true",
                    help="time one rank's ring compute for kv_blocks_per_launch 1 and automatic on this CUDA GPU "
                         "(causal and not; --causal is ignored)")
    ap.add_argument("--quick", action="store_true", help="--ring-batching: fewer do_bench repetitions")
    ap.add_argument("--time-limit", type=float, default=50.0,
                    help="--ring-batching: seconds after which the remaining rows are skipped (0: no limit)")
    ap.add_argument("--out", type=Path, help="--ring-batching: output folder; default benchmarks/results/<gpu-slug>/")
    args = ap.parse_args(argv)
    if args.ring_batching:
        args.seq_lens, args.ranks = args.seq_lens or [32768], args.ranks or [8, 16, 32, 64]
        return ring_batching(args, sys.argv[1:] if argv is None else argv)
    args.seq_lens, args.ranks = args.seq_lens or [32768, 65536, 131072, 262144], args.ranks or [8, 64]
    links = dict(zip(args.ranks, args.link_gbs + args.link_gbs[-1:] * len(args.ranks)))
    print(f"B{args.batch} H{args.heads} D{args.dim} bf16 forward+JVP, causal={args.causal}; compute "
          + ("measured on this GPU" if args.measure else f"from FLOPs at {args.tflops:g} TFLOP/s"))
    print("| N | P | link GB/s | Ulysses compute / comm / total ms | ring compute / comm / total ms |")
    print("|---|---|---|---|---|")
    for p in args.ranks:
        for n in args.seq_lens:
            a = argparse.Namespace(**{**vars(args), "link_gbs": links[p]})
            ul, ring = project(n, p, a)
            fmt = lambda t: " / ".join(f"{x:.2f}" for x in t)  # noqa: E731
            print(f"| {n} | {p} | {links[p]:g} | {fmt(ul) if ul else 'H % P != 0'} | {fmt(ring)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
