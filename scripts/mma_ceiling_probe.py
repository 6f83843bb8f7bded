"""GPU diagnostic: how fast Triton runs the forward+JVP's matrix products alone, per tile.

A stripped copy of the forward+JVP key loop: the same tiles, loads (K and tK read transposed)
and the six products per key block (S, tQ.K^T, Q.tK^T, E.V, (E*tS).V, E.tV), but no softmax:
E is S cast to the input dtype and E*tS is tS cast. Its time is a ceiling for a kernel of that
loop structure on that tile: what is left when the exponentials, masks, row maxima and sums
cost nothing. Printed next to flashjvp's own kernel forced to the same tile, as TFLOP/s with
forward+JVP counted as three forwards (the benchmark's count).

    PYTHONPATH=src python scripts/mma_ceiling_probe.py --shapes 4,32,4096,64 2,24,4096,128 \
        --tiles 128,64,8,3 64,64,4,3
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
import triton.testing
from tile_sweep import _force  # scripts/: on sys.path when this file runs as a script

import flashjvp


@triton.jit
def _products_kernel(Q, TQ, K, TK, V, TV, O, TO, N, s_b, s_h, s_n,
                     D: tl.constexpr, JVP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    base = tl.program_id(2).to(tl.int64) * s_b + tl.program_id(1).to(tl.int64) * s_h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D)  # (D,)
    q_off = base + rows[:, None] * s_n + offs_d[None, :]  # (BLOCK_M, D)
    kt_off = base + offs_d[:, None] + offs_n[None, :] * s_n  # (D, BLOCK_N): K transposed
    v_off = base + offs_n[:, None] * s_n + offs_d[None, :]  # (BLOCK_N, D)
    q = tl.load(Q + q_off)  # (BLOCK_M, D)
    tq = tl.load(TQ + q_off)  # (BLOCK_M, D)
    acc_o = tl.zeros([BLOCK_M, D], tl.float32)
    acc_t = tl.zeros([BLOCK_M, D], tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        k = tl.load(K + kt_off + start * s_n)  # (D, BLOCK_N)
        s = tl.dot(q, k)  # (BLOCK_M, BLOCK_N)
        if JVP:
            ts = tl.dot(tq, k)
            ts = tl.dot(q, tl.load(TK + kt_off + start * s_n), ts)  # (BLOCK_M, BLOCK_N)
        e = s.to(q.dtype)
        v = tl.load(V + v_off + start * s_n)  # (BLOCK_N, D)
        acc_o = tl.dot(e, v, acc_o)  # (BLOCK_M, D)
        if JVP:
            acc_t = tl.dot(ts.to(q.dtype), v, acc_t)
            acc_t = tl.dot(e, tl.load(TV + v_off + start * s_n), acc_t)  # (BLOCK_M, D)
    tl.store(O + q_off, acc_o.to(O.dtype.element_ty))
    if JVP:
        tl.store(TO + q_off, acc_t.to(TO.dtype.element_ty))


def products(x, out, jvp, bm, bn, warps, stages):
    q, k, v, tq, tk, tv = x
    b, h, n, d = q.shape
    grid = (n // bm, h, b)
    return lambda: _products_kernel[grid](q, tq, k, tk, v, tv, out[0], out[1], n, *q.stride()[:3],
                                          D=d, JVP=jvp, BLOCK_M=bm, BLOCK_N=bn,
                                          num_warps=warps, num_stages=stages)


def flashjvp_tile(x, jvp, bm, bn, warps, stages):
    """flashjvp's forward (+JVP) forced to one tile."""
    _force([triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": False}, num_warps=warps, num_stages=stages)])
    return (lambda: flashjvp.attention_jvp(*x)) if jvp else (lambda: flashjvp.attention(*x[:3]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["4,32,4096,64", "2,24,4096,128"], help="B,H,N,D")
    p.add_argument("--tiles", nargs="+", default=["128,64,8,3", "64,64,4,3"], help="BM,BN,WARPS,STAGES")
    p.add_argument("--modes", nargs="+", default=["fwd_jvp"], choices=["fwd", "fwd_jvp"])
    a = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for spec in a.shapes:
        b, h, n, d = map(int, spec.split(","))
        x = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
        out = [torch.empty_like(x[0]), torch.empty_like(x[0])]
        for mode in a.modes:
            jvp = mode == "fwd_jvp"
            flops = (12 if jvp else 4) * b * h * n * n * d
            for tile in a.tiles:
                t = tuple(map(int, tile.split(",")))
                line = f"B{b} H{h} N{n} D{d} {mode} tile {t}:"
                for name, fn in (("products only", products(x, out, jvp, *t)),
                                 ("flashjvp", flashjvp_tile(x, jvp, *t))):
                    try:
                        ms = triton.testing.do_bench(fn, return_mode="median")
                        line += f"  {name} {ms:.3f} ms {flops / ms * 1e-9:.0f} TFLOP/s;"
                    except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                        line += f"  {name} {type(e).__name__}: {str(e).splitlines()[0][:80]};"
                print(line, flush=True)


if __name__ == "__main__":
    main()
