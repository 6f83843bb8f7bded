"""Attention backward (FlashAttention-2) in Triton: dq, dk, dv from the saved log-sum-exp.

Two launches, no atomics, deterministic: ``_attn_bwd_dq_kernel`` (one program per query
block; computes delta = rowsum(dO * O) for its rows, stores it, and dQ) then
``_attn_bwd_dkdv_kernel`` (one program per key block and kv head, reading those deltas; sums
the query heads of a GQA group in a fixed order). P is recomputed from q, k and lse; no N x N
buffer exists. (A separate delta kernel, as in FlashAttention-2, would cost a third launch: the
backward of small shapes is bound by the host's launches, not by the GPU.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashjvp._jit import (
    LOG2E,
    LOG2E_K,
    aligned,
    aligned3,
    diagonals,
    key_blocks,
    load_tile,
    mask_bias,
    query_blocks,
    sequence,
    sparse_bits,
    sparse_list,
    sparse_start,
    visible,
)
from flashjvp._launch import (
    PLANS,
    aligned16,
    allow_tf32,
    aux_tensors,
    buffer_like,
    dot_precision,
    launch_device,
    mask_args,
    mask_strides,
    plan_tuned,
    seq_strides,
    stat_strides,
    vector_align,
)
from flashjvp._policy import BWD_TILES, head_blocks, length_bucket, prune_bwd_configs, tile_configs
from flashjvp._validate import AttnArgs

_BWD_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "BLOCK_DQK", "BLOCK_DV", "RIGHT", "LEFT", "VARLEN", "HAS_MASK", "DOT_PREC",
            "SPARSE", "SP_BM", "SP_BN", "SP_RUNS"]
_EVEN_D = {
    "EVEN_DQK": lambda a: a["D_QK"] == a["BLOCK_DQK"],
    "EVEN_DV": lambda a: a["D_V"] == a["BLOCK_DV"],
}


@triton.jit
def _lse_log2(LSE, idx, mask):
    """The saved lse of rows ``idx`` in log2 units; +inf for rows that saw no key (and masked
    rows), so that exp2(s - lse2) = P = 0 there."""
    lse = tl.load(LSE + idx, mask=mask, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_K)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, s_qn, s_don,
    keys, kvalid, mask_dqk, mask_dv, lo, hi, n_q, off_r, off_l, scale_log2, mask_src, n_k, s_mm, s_mn,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    lst, bits, maxb, SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr, KEY_MASK: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi); MASKED applies the diagonal
    bounds (``_jit.visible``, transposed), KEY_MASK the padding keys (``kvalid`` False). SPARSE:
    [lo, hi) are virtual positions over the block list ``lst`` (as in the forward's key loop)."""
    offs_mb = tl.arange(0, BLOCK_M)
    for pos in range(lo, hi, BLOCK_M):
        start_m = pos
        j = pos
        if SPARSE:
            start_m, j = sparse_start(lst, pos, SP_BM)
        rows = start_m + offs_mb  # (BLOCK_M,)
        rvalid = rows < n_q
        q = load_tile(q_ptrs + start_m * s_qn, rvalid, mask_dqk, True, not EVEN_DQK)  # (BLOCK_M, BLOCK_DQK)
        lse2 = _lse_log2(lse_ptr, rows, rvalid)  # (BLOCK_M,)
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * scale_log2  # (BLOCK_N, BLOCK_M): S^T
        if MASKED and HAS_MASK:
            bias = mask_bias(mask_src, rows, keys, n_q, n_k, s_mm, s_mn, MASK_BOOL, MASK_ROWS)  # (BLOCK_M, BLOCK_N)
            st += tl.trans(bias) * LOG2E_K
        pt = tl.math.exp2(st - lse2[None, :])  # (BLOCK_N, BLOCK_M): P^T
        if MASKED:
            vis = keys[:, None] >= 0  # (BLOCK_N, 1)
            if RIGHT:
                vis = vis & (keys[:, None] <= rows[None, :] + off_r)
            if LEFT:
                vis = vis & (keys[:, None] >= rows[None, :] + off_l)
            if SPARSE:
                vis = vis & sparse_bits(bits, lst, j, rows, keys, maxb, SP_BM, SP_BN, True)  # (BLOCK_N, BLOCK_M)
            pt = tl.where(vis, pt, 0.0)
        if KEY_MASK:
            pt = tl.where(kvalid[:, None], pt, 0.0)
        do = load_tile(do_ptrs + start_m * s_don, rvalid, mask_dv, True, not EVEN_DV)  # (BLOCK_M, BLOCK_DV)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=DOT_PREC)
        delta = tl.load(delta_ptr + rows, mask=rvalid, other=0.0)  # (BLOCK_M,)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M): dP^T
        dst = pt * (dpt - delta[None, :])  # (BLOCK_N, BLOCK_M): dS^T
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.autotune(configs=tile_configs(BWD_TILES), key=_BWD_KEY,
                 prune_configs_by={"early_config_prune": prune_bwd_configs})
