"""Sequence-parallel attention with tangents across processes: Ulysses and ring attention.

Each rank holds a shard of a long sequence; the script runs forward+JVP and a backward through
``flashjvp.distributed`` and checks every rank's shard against attention on the whole sequence
(computed on rank 0's device from the same seed). GPUs talk through NCCL, CPUs through gloo
(there, set TRITON_INTERPRET=1 for the Triton kernels, and keep the sizes small):

    torchrun --nproc-per-node 8 examples/sequence_parallel.py --seq-len 32768 --heads 16 --causal
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/sequence_parallel.py --seq-len 64 --heads 4 --dim 16
"""

import argparse
import os

import torch
import torch.distributed as dist

import flashjvp
from flashjvp.distributed import ring_attention, ulysses_attention, zigzag_shard


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="whole sequence length")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    # (B, N, H, D) whole tensors, the same on every rank: q, k, v and their tangents
    full = [torch.randn(1, args.seq_len, args.heads, args.dim, generator=gen).to(device, dtype) for _ in range(6)]
    n = args.seq_len // world

    for name, fn, shard in (
        ("ulysses", ulysses_attention, lambda x: x[:, rank * n:(rank + 1) * n]),
        ("ring", ring_attention, (lambda x: zigzag_shard(x, rank, world, layout="bnhd")) if args.causal
         else (lambda x: x[:, rank * n:(rank + 1) * n])),
    ):
        q, k, v = (shard(x).requires_grad_() for x in full[:3])
        o, to = torch.func.jvp(lambda *a, fn=fn: fn(*a, causal=args.causal, layout="bnhd"), (q, k, v),
                               tuple(shard(t) for t in full[3:]))
        o.sum().backward()  # gradients of every rank's q, k, v shard
        with torch.no_grad():
            ref_o, ref_to = flashjvp.attention_jvp(*full, causal=args.causal, layout="bnhd")
        err = max((o - shard(ref_o)).abs().max().item(), (to - shard(ref_to)).abs().max().item())
        errs = [torch.tensor(err, device=device) for _ in range(world)]
        dist.all_gather(errs, torch.tensor(err, device=device))
        if rank == 0:
            print(f"{name}: {world} ranks, N={args.seq_len}, H={args.heads}, D={args.dim}, causal={args.causal}: "
                  f"max |error| of o, to over ranks {max(e.item() for e in errs):.2e} "
                  f"(against attention_jvp on the whole sequence, {dtype})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
