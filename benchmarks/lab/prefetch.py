"""Persistent forward+JVP that prefetches the next row block's q/tq during this block's epilogue.

Question: at B1 H40 Nq32760 Nk512 D128 (the video cross-attention shape, benchmark shape 7) each
128-row program runs only eight 64-key blocks, and with one program per row block its q/tq loads
are not overlapped with any products: a fixed share of the tq-only time. A persistent grid
without prefetching measured slower than one program per block. Here a program walks row blocks
(stride: the grid size) and issues the NEXT block's q/tq loads (plain ``tl.load``: registers, so
the loads are in flight while this block's o/to are formed and stored) before its epilogue.

Variants of one kernel (non-causal, no key tail, pointer path, unit stride along D):
``PERSIST=0``: one program per row block (the production kernel's 3-D grid); ``PERSIST=1``: one
per SM, q/tq loaded at the top of each block; ``PERSIST=2``: one per SM, next q/tq prefetched.
The key loop is flashjvp's own ``_fwd_inner`` (imported, not copied). Every variant is checked
against flashjvp.attention_jvp, then all are timed with ``do_bench`` (two rounds).

GPU:  PYTHONPATH=src python benchmarks/lab/prefetch.py
CPU:  TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/lab/prefetch.py --check
      PYTHONPATH=src python benchmarks/lab/prefetch.py --compile  (sm_90a registers, spills)
"""
import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import flashjvp
from flashjvp._fwd import _fwd_inner, _lse
from flashjvp._jit import LOG2E


