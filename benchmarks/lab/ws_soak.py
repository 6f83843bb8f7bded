"""Soak of a warp-specialized forward+JVP tile: does every call write every output row?

Many forward+JVP calls of one shape, each on fresh random inputs with every output (o, to, lse,
mu) NaN-filled first, through this script's kernel ``_ws_fwd_kernel`` with the key loop
warp-specialized (``WS=True``) and, as the control, the same tile without (``WS=False``). Each
call is compared with flashjvp.attention_jvp on the same inputs (the shipped kernel's pointer
path: no TMA code in common). A call fails when an output holds a NaN (rows never written,
counted in BLOCK_M-row blocks) or differs by more than 0.05 + 0.02 |ref| (bf16). Printed per
variant: the calls run, the failing calls and the first failures.

Why: the forward kernel once had this mode (TMA loads, 128x64 tile, 4 warps, 2 stages, one
masked ``tl.range(..., warp_specialize=True)`` loop over all key blocks). It was faster on an
H200, but Triton 3.6 left whole 128-row blocks of the outputs unwritten now and then: in 4 of
4889 calls in one run and 1 of 10836 in another at B2 H24 N4096 D128 (bf16, all tangents,
non-causal) on an H200; the same tile without specialization failed in none of 9666. The mode
was taken out of the shipped kernel; this script keeps the experiment so that a new Triton can
be tested for the fix. At a failure rate of about 1 in 3000 to 5000 calls a run of 2000 calls
per variant will often see none: a reproduction needs 10000 or more calls per variant.

The kernel is built from the shipped device helpers (``_load_kv``, ``_tangent_logits``, ``_q_tile``,
``_lse``): q and tq through descriptors built in the kernel, K, V, tK, tV through host-made 4-D
ones, one loop over all key blocks masking each (bounds and causality: Triton 3.6 fails to
compile a second loop after a warp-specialized one), and pointer stores addressed from the scalar
row-block start plus ``rows`` (Triton 3.6's partitioner shifted ``m0 + arange`` by 64 rows twice
in the second consumer partition; TMA stores from device-made descriptors also lost row blocks).

    PYTHONPATH=src python benchmarks/lab/ws_soak.py --calls 2000          # GPU (Hopper): the soak
        [--b 2 --h 24 --n 4096 --d 128 --causal --tile 128 64 4 2]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/lab/ws_soak.py --check   # CPU: correctness
    PYTHONPATH=src python benchmarks/lab/ws_soak.py --compile   # no GPU: sm_90a, setmaxnreg count

Under the interpreter ``warp_specialize`` is ignored: ``--check`` shows only that the kernel
computes attention and its JVP (small fp32 shapes against flashjvp.attention_jvp_ref in float64).
"""
import os

os.environ["FLASHJVP_TMA"] = "0"  # the reference: the shipped kernel's pointer path
os.environ["FLASHJVP_POISON"] = "1"  # its outputs NaN-filled first too

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp._fwd import _load_kv, _lse, _q_tile, _set_tma_boxes, _tangent_logits, _tma_descriptor  # noqa: E402
from flashjvp._jit import LOG2E, aligned3, key_range  # noqa: E402
from flashjvp._launch import dot_precision, ensure_tma_allocator, launch_device, vector_align  # noqa: E402
from flashjvp._validate import check_inputs  # noqa: E402


