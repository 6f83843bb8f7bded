"""Projected per-layer time of sequence-parallel forward+JVP attention (Ulysses, ring) on P GPUs.

For each whole sequence length N and rank count P the model takes, per rank and attention call:

* compute: the forward+JVP kernel time of the rank's work. Ulysses: the whole sequence for H/P
  heads, one launch. Ring: P launches of an (N/P queries x N/P keys) block for all H heads (a
  causal zig-zag ring does half of that work on every rank). With ``--measure`` (a CUDA GPU) the
  kernel times are measured with ``triton.testing.do_bench`` at exactly those shapes; otherwise
  they are the FLOPs over ``--tflops`` (a rate measured elsewhere, e.g. the suite's).
* communication, bytes sent per rank: Ulysses moves q, k, v, their tangents and o, to through
  all-to-alls, (P-1)/P of each shard; the ring sends the k, v shards and their tangents P-1
  times. Time = bytes / ``--link-gbs`` (per-GPU bandwidth in one direction).
* total: Ulysses compute + communication (the exchanges and the kernel do not overlap);
  ring max(compute, communication) (the transfer of the next shard runs during the kernel).

    python benchmarks/sequence_parallel_model.py --tflops 580                 # no GPU: FLOP model
    PYTHONPATH=src python benchmarks/sequence_parallel_model.py --measure    # on one GPU
"""

import argparse


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tflops", type=float, default=580.0, help="forward+JVP rate without --measure")
    ap.add_argument("--link-gbs", type=float, nargs="+", default=[450.0, 50.0],
                    help="per-GPU one-way bandwidth in GB/s for each --ranks entry (NVLink in a node, "
                         "400 Gb/s InfiniBand across nodes)")
    ap.add_argument("--measure", action="store_true", help="time the kernels on this CUDA GPU")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