@triton.jit
def _load_q(Q, TQ, tile, n_tiles, n_mb, H_Q, N_Q, s_qb, s_qh, s_qn, s_tqb, s_tqh, s_tqn,
            BLOCK_M: tl.constexpr, D: tl.constexpr, HAS_TQ: tl.constexpr):
    """q and tq of row block ``tile`` ((batch, head, block) order); zeros past the last tile."""
    pid_m = tile % n_mb
    h = ((tile // n_mb) % H_Q).to(tl.int64)
    b = (tile // (n_mb * H_Q)).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_d = tl.arange(0, D)
    rmask = (rows < N_Q)[:, None] & (tile < n_tiles)  # (BLOCK_M, 1)
    q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_qn + offs_d[None, :], mask=rmask, other=0.0)
    tq = q
    if HAS_TQ:
        tq = tl.load(TQ + b * s_tqb + h * s_tqh + rows[:, None] * s_tqn + offs_d[None, :], mask=rmask, other=0.0)
    return q, tq  # (BLOCK_M, D) each


@triton.jit
def _prefetch_kernel(Q, K, V, TQ, TK, TV, O, TO, LSE,
                     s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                     s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn, s_tvb, s_tvh, s_tvn,
                     s_ob, s_oh, s_on, s_tob, s_toh, s_ton,
                     BATCH, H_Q, N_Q, N_K, scale_log2, scale,
                     D: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
                     DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PERSIST: tl.constexpr):
    n_mb = tl.cdiv(N_Q, BLOCK_M)
    n_tiles = n_mb * H_Q * BATCH
    if PERSIST == 0:  # no loop: the production kernel's 3-D grid (program ids, which ptxas
        # re-reads instead of keeping them in registers: 0 spills against 52 bytes when the block
        # came from a 1-D index by division)
        pid_m, h32, b32 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        tile = pid_m + n_mb * (h32 + H_Q * b32)
        q, tq = _load_q(Q, TQ, tile, n_tiles, n_mb, H_Q, N_Q, s_qb, s_qh, s_qn,
                        s_tqb, s_tqh, s_tqn, BLOCK_M, D, HAS_TQ)
        _tile(Q, K, V, TQ, TK, TV, O, TO, LSE, q, tq, pid_m, h32, b32, tile, n_tiles, n_mb, n_tiles,
              s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
              s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn, s_tvb, s_tvh, s_tvn,
              s_ob, s_oh, s_on, s_tob, s_toh, s_ton, H_Q, N_Q, N_K, scale_log2, scale,
              D, HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, BLOCK_M, BLOCK_N, False)
    else:
        step = tl.num_programs(0)
        q, tq = _load_q(Q, TQ, tl.program_id(0), n_tiles, n_mb, H_Q, N_Q, s_qb, s_qh, s_qn,
                        s_tqb, s_tqh, s_tqn, BLOCK_M, D, HAS_TQ)
        for tile in range(tl.program_id(0), n_tiles, step):
            if PERSIST == 1:
                q, tq = _load_q(Q, TQ, tile, n_tiles, n_mb, H_Q, N_Q, s_qb, s_qh, s_qn,
                                s_tqb, s_tqh, s_tqn, BLOCK_M, D, HAS_TQ)
            q, tq = _tile(Q, K, V, TQ, TK, TV, O, TO, LSE, q, tq, tile % n_mb, (tile // n_mb) % H_Q,
                          tile // (n_mb * H_Q), tile, n_tiles, n_mb, step,
                          s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
                          s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn, s_tvb, s_tvh, s_tvn,
                          s_ob, s_oh, s_on, s_tob, s_toh, s_ton, H_Q, N_Q, N_K, scale_log2, scale,
                          D, HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, BLOCK_M, BLOCK_N, PERSIST == 2)


@triton.jit
def _tile(Q, K, V, TQ, TK, TV, O, TO, LSE, q, tq, pid_m, h32, b32, tile, n_tiles, n_mb, step,
          s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
          s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn, s_tvb, s_tvh, s_tvn,
          s_ob, s_oh, s_on, s_tob, s_toh, s_ton, H_Q, N_Q, N_K, scale_log2, scale,
          D: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
          DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """Row block ``tile`` (= ``pid_m`` of head ``h32``, batch ``b32``); returns the next block's q/tq
    (PREFETCH: block ``tile + step``, loaded before the epilogue) or q/tq."""
    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D)  # (D,)
    mask_d = offs_d < D
    h = h32.to(tl.int64)
    b = b32.to(tl.int64)
    k_src = K + b * s_kb + h * s_kh + offs_d[:, None] + offs_n[None, :] * s_kn  # (D, BLOCK_N)
    tk_src = TK + b * s_tkb + h * s_tkh + offs_d[:, None] + offs_n[None, :] * s_tkn
    v_src = V + b * s_vb + h * s_vh + offs_n[:, None] * s_vn + offs_d[None, :]  # (BLOCK_N, D)
    tv_src = TV + b * s_tvb + h * s_tvh + offs_n[:, None] * s_tvn + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    r_i = tl.zeros([BLOCK_M], tl.float32)
    acc_o = tl.zeros([BLOCK_M, D], tl.float32)
    acc_t = tl.zeros([BLOCK_M, D], tl.float32)
    acc_o, acc_t, m_i, l_i, r_i = _fwd_inner(
        acc_o, acc_t, m_i, l_i, r_i, q, tq, k_src, v_src, tk_src, tv_src,
        s_kn, s_vn, s_tkn, s_tvn, rows, offs_n, mask_d, mask_d, 0, N_K, N_K,
        0, scale_log2, scale, b32, h32, BLOCK_N, False, False, True, True,
        HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, False)
    if PREFETCH:  # in flight while o and to are formed and stored
        q, tq = _load_q(Q, TQ, tile + step, n_tiles, n_mb, H_Q, N_Q, s_qb, s_qh, s_qn,
                        s_tqb, s_tqh, s_tqn, BLOCK_M, D, HAS_TQ)
    offs_m = pid_m * BLOCK_M + rows
    rmask = offs_m < N_Q
    inv_l = 1.0 / l_i  # every row sees every key here
    o = acc_o * inv_l[:, None]  # (BLOCK_M, D)
    tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_on + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rmask[:, None])
    inv_l_t = inv_l
    if not HAS_TV:
        inv_l_t = inv_l * scale
    mu = r_i * inv_l_t
    to = acc_t * inv_l_t[:, None] - mu[:, None] * o  # (BLOCK_M, D)
    tl.store(TO + b * s_tob + h * s_toh + offs_m[:, None] * s_ton + offs_d[None, :],
             to.to(TO.dtype.element_ty), mask=rmask[:, None])
    tl.store(LSE + (b * H_Q + h) * N_Q + offs_m, _lse(m_i, l_i), mask=rmask)
    return q, tq


def run(q, k, v, tq, tk, tv, tile, persist, sms):
    bm, bn, warps, stages = tile
    b, h, nq, d = q.shape
    nk = k.shape[2]
    assert nk % bn == 0 and d in (16, 32, 64, 128)
    o, to = torch.empty_like(q), torch.empty_like(q)
    lse = torch.empty(b, h, nq, device=q.device, dtype=torch.float32)
    n_tiles = triton.cdiv(nq, bm) * h * b
    grid = (min(n_tiles, sms),) if persist else (triton.cdiv(nq, bm), h, b)
    st = lambda x: (x.stride(0), x.stride(1), x.stride(2))  # noqa: E731
    scale = d ** -0.5
    _prefetch_kernel[grid](
        q, k, v, q if tq is None else tq, k if tk is None else tk, v if tv is None else tv, o, to, lse,
        *st(q), *st(k), *st(v), *st(q if tq is None else tq), *st(k if tk is None else tk),
        *st(v if tv is None else tv), *st(o), *st(to), b, h, nq, nk, scale * LOG2E, scale,
        D=d, HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", BLOCK_M=bm, BLOCK_N=bn, PERSIST=persist,
        num_warps=warps, num_stages=stages)
    return o, to, lse


def compile_only():
    """Compile every variant for sm_90a without a GPU (scripts/compile_report.py's launch hook)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import compile_report
    from triton.runtime.jit import JITFunction

    JITFunction.run = compile_report._compile_only
    x = [torch.zeros(1, 40, n, 128, dtype=torch.bfloat16) for n in (32760, 512, 512, 32760, 512, 512)]
    for n_tan in (4, 6):
        for persist in (0, 1, 2):
            compile_report.reports.append(f"--- tangents {'q' if n_tan == 4 else 'qkv'}, P{persist}, 128x64 w8 s2")
            run(*x[:n_tan], *[None] * (6 - n_tan), (128, 64, 8, 2), persist, 132)
    print("\n".join(compile_report.reports))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="small fp32 shapes only (CPU interpreter)")
    p.add_argument("--compile", action="store_true", help="compile for sm_90a only and report (no GPU)")
    args = p.parse_args()
    if args.compile:
        return compile_only()
    if args.check or os.environ.get("TRITON_INTERPRET") == "1":
        dev, dtype, shapes, tiles, sms = "cpu", torch.float32, [(2, 3, 37, 32, 32)], [(16, 16, 4, 1)], 4
    else:
        dev, dtype = "cuda", torch.bfloat16
        shapes = [(1, 40, 32760, 512, 128)]
        tiles = [(128, 64, 8, 3), (128, 64, 8, 2)]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for b, h, nq, nk, d in shapes:
        x = [torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for n in (nq, nk, nk, nq, nk, nk)]
        for n_tan, label in ((4, "tq only"), (6, "all tangents")):
            ins = x[:n_tan] + [None] * (6 - n_tan)
            cases = {"flashjvp": functools.partial(flashjvp.attention_jvp, *x[:n_tan])}
            cases.update({f"{t} P{p}": functools.partial(run, *ins, t, p, sms) for t in tiles for p in (0, 1, 2)
                          if n_tan == 4 or t[3] != 3})  # 128x64 s3 with tK, tV: no shared memory
            o_ref, to_ref = cases["flashjvp"]()
            for name, fn in cases.items():
                o, to = fn()[:2]
                err = max((o.float() - o_ref.float()).abs().max().item(),
                          (to.float() - to_ref.float()).abs().max().item())
                ok = err < (1e-4 if dtype == torch.float32 else 0.05)
                print(f"{label} {(b, h, nq, nk, d)} {name}: max|diff| vs flashjvp {err:.3g} {'ok' if ok else 'WRONG'}",
                      flush=True)
            for rnd in range(2 if dev == "cuda" else 0):
                times = {name: triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")
                         for name, fn in cases.items()}
                print(f"{label} round {rnd}: " + ", ".join(f"{k} {t:.4f}" for k, t in times.items()) + " ms",
                      flush=True)


if __name__ == "__main__":
    main()