@triton.jit
def _ws_fwd_kernel(Q, K, V, TQ, TK, TV, O, TO, LSE, MU, s_qb, s_qh, s_qn, s_tqb, s_tqh, s_tqn,
                   s_ob, s_oh, s_on, s_tob, s_toh, s_ton, H_Q, GROUPS, N_Q, N_K, causal_off, scale_log2, scale,
                   D: tl.constexpr, CAUSAL: tl.constexpr, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr,
                   HAS_TV: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    """One program per (row block, query head, batch). K, V, TK, TV: host-made 4-D descriptors
    (boxes (1, 1, BLOCK_N, D)); Q, TQ, O, TO: (B, H, N, D) tensors, unit stride along D."""
    pid_m, h32, b32 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hkv32 = h32 // GROUPS  # descriptor coordinates are 32-bit, pointer offsets 64-bit
    b, h = b32.to(tl.int64), h32.to(tl.int64)
    s_qb, s_qh, s_qn = aligned3(s_qb, s_qh, s_qn, ALIGN)
    s_tqb, s_tqh, s_tqn = aligned3(s_tqb, s_tqh, s_tqn, ALIGN)
    s_ob, s_oh, s_on = aligned3(s_ob, s_oh, s_on, ALIGN)
    s_tob, s_toh, s_ton = aligned3(s_tob, s_toh, s_ton, ALIGN)
    m0 = pid_m * BLOCK_M  # first row of the block: a scalar, added to `rows` (never m0 + arange)
    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows within the block
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_d = tl.arange(0, D)  # (D,)
    mask_d = offs_d < D  # all true: D is the head dim (unused on the TMA path)
    q = _q_tile(Q + b * s_qb + h * s_qh, N_Q, D, s_qn, m0, BLOCK_M, D)  # (BLOCK_M, D)
    tq = q
    if HAS_TQ:
        tq = _q_tile(TQ + b * s_tqb + h * s_tqh, N_Q, D, s_tqn, m0, BLOCK_M, D)  # (BLOCK_M, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
    r_i = tl.zeros([BLOCK_M], tl.float32)  # running rowsum(E * tS)
    acc_o = tl.zeros([BLOCK_M, D], tl.float32)
    acc_t = tl.zeros([BLOCK_M, D], tl.float32)
    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
    diag = m0 + causal_off  # query row rows[i] sees key j iff j <= rows[i] + diag (CAUSAL)
    hi = key_range(m0, N_K, causal_off, BLOCK_M, BLOCK_N, CAUSAL)[1]
    # The only key loop, every block masked (a second loop after a warp-specialized one fails to
    # compile with Triton 3.6). The body is the shipped _fwd_inner's with MASKED and TMA set.
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS):
        keys = start_n + offs_n  # (BLOCK_N,)
        kvalid = keys < N_K  # (BLOCK_N,)
        k = _load_kv(K, start_n, 0, mask_d, kvalid, b32, hkv32, False, True, True, True)  # (D, BLOCK_N)
        s = tl.dot(q, k, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N), unscaled logits
        if HAS_TS:  # issued right after S (the shipped kernel's order for D >= 32)
            ts = _tangent_logits(q, tq, k, TK, start_n, 0, mask_d, kvalid, s, b32, hkv32,
                                 True, True, HAS_TQ, HAS_TK, DOT_PREC, True)  # (BLOCK_M, BLOCK_N)
        visible = kvalid[None, :]  # (1, BLOCK_N)
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + diag)  # (BLOCK_M, BLOCK_N)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # (BLOCK_M,)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_use)  # (BLOCK_M,)
        e = tl.math.exp2(s * scale_log2 - m_use[:, None])  # (BLOCK_M, BLOCK_N), unnormalised P
        l_i = l_i * alpha + tl.sum(e, 1)
        v = _load_kv(V, start_n, 0, kvalid, mask_d, b32, hkv32, True, False, True, False)  # (BLOCK_N, D)
        acc_o = tl.dot(e.to(v.dtype), v, acc_o * alpha[:, None], input_precision=DOT_PREC)
        if HAS_TS or HAS_TV:
            acc_t = acc_t * alpha[:, None]
        if HAS_TS:
            if HAS_TV:
                hs = e * (ts * scale)  # (BLOCK_M, BLOCK_N): E * tS
            else:  # acc_t and r hold E * tS / scale: scaled in the epilogue
                hs = e * ts
            r_i = r_i * alpha + tl.sum(hs, 1)
            acc_t = tl.dot(hs.to(v.dtype), v, acc_t, input_precision=DOT_PREC)
        if HAS_TV:
            tv = _load_kv(TV, start_n, 0, kvalid, mask_d, b32, hkv32, True, False, True, False)  # (BLOCK_N, D)
            acc_t = tl.dot(e.to(tv.dtype), tv, acc_t, input_precision=DOT_PREC)
        m_i = m_new
    # Epilogue: pointer stores at m0 (scalar) + rows; rows that saw no key: o = to = mu = 0, lse = -inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)  # (BLOCK_M,)
    inv_l_t = inv_l
    if not HAS_TV:
        inv_l_t = inv_l * scale
    rmask = rows < N_Q - m0  # (BLOCK_M,)
    o = acc_o * inv_l[:, None]  # (BLOCK_M, D)
    tl.store(O + b * s_ob + h * s_oh + m0 * s_on + rows[:, None] * s_on + offs_d[None, :],
             o.to(O.dtype.element_ty), mask=rmask[:, None])
    mu = r_i * inv_l_t  # (BLOCK_M,)
    to = acc_t * inv_l_t[:, None] - mu[:, None] * o  # (BLOCK_M, D)
    tl.store(TO + b * s_tob + h * s_toh + m0 * s_ton + rows[:, None] * s_ton + offs_d[None, :],
             to.to(TO.dtype.element_ty), mask=rmask[:, None])
    row0 = (b * H_Q + h) * N_Q + m0  # flat index of row m0 in (B, H, N_Q)
    tl.store(LSE + row0 + rows, _lse(m_i, l_i), mask=rmask)
    tl.store(MU + row0 + rows, mu, mask=rmask)