@triton.heuristics(_EVEN_D)
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KV_LENS, CU_Q, CU_K, MASK, SP_ROW, SP_COL, SP_BITS,
    s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_dob, s_doh, s_don, s_dod, s_dkb, s_dkh, s_dkn, s_dkd, s_dvb, s_dvh, s_dvn, s_dvd, s_lb, s_lh,
    s_mb, s_mh, s_mm, s_mn, s_rb, s_rh, s_rn, s_cb, s_ch, s_cn,
    H_Q, GROUPS, N_Q, N_K, bottom_right, win_r, win_l, scale_log2, scale, N_Q_BUCKET, N_K_BUCKET,
    D_QK, D_V, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    RIGHT: tl.constexpr, LEFT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_KV_LENS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr, SP_RUNS: tl.constexpr,
):
    FULL_LIST: tl.constexpr = SPARSE and not SP_RUNS  # SP_RUNS: consecutive full blocks, no list read
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    # Multiples of ALIGN (vector_align): 16-byte loads and stores also for D = 40, 72, ...
    s_qb, s_qh, s_qn = aligned3(s_qb, s_qh, s_qn, ALIGN)
    s_kb, s_kh, s_kn = aligned3(s_kb, s_kh, s_kn, ALIGN)
    s_vb, s_vh, s_vn = aligned3(s_vb, s_vh, s_vn, ALIGN)
    s_dob, s_doh, s_don = aligned3(s_dob, s_doh, s_don, ALIGN)
    s_dkb, s_dkh, s_dkn = aligned3(s_dkb, s_dkh, s_dkn, ALIGN)
    s_dvb, s_dvh, s_dvn = aligned3(s_dvb, s_dvh, s_dvn, ALIGN)
    D_QK, D_V = aligned(D_QK, ALIGN), aligned(D_V, ALIGN)
    n0 = pid_n * BLOCK_N
    # this batch element's rows and keys (packed sequences: from the offsets; past n_kv: padding,
    # whose gradients are zero)
    q0, n_q, k0, n_k, n_kv = sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN, HAS_KV_LENS)
    if VARLEN:
        if n0 >= n_k:  # the grid covers the longest sequence
            return
        Q += q0 * s_qn
        DO += q0 * s_don
        K += k0 * s_kn
        V += k0 * s_vn
        DK += k0 * s_dkn
        DV += k0 * s_dvn
    off_r, off_l = diagonals(n_q, n_k, bottom_right, win_r, win_l)
    keys = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    kin = keys < n_k  # (BLOCK_N,) keys of this batch element: all get a gradient
    kvalid = keys < n_kv
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dqk = offs_dqk < D_QK
    mask_dv = offs_dv < D_V
    k = load_tile(K + b * s_kb + h_kv * s_kh + keys[:, None] * s_kn + offs_dqk[None, :] * s_kd,
                  kvalid, mask_dqk, True, not EVEN_DQK)  # (BLOCK_N, BLOCK_DQK)
    v = load_tile(V + b * s_vb + h_kv * s_vh + keys[:, None] * s_vn + offs_dv[None, :] * s_vd,
                  kvalid, mask_dv, True, not EVEN_DV)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    if not SPARSE:  # (a block mask's ranges depend on the query head: set in the loop below)
        # Query blocks [lo, hi) see some key of this block; [full_lo, full_hi) see all of them.
        lo, full_lo, full_hi, hi = query_blocks(n0, n_q, off_r, off_l, BLOCK_M, BLOCK_N, RIGHT, LEFT)
        if HAS_KV_LENS:  # a block of padding only: no query block to visit
            hi = tl.where(n0 < n_kv, hi, 0)
            lo, full_lo, full_hi = tl.minimum(lo, hi), tl.minimum(full_lo, hi), tl.minimum(full_hi, hi)
        if HAS_MASK:  # every block reads its tile of the mask
            full_hi = full_lo
    for g in range(GROUPS):  # query heads of this kv head, summed in a fixed order
        h = h_kv * GROUPS + g
        q_ptrs = Q + b * s_qb + h * s_qh + tl.arange(0, BLOCK_M)[:, None] * s_qn + offs_dqk[None, :] * s_qd
        do_ptrs = DO + b * s_dob + h * s_doh + tl.arange(0, BLOCK_M)[:, None] * s_don + offs_dv[None, :] * s_dod
        row_base = b * s_lb + h * s_lh + q0
        mask_src = MASK + b * s_mb + h * s_mh
        lst = SP_COL  # the block list (SPARSE)
        maxb = s_cn
        run0 = 0  # the unmasked loop's offset (SP_RUNS)
        if SPARSE:  # this key block's column of the block mask: full query blocks, then partial ones
            lst, n_full, n_part, maxb = sparse_list(SP_COL, b, h, n0 // SP_BN, s_cb, s_ch, s_cn)
            lo = 0  # virtual positions over the list: [0, full_hi) its full blocks, [full_hi, hi) its partial ones
            full_lo = 0
            full_hi = n_full * SP_BM
            hi = (n_full + n_part) * SP_BM
            if SP_RUNS:  # the unmasked loop over queries from the first full block on
                run0 = tl.load(lst + 2) * SP_BM
        if RIGHT:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_base, DELTA + row_base, s_qn, s_don,
                                 keys, kvalid, mask_dqk, mask_dv, lo, full_lo, n_q, off_r, off_l, scale_log2,
                                 mask_src, n_k, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
                                 lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN,
                                 BLOCK_M, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC, HAS_KV_LENS)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_base, DELTA + row_base, s_qn, s_don,
                             keys, kvalid, mask_dqk, mask_dv, full_lo + run0, full_hi + run0, n_q, off_r, off_l,
                             scale_log2, mask_src, n_k, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
                             lst, SP_BITS, maxb, FULL_LIST, SP_BM, SP_BN,
                             BLOCK_M, False, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC, HAS_KV_LENS)
        if LEFT or HAS_MASK or SPARSE:
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, LSE + row_base, DELTA + row_base, s_qn, s_don,
                                 keys, kvalid, mask_dqk, mask_dv, full_hi, hi, n_q, off_r, off_l, scale_log2,
                                 mask_src, n_k, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
                                 lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN,
                                 BLOCK_M, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC, HAS_KV_LENS)
    dk = dk * scale
    tl.store(DK + b * s_dkb + h_kv * s_dkh + keys[:, None] * s_dkn + offs_dqk[None, :] * s_dkd,
             dk.to(DK.dtype.element_ty), mask=kin[:, None] & mask_dqk[None, :])
    tl.store(DV + b * s_dvb + h_kv * s_dvh + keys[:, None] * s_dvn + offs_dv[None, :] * s_dvd,
             dv.to(DV.dtype.element_ty), mask=kin[:, None] & mask_dv[None, :])


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, s_kn, s_vn, rows, offs_n, mask_dqk, mask_dv,
    lo, hi, n_kv, off_r, off_l, scale_log2, mask_src, n_q, s_mm, s_mn,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    lst, bits, maxb, SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Accumulate dQ (unscaled) of one query block over key blocks [lo, hi) (SPARSE: virtual
    positions over the block list ``lst``)."""
    for pos in range(lo, hi, BLOCK_N):
        start_n = pos
        j = pos
        if SPARSE:
            start_n, j = sparse_start(lst, pos, SP_BN)
        keys = start_n + offs_n  # (BLOCK_N,)
        kvalid = keys < n_kv
        k = load_tile(k_ptrs + start_n * s_kn, kvalid, mask_dqk, MASKED, not EVEN_DQK)  # (BLOCK_N, BLOCK_DQK)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # (BLOCK_M, BLOCK_N)
        if MASKED and HAS_MASK:
            s += mask_bias(mask_src, rows, keys, n_q, n_kv, s_mm, s_mn, MASK_BOOL, MASK_ROWS) * LOG2E_K
        p = tl.math.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            vis = visible(rows, keys, n_kv, off_r, off_l, RIGHT, LEFT)  # (BLOCK_M, BLOCK_N)
            if SPARSE:
                vis = vis & sparse_bits(bits, lst, j, rows, keys, maxb, SP_BM, SP_BN, False)
            p = tl.where(vis, p, 0.0)
        vt = load_tile(v_ptrs + start_n * s_vn, mask_dv, kvalid, not EVEN_DV, MASKED)  # (BLOCK_DV, BLOCK_N): V^T
        dp = tl.dot(do, vt, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])  # (BLOCK_M, BLOCK_N)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.autotune(configs=tile_configs(BWD_TILES), key=_BWD_KEY,
                 prune_configs_by={"early_config_prune": prune_bwd_configs})
@triton.heuristics(_EVEN_D)
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, KV_LENS, CU_Q, CU_K, MASK, SP_ROW, SP_COL, SP_BITS,
    s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_ob, s_oh, s_on, s_od, s_dob, s_doh, s_don, s_dod, s_dqb, s_dqh, s_dqn, s_dqd, s_lb, s_lh,
    s_mb, s_mh, s_mm, s_mn, s_rb, s_rh, s_rn, s_cb, s_ch, s_cn,
    H_Q, GROUPS, N_Q, N_K, bottom_right, win_r, win_l, scale_log2, scale, N_Q_BUCKET, N_K_BUCKET,
    D_QK, D_V, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    RIGHT: tl.constexpr, LEFT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_KV_LENS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr, SP_RUNS: tl.constexpr,
):
    FULL_LIST: tl.constexpr = SPARSE and not SP_RUNS  # SP_RUNS: consecutive full blocks, no list read
    pid_m = tl.program_id(0)
    if SPARSE:  # last row blocks first: with causal-like masks they carry the most key blocks
        pid_m = tl.cdiv(N_Q, BLOCK_M) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h_kv = (h // GROUPS).to(tl.int64)
    h = h.to(tl.int64)
    s_qb, s_qh, s_qn = aligned3(s_qb, s_qh, s_qn, ALIGN)
    s_kb, s_kh, s_kn = aligned3(s_kb, s_kh, s_kn, ALIGN)
    s_vb, s_vh, s_vn = aligned3(s_vb, s_vh, s_vn, ALIGN)
    s_ob, s_oh, s_on = aligned3(s_ob, s_oh, s_on, ALIGN)
    s_dob, s_doh, s_don = aligned3(s_dob, s_doh, s_don, ALIGN)
    s_dqb, s_dqh, s_dqn = aligned3(s_dqb, s_dqh, s_dqn, ALIGN)
    D_QK, D_V = aligned(D_QK, ALIGN), aligned(D_V, ALIGN)
    m0 = pid_m * BLOCK_M
    q0, n_q, k0, n_k, n_kv = sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN, HAS_KV_LENS)
    if VARLEN:
        if m0 >= n_q:  # the grid covers the longest sequence
            return
        Q += q0 * s_qn
        DO += q0 * s_don
        O += q0 * s_on
        DQ += q0 * s_dqn
        K += k0 * s_kn
        V += k0 * s_vn
    off_r, off_l = diagonals(n_q, n_k, bottom_right, win_r, win_l)
    rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rvalid = rows < n_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dqk = offs_dqk < D_QK
    mask_dv = offs_dv < D_V
    q = load_tile(Q + b * s_qb + h * s_qh + rows[:, None] * s_qn + offs_dqk[None, :] * s_qd,
                  rvalid, mask_dqk, True, not EVEN_DQK)  # (BLOCK_M, BLOCK_DQK)
    do = load_tile(DO + b * s_dob + h * s_doh + rows[:, None] * s_don + offs_dv[None, :] * s_dod,
                   rvalid, mask_dv, True, not EVEN_DV)  # (BLOCK_M, BLOCK_DV)
    o = load_tile(O + b * s_ob + h * s_oh + rows[:, None] * s_on + offs_dv[None, :] * s_od,
                  rvalid, mask_dv, True, not EVEN_DV)  # (BLOCK_M, BLOCK_DV)
    idx = b * s_lb + h * s_lh + q0 + rows
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BLOCK_M,) rowsum(dO * O)
    tl.store(DELTA + idx, delta, mask=rvalid)  # read by the dK/dV kernel launched next
    lse2 = _lse_log2(LSE, idx, rvalid)  # (BLOCK_M,)
    k_ptrs = K + b * s_kb + h_kv * s_kh + offs_n[:, None] * s_kn + offs_dqk[None, :] * s_kd
    v_ptrs = V + b * s_vb + h_kv * s_vh + offs_dv[:, None] * s_vd + offs_n[None, :] * s_vn
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)

    mask_src = MASK + b * s_mb + h * s_mh
    lst = SP_ROW  # the block list (SPARSE)
    maxb = s_rn
    run0 = 0  # the unmasked loop's offset (SP_RUNS)
    if SPARSE:  # this row block's list of the block mask: full key blocks, then partial ones
        lst, n_full, n_part, maxb = sparse_list(SP_ROW, b, h, m0 // SP_BM, s_rb, s_rh, s_rn)
        lo = 0  # virtual positions over the list: [0, full_hi) its full blocks, [full_hi, hi) its partial ones
        full_lo = 0
        full_hi = n_full * SP_BN
        hi = (n_full + n_part) * SP_BN
        if SP_RUNS:  # the unmasked loop over keys from the first full block on
            run0 = tl.load(lst + 2) * SP_BN
    else:
        lo, full_lo, full_hi, hi = key_blocks(m0, n_kv, off_r, off_l, BLOCK_M, BLOCK_N, RIGHT, LEFT)
        if HAS_MASK:  # every block reads its tile of the mask
            full_hi = full_lo
    if LEFT:
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, s_kn, s_vn, rows, offs_n, mask_dqk, mask_dv,
                       lo, full_lo, n_kv, off_r, off_l, scale_log2, mask_src, n_q, s_mm, s_mn,
                       HAS_MASK, MASK_BOOL, MASK_ROWS, lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN,
                       BLOCK_N, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, s_kn, s_vn, rows, offs_n, mask_dqk, mask_dv,
                   full_lo + run0, full_hi + run0, n_kv, off_r, off_l, scale_log2, mask_src, n_q, s_mm, s_mn,
                   HAS_MASK, MASK_BOOL, MASK_ROWS, lst, SP_BITS, maxb, FULL_LIST, SP_BM, SP_BN,
                   BLOCK_N, False, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC)
    dq = _dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, s_kn, s_vn, rows, offs_n, mask_dqk, mask_dv,
                   full_hi, hi, n_kv, off_r, off_l, scale_log2, mask_src, n_q, s_mm, s_mn,
                   HAS_MASK, MASK_BOOL, MASK_ROWS, lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN,
                   BLOCK_N, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV, DOT_PREC)
    dq = dq * scale
    tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqn + offs_dqk[None, :] * s_dqd,
             dq.to(DQ.dtype.element_ty), mask=rvalid[:, None] & mask_dqk[None, :])


def attn_bwd(do, q, k, v, o, lse, a: AttnArgs):
    """Gradients ``(dq, dk, dv)`` of ``o = attention(q, k, v)`` given ``do``, from the saved
    ``lse`` (B, Hq, Nq) float32, on flashjvp's Triton kernels (``_backends.run_bwd`` picks the
    backend). Gradients have their input's shape and layout."""
    dq, dk, dv = buffer_like(q), buffer_like(k), buffer_like(v)
    delta = buffer_like(lse)
    key = None
    if a.kv_lens is None and a.mask is None and a.varlen is None and a.sparse is None and q.is_cuda \
            and aligned16(do, q, k, v, o, lse):
        key = ("bwd", a, q.dtype, q.device.index, q.stride(), k.stride(), v.stride(), o.stride(), do.stride(),
               lse.stride(), allow_tf32())
        plans = PLANS.get(key)
        if plans is not None:  # the same launches as before: no argument to recompute
            seqs = aux_tensors(a, lse)
            with launch_device(q):
                plans[0](q, k, v, o, do, lse, delta, dq, *seqs)
                plans[1](q, k, v, do, lse, delta, dk, dv, *seqs)
            return dq, dk, dv
    bdqk, bdv = head_blocks(a.d_qk, a.d_v)
    sq, sk, sv, so, sdo, sdq, sdk, sdv = (seq_strides(x, a) for x in (q, k, v, o, do, dq, dk, dv))
    align = vector_align((sq, sk, sv, so, sdo, sdq, sdk, sdv), a.d_qk, a.d_v)
    masks, mask_flags = mask_args(a)
    common = dict(N_Q_BUCKET=length_bucket(a.n_q), N_K_BUCKET=length_bucket(a.n_k), D_QK=a.d_qk,
                  D_V=a.d_v, BLOCK_DQK=bdqk, BLOCK_DV=bdv, **mask_flags,
                  DOT_PREC=dot_precision(q.dtype), ALIGN=align, HAS_KV_LENS=a.kv_lens is not None,
                  SP_RUNS=a.sparse is not None and a.sparse.runs)
    seqs = aux_tensors(a, lse)
    sizes = (*stat_strides(a), *mask_strides(a), a.h_q, a.groups, a.n_q, a.n_k, *masks, a.scale * LOG2E, a.scale)
    grid_q = lambda m: (triton.cdiv(a.n_q, m["BLOCK_M"]), a.h_q, a.batch)  # noqa: E731
    grid_kv = lambda m: (triton.cdiv(a.n_k, m["BLOCK_N"]), a.h_kv, a.batch)  # noqa: E731
    with launch_device(q):
        _, plan_q = plan_tuned(_attn_bwd_dq_kernel, grid_q, 15, q, k, v, o, do, lse, delta, dq, *seqs,
                               *sq, *sk, *sv, *so, *sdo, *sdq, *sizes, **common)
        _, plan_kv = plan_tuned(_attn_bwd_dkdv_kernel, grid_kv, 15, q, k, v, do, lse, delta, dk, dv, *seqs,
                                *sq, *sk, *sv, *sdo, *sdk, *sdv, *sizes, **common)
    if key is not None and plan_q is not None and plan_kv is not None:
        PLANS.put(key, (plan_q, plan_kv))
    return dq, dk, dv