def ws_attention_jvp(q, k, v, tq, tk, tv, *, causal=False, tile=(128, 64, 4, 2), ws=True):
    """``(o, to, lse, mu)`` from ``_ws_fwd_kernel``, all NaN-filled before the launch. (B, H, N, D)
    contiguous inputs, D a power of two >= 16 (q's dims for K and V too); None tangents are zero."""
    a = check_inputs(q, k, v, tq, tk, tv, causal=causal)
    d = a.d_qk
    assert a.d_v == d and d >= 16 and d & (d - 1) == 0, "head dims: one power of two >= 16"
    bm, bn, warps, stages = tile
    o, to = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    lse, mu = (torch.full((a.batch, a.h_q, a.n_q), float("nan"), device=q.device) for _ in range(2))
    kd, vd = _tma_descriptor(k, "bhnd"), _tma_descriptor(v, "bhnd")
    args = [q, kd, vd, q if tq is None else tq, kd if tk is None else _tma_descriptor(tk, "bhnd"),
            vd if tv is None else _tma_descriptor(tv, "bhnd")]
    _set_tma_boxes(*args, BLOCK_N=bn, BLOCK_DQK=d, BLOCK_DV=d)
    ensure_tma_allocator()  # q and tq descriptors are built on the device
    st = [x.stride()[:3] for x in (q, args[3], o, to)]
    with launch_device(q):
        _ws_fwd_kernel[(triton.cdiv(a.n_q, bm), a.h_q, a.batch)](
            *args, o, to, lse, mu, *[s for x in st for s in x], a.h_q, a.groups, a.n_q, a.n_k,
            a.causal_offset, a.scale * LOG2E, a.scale, D=d, CAUSAL=a.causal is not None,
            HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
            DOT_PREC=dot_precision(q.dtype), ALIGN=vector_align(st, d),
            BLOCK_M=bm, BLOCK_N=bn, WS=ws, num_warps=warps, num_stages=stages)
    return o, to, lse, mu


def inputs(b, hq, hkv, nq, nk, d, dtype, device, seed):
    """q, k, v, tq, tk, tv, standard normal, (B, H, N, D)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, h, n, d, dtype=dtype, device=device, generator=g)
            for h, n in ((hq, nq), (hkv, nk), (hkv, nk), (hq, nq), (hkv, nk), (hkv, nk))]


def failures(out, ref, block_m, atol=0.05, rtol=0.02):
    """'' if ``out`` matches ``ref``, else what is wrong: NaN row blocks and mismatching elements."""
    nan_rows = torch.zeros(out[2].shape, dtype=torch.bool, device=out[2].device)  # (B, H, N)
    wrong = 0
    for t, r in zip(out, ref):
        t, r = t.double(), r.double()
        nan = torch.isnan(t)
        nan_rows |= nan.any(-1) if nan.dim() == 4 else nan
        diff = torch.where(t == r, 0.0, (t - r).abs())  # -inf == -inf: no difference
        wrong += int((diff > atol + rtol * r.abs()).sum())  # NaN compares False: counted above
    nan = int(nan_rows.sum())
    padded = torch.nn.functional.pad(nan_rows.to(torch.int8), (0, -nan_rows.shape[-1] % block_m))
    blocks = int(padded.unflatten(-1, (-1, block_m)).amax(-1).sum())  # row blocks with a NaN row
    return f"NaN rows {nan} in {blocks} row blocks, {wrong} wrong" if nan or wrong else ""


def check():
    """Interpreter: small fp32 shapes (tl.dot of bf16 is wrong there) against the float64 reference."""
    tile = (16, 16, 4, 1)
    for b, hq, hkv, nq, nk, d, causal in [(1, 2, 2, 37, 37, 64, False), (1, 2, 2, 130, 130, 64, True),
                                           (1, 2, 1, 37, 130, 64, "bottom_right"), (2, 2, 2, 130, 37, 32, True)]:
        x = inputs(b, hq, hkv, nq, nk, d, torch.float32, "cpu", seed=nq + nk)
        for n_tan in (6, 4):  # all tangents; tq only
            tans = x[3:n_tan] + [None] * (6 - n_tan)
            ref = flashjvp.attention_jvp_ref(*[t if t is None else t.double() for t in x[:3] + tans],
                                             causal=causal, return_lse=True)
            for ws in (True, False):
                out = ws_attention_jvp(*x[:3], *tans, causal=causal, tile=tile, ws=ws)
                err = max(float(torch.where(t == r, 0.0, (t.double() - r).abs()).max()) for t, r in zip(out, ref))
                bad = failures(out, ref, tile[0], atol=1e-4, rtol=1e-4)
                print(f"B{b} H{hq}/{hkv} N{nq}x{nk} D{d} causal={causal} tangents={n_tan - 3} WS={ws}: "
                      f"max|diff| {err:.2e} {bad or 'ok'}", flush=True)
                assert not bad and err < 1e-4, bad
    print("check passed")


def compile_only(tile):
    """Compile both variants for sm_90a without a GPU (scripts/compile_report.py's launch hook)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import compile_report
    from triton.runtime.jit import JITFunction

    JITFunction.run = compile_report._compile_only
    x = [torch.zeros(2, 24, 4096, 128, dtype=torch.bfloat16) for _ in range(6)]
    for ws in (True, False):
        compile_report.reports.append(f"--- WS={ws}, tile {tile}")
        ws_attention_jvp(*x, tile=tile, ws=ws)
    print("\n".join(compile_report.reports))


def soak(cli):
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    b, h, n, d = cli.b, cli.h, cli.n, cli.d
    bad = {True: [], False: []}
    ref_bad = []  # calls whose reference held a NaN
    for i in range(cli.calls):
        x = inputs(b, h, h, n, n, d, torch.bfloat16, "cuda", seed=i)
        ref = flashjvp.attention_jvp(*x, causal=cli.causal, return_lse=True)
        if torch.isnan(ref[0]).any() or torch.isnan(ref[1]).any():
            ref_bad.append(i)
        for ws in (True, False):
            why = failures(ws_attention_jvp(*x, causal=cli.causal, tile=tuple(cli.tile), ws=ws), ref, cli.tile[0])
            if why:
                bad[ws].append(f"call {i}: {why}")
                print(f"  WS={ws} {bad[ws][-1]}", flush=True)
        if (i + 1) % 500 == 0:
            print(f"  {i + 1} calls: WS failed {len(bad[True])}, control {len(bad[False])}", flush=True)
    for ws in (True, False):
        print(f"B{b} H{h} N{n} D{d} bf16 causal={cli.causal} tile {tuple(cli.tile)} WS={ws}: "
              f"{cli.calls} calls, {len(bad[ws])} failed" + ("; " if bad[ws] else "") + "; ".join(bad[ws][:8]))
    print(f"reference (flashjvp, pointer path): NaN in {len(ref_bad)} calls {ref_bad[:8]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant (a reproduction: 10000+)")
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--h", type=int, default=24)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tile", type=int, nargs=4, default=[128, 64, 4, 2], metavar=("BM", "BN", "WARPS", "STAGES"))
    ap.add_argument("--check", action="store_true", help="CPU interpreter: correctness on small shapes")
    ap.add_argument("--compile", action="store_true", help="compile for sm_90a only and report (no GPU)")
    cli = ap.parse_args()
    if cli.check:
        check()
    elif cli.compile:
        compile_only(tuple(cli.tile))
    else:
        soak(cli)


if __name__ == "__main__":
    main()
