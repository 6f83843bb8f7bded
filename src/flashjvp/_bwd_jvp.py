"""Backward of the fused forward+JVP (second order): gradients of ``(o, to, lse, mu)`` with respect
to q, k, v and their tangents tq, tk, tv, in Triton, with P and its tangent recomputed tile by tile
(no N x N buffer). docs/math.md ("Gradients through the tangent") derives the formulas; per row i
and key j, with ts the tangent logits (scaled), c = dto . o and g = dmu - c:

    dP_ij  = do_i . v_j + dto_i . tv_j + (ts_ij - mu_i) (dto_i . v_j) + g_i ts_ij
    delta_i = do_i . o_i + dto_i . to_i + g_i mu_i
    dS = P * (dP - delta + dlse)        dTS = P * (dto . v^T + g)
    dQ = scale (dS K + dTS tK)          dK = scale (dS^T Q + dTS^T tQ)     dV = P^T dO + tP^T dtO
    dtQ = scale dTS K                   dtK = scale dTS^T Q                dtV = P^T dtO
    where tP = P * (ts - mu)

Two launches as in the first-order backward (``_bwd.py``): per query block dQ and dtQ (it also
stores delta and g for its rows), then per key block and kv head dK, dV, dtK, dtV, summing the
query heads of a GQA group in a fixed order. Missing tangents and missing cotangents are
compile-time flags, so their products are skipped. The inputs are read in place through their
(batch, head, sequence) strides, whatever the layout (a copy only of a tensor whose head dim is not
unit-stride); the gradients are written to (B, H, N, D) contiguous buffers, returned in the call's
layout as views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashjvp._bwd import _lse_log2
from flashjvp._jit import (
    LOG2E,
    LOG2E_K,
    diagonals,
    key_blocks,
    mask_bias,
    query_blocks,
    sequence,
    sparse_bits,
    sparse_list,
    sparse_start,
    visible,
)
from flashjvp._launch import (
    aux_tensors,
    dot_precision,
    launch_device,
    launch_tuned,
    mask_args,
    mask_strides,
    new_buffer,
)
from flashjvp._policy import BWD_JVP_TILES, head_blocks, length_bucket, prune_bwd_jvp_configs, tile_configs
from flashjvp._validate import AttnArgs, bhnd_view

_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "BLOCK_DQK", "BLOCK_DV", "RIGHT", "LEFT", "VARLEN", "HAS_MASK", "DOT_PREC",
        "HAS_TQ", "HAS_TK", "HAS_TV", "HAS_DO", "HAS_DTO", "SPARSE", "SP_BM", "SP_BN"]


@triton.jit
def _tile(base, rows, cols, n_rows, n_cols, row_stride):
    """(len(rows), len(cols)) tile of a row-major (n_rows, row_stride) matrix; zeros outside."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _probs(s, lse2, rows, keys, n_q, n_kv, off_r, off_l, mask_src, s_mm, s_mn, RIGHT: tl.constexpr,
           LEFT: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr):
    """P (rows x keys) from logits ``s`` in log2 units, the attention mask at ``mask_src``
    (HAS_MASK) and the rows' lse2; 0 where not visible."""
    if HAS_MASK:
        s += mask_bias(mask_src, rows, keys, n_q, n_kv, s_mm, s_mn, MASK_BOOL, MASK_ROWS) * LOG2E_K
    p = tl.math.exp2(s - lse2[:, None])
    return tl.where(visible(rows, keys, n_kv, off_r, off_l, RIGHT, LEFT), p, 0.0)


@triton.jit
def _tangent_scores(q, tq, k, tk, p, scale, HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, DOT_PREC: tl.constexpr):
    """tS = scale (tQ K^T + Q tK^T) for a (rows x keys) tile shaped like ``p``."""
    ts = tl.zeros_like(p)
    if HAS_TQ:
        ts = tl.dot(tq, tl.trans(k), ts, input_precision=DOT_PREC)
    if HAS_TK:
        ts = tl.dot(q, tl.trans(tk), ts, input_precision=DOT_PREC)
    return ts * scale


@triton.jit
def _row_grads(p, ts, mu, g, delta, dlse, do, dto, v, tv,
               HAS_TS: tl.constexpr, HAS_TV: tl.constexpr, HAS_DO: tl.constexpr, HAS_DTO: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """(dS, dTS) of one (rows x keys) tile; ``ts`` is unused without HAS_TS."""
    dp = tl.zeros_like(p)
    dtsv = tl.zeros_like(p)  # dto . v^T
    if HAS_DO:
        dp = tl.dot(do, tl.trans(v), dp, input_precision=DOT_PREC)
    if HAS_DTO:
        if HAS_TV:
            dp = tl.dot(dto, tl.trans(tv), dp, input_precision=DOT_PREC)
        if HAS_TS:
            dtsv = tl.dot(dto, tl.trans(v), dtsv, input_precision=DOT_PREC)
    if HAS_TS:
        dp += (ts - mu[:, None]) * dtsv + g[:, None] * ts
    ds = p * (dp - delta[:, None] + dlse[:, None])
    dts = p * (dtsv + g[:, None])
    return ds, dts


@triton.autotune(configs=tile_configs(BWD_JVP_TILES), key=_KEY,
                 prune_configs_by={"early_config_prune": prune_bwd_jvp_configs})
@triton.jit
def _attn_bwd_jvp_dq_kernel(
    Q, K, V, TQ, TK, TV, O, TO, DO, DTO, LSE, MU, DLSE, DMU, DELTA, G, DQ, DTQ, KV_LENS, CU_Q, CU_K, MASK,
    SP_ROW, SP_COL, SP_BITS,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn,
    s_tvb, s_tvh, s_tvn, s_ob, s_oh, s_on, s_tob, s_toh, s_ton, s_dob, s_doh, s_don, s_dtob, s_dtoh, s_dton,
    s_mb, s_mh, s_mm, s_mn, s_rb, s_rh, s_rn, s_cb, s_ch, s_cn,
    H_Q, GROUPS, N_Q, N_K, NQ_T, NK_T, bottom_right, win_r, win_l, scale_log2, scale, N_Q_BUCKET, N_K_BUCKET,
    D_QK, D_V, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_DO: tl.constexpr,
    HAS_DTO: tl.constexpr, HAS_KV_LENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
):
    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    q0, n_q, k0, n_k, n_kv = sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN, HAS_KV_LENS)
    m0 = pid_m * BLOCK_M
    if VARLEN:
        if m0 >= n_q:  # the grid covers the longest sequence
            return
    off_r, off_l = diagonals(n_q, n_k, bottom_right, win_r, win_l)
    bt = b if not VARLEN else b * 0  # batch index in the tensors (packed: one (1, H, total, D))
    h_kv = h // GROUPS
    bh = bt * H_Q + h  # (batch, query head)
    # row 0 of this sequence and head in each input (its own strides), and in the (B, H, N, D) gradients
    Q += bt * s_qb + h * s_qh + q0 * s_qn
    TQ += bt * s_tqb + h * s_tqh + q0 * s_tqn
    O += bt * s_ob + h * s_oh + q0 * s_on
    TO += bt * s_tob + h * s_toh + q0 * s_ton
    DO += bt * s_dob + h * s_doh + q0 * s_don
    DTO += bt * s_dtob + h * s_dtoh + q0 * s_dton
    K += bt * s_kb + h_kv * s_kh + k0 * s_kn
    TK += bt * s_tkb + h_kv * s_tkh + k0 * s_tkn
    V += bt * s_vb + h_kv * s_vh + k0 * s_vn
    TV += bt * s_tvb + h_kv * s_tvh + k0 * s_tvn
    q_out = (bh * NQ_T + q0) * D_QK
    rows = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rvalid = rows < n_q
    cqk = tl.arange(0, BLOCK_DQK)
    cv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    q = _tile(Q, rows, cqk, n_q, D_QK, s_qn)  # (BLOCK_M, BLOCK_DQK)
    tq = q
    if HAS_TQ:
        tq = _tile(TQ, rows, cqk, n_q, D_QK, s_tqn)  # (BLOCK_M, BLOCK_DQK)
    o = _tile(O, rows, cv, n_q, D_V, s_on).to(tl.float32)  # (BLOCK_M, BLOCK_DV)
    do = o
    dto = o
    idx = bh * NQ_T + q0 + rows  # (BLOCK_M,) flat row index in the (B, H, N) statistics
    mu = tl.load(MU + idx, mask=rvalid, other=0.0)
    dmu = tl.load(DMU + idx, mask=rvalid, other=0.0)
    dlse = tl.load(DLSE + idx, mask=rvalid, other=0.0)
    delta = tl.zeros([BLOCK_M], tl.float32)
    c = tl.zeros([BLOCK_M], tl.float32)
    if HAS_DO:
        do = _tile(DO, rows, cv, n_q, D_V, s_don)  # (BLOCK_M, BLOCK_DV)
        delta += tl.sum(do.to(tl.float32) * o, 1)
    if HAS_DTO:
        dto = _tile(DTO, rows, cv, n_q, D_V, s_dton)  # (BLOCK_M, BLOCK_DV)
        to = _tile(TO, rows, cv, n_q, D_V, s_ton).to(tl.float32)
        delta += tl.sum(dto.to(tl.float32) * to, 1)
        c = tl.sum(dto.to(tl.float32) * o, 1)
    g = dmu - c  # (BLOCK_M,)
    if HAS_TS:
        delta += g * mu
    tl.store(DELTA + idx, delta, mask=rvalid)  # read by the dK/dV kernel launched next
    tl.store(G + idx, g, mask=rvalid)
    lse2 = _lse_log2(LSE, idx, rvalid)  # (BLOCK_M,); P = 0 on rows without keys

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    dtq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    lo, _, _, hi = key_blocks(m0, n_kv, off_r, off_l, BLOCK_M, BLOCK_N, RIGHT, LEFT)  # every block masked
    mask_src = MASK + b * s_mb + h * s_mh
    lst = SP_ROW  # SPARSE: the block list of this row block, every listed block masked
    maxb = s_rn
    if SPARSE:
        lst, n_full, n_part, maxb = sparse_list(SP_ROW, b, h, m0 // SP_BM, s_rb, s_rh, s_rn)
        lo = 0
        hi = (n_full + n_part) * SP_BN
    for pos in range(lo, hi, BLOCK_N):
        start_n = pos
        j = pos
        if SPARSE:
            start_n, j = sparse_start(lst, pos, SP_BN)
        keys = start_n + offs_n  # (BLOCK_N,)
        k = _tile(K, keys, cqk, n_k, D_QK, s_kn)  # (BLOCK_N, BLOCK_DQK)
        v = _tile(V, keys, cv, n_k, D_V, s_vn)  # (BLOCK_N, BLOCK_DV)
        tk = k
        tv = v
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # (BLOCK_M, BLOCK_N)
        p = _probs(s, lse2, rows, keys, n_q, n_kv, off_r, off_l, mask_src, s_mm, s_mn, RIGHT, LEFT,
                   HAS_MASK, MASK_BOOL, MASK_ROWS)
        if SPARSE:
            p = tl.where(sparse_bits(SP_BITS, lst, j, rows, keys, maxb, SP_BM, SP_BN, False), p, 0.0)
        if HAS_TK:
            tk = _tile(TK, keys, cqk, n_k, D_QK, s_tkn)  # (BLOCK_N, BLOCK_DQK)
        ts = _tangent_scores(q, tq, k, tk, p, scale, HAS_TQ, HAS_TK, DOT_PREC)  # (BLOCK_M, BLOCK_N)
        if HAS_TV:
            tv = _tile(TV, keys, cv, n_k, D_V, s_tvn)  # (BLOCK_N, BLOCK_DV)
        ds, dts = _row_grads(p, ts, mu, g, delta, dlse, do, dto, v, tv, HAS_TS, HAS_TV, HAS_DO, HAS_DTO,
                             DOT_PREC)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        if HAS_TK:
            dq = tl.dot(dts.to(tk.dtype), tk, dq, input_precision=DOT_PREC)
        if HAS_TQ:
            dtq = tl.dot(dts.to(k.dtype), k, dtq, input_precision=DOT_PREC)
    omask = rvalid[:, None] & (cqk < D_QK)[None, :]
    out = q_out + rows[:, None] * D_QK + cqk[None, :]
    tl.store(DQ + out, (dq * scale).to(DQ.dtype.element_ty), mask=omask)
    if HAS_TQ:
        tl.store(DTQ + out, (dtq * scale).to(DTQ.dtype.element_ty), mask=omask)


@triton.autotune(configs=tile_configs(BWD_JVP_TILES), key=_KEY,
                 prune_configs_by={"early_config_prune": prune_bwd_jvp_configs})
@triton.jit
def _attn_bwd_jvp_dkdv_kernel(
    Q, K, V, TQ, TK, TV, DO, DTO, LSE, MU, DLSE, DELTA, G, DK, DV, DTK, DTV, KV_LENS, CU_Q, CU_K, MASK,
    SP_ROW, SP_COL, SP_BITS,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_tqb, s_tqh, s_tqn, s_tkb, s_tkh, s_tkn,
    s_tvb, s_tvh, s_tvn, s_dob, s_doh, s_don, s_dtob, s_dtoh, s_dton,
    s_mb, s_mh, s_mm, s_mn, s_rb, s_rh, s_rn, s_cb, s_ch, s_cn,
    H_Q, GROUPS, N_Q, N_K, NQ_T, NK_T, bottom_right, win_r, win_l, scale_log2, scale, N_Q_BUCKET, N_K_BUCKET,
    D_QK, D_V, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_DO: tl.constexpr,
    HAS_DTO: tl.constexpr, HAS_KV_LENS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
):
    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
    pid_n = tl.program_id(0)
    h_kv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    q0, n_q, k0, n_k, n_kv = sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN, HAS_KV_LENS)
    n0 = pid_n * BLOCK_N
    if VARLEN:
        if n0 >= n_k:  # the grid covers the longest sequence
            return
    off_r, off_l = diagonals(n_q, n_k, bottom_right, win_r, win_l)
    bt = b if not VARLEN else b * 0  # batch index in the tensors (packed: one (1, H, total, D))
    bkv = bt * (H_Q // GROUPS) + h_kv
    # key 0 of this sequence and kv head in each input (its own strides), and in the (B, H, N, D) gradients
    K += bt * s_kb + h_kv * s_kh + k0 * s_kn
    TK += bt * s_tkb + h_kv * s_tkh + k0 * s_tkn
    V += bt * s_vb + h_kv * s_vh + k0 * s_vn
    TV += bt * s_tvb + h_kv * s_tvh + k0 * s_tvn
    k_base = (bkv * NK_T + k0) * D_QK
    v_base = (bkv * NK_T + k0) * D_V
    keys = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    cqk = tl.arange(0, BLOCK_DQK)
    cv = tl.arange(0, BLOCK_DV)
    offs_m = tl.arange(0, BLOCK_M)
    k = _tile(K, keys, cqk, n_k, D_QK, s_kn)  # (BLOCK_N, BLOCK_DQK)
    v = _tile(V, keys, cv, n_k, D_V, s_vn)  # (BLOCK_N, BLOCK_DV)
    tk = k
    tv = v
    if HAS_TK:
        tk = _tile(TK, keys, cqk, n_k, D_QK, s_tkn)  # (BLOCK_N, BLOCK_DQK)
    if HAS_TV:
        tv = _tile(TV, keys, cv, n_k, D_V, s_tvn)  # (BLOCK_N, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dtk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dtv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    # query blocks that see some key of this block (keys of padding only: none), every one masked
    lo, _, _, hi = query_blocks(n0, n_q, off_r, off_l, BLOCK_M, BLOCK_N, RIGHT, LEFT)
    hi = tl.where(n0 < n_kv, hi, 0)
    for gi in range(GROUPS):  # the query heads of this kv head, summed in a fixed order
        hq = h_kv * GROUPS + gi
        bh = bt * H_Q + hq
        q_ptr = Q + bt * s_qb + hq * s_qh + q0 * s_qn  # row 0 of this sequence and query head
        tq_ptr = TQ + bt * s_tqb + hq * s_tqh + q0 * s_tqn
        do_ptr = DO + bt * s_dob + hq * s_doh + q0 * s_don
        dto_ptr = DTO + bt * s_dtob + hq * s_dtoh + q0 * s_dton
        mask_src = MASK + b * s_mb + (h_kv * GROUPS + gi) * s_mh
        lst = SP_COL  # SPARSE: this key block's column of the block mask, every listed block masked
        maxb = s_cn
        m_lo = lo
        m_hi = hi
        if SPARSE:
            lst, n_full, n_part, maxb = sparse_list(SP_COL, b, h_kv * GROUPS + gi, n0 // SP_BN, s_cb, s_ch, s_cn)
            m_lo = lo * 0
            m_hi = (n_full + n_part) * SP_BM
        for pos in range(m_lo, m_hi, BLOCK_M):
            start_m = pos
            j = pos
            if SPARSE:
                start_m, j = sparse_start(lst, pos, SP_BM)
            rows = start_m + offs_m  # (BLOCK_M,)
            rvalid = rows < n_q
            idx = bh * NQ_T + q0 + rows
            q = _tile(q_ptr, rows, cqk, n_q, D_QK, s_qn)  # (BLOCK_M, BLOCK_DQK)
            lse2 = _lse_log2(LSE, idx, rvalid)  # (BLOCK_M,)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # (BLOCK_M, BLOCK_N)
            p = _probs(s, lse2, rows, keys, n_q, n_kv, off_r, off_l, mask_src, s_mm, s_mn, RIGHT, LEFT,
                       HAS_MASK, MASK_BOOL, MASK_ROWS)
            if SPARSE:
                p = tl.where(sparse_bits(SP_BITS, lst, j, rows, keys, maxb, SP_BM, SP_BN, False), p, 0.0)
            tq = q
            if HAS_TQ:
                tq = _tile(tq_ptr, rows, cqk, n_q, D_QK, s_tqn)  # (BLOCK_M, BLOCK_DQK)
            ts = _tangent_scores(q, tq, k, tk, p, scale, HAS_TQ, HAS_TK, DOT_PREC)  # (BLOCK_M, BLOCK_N)
            mu = tl.load(MU + idx, mask=rvalid, other=0.0)
            g = tl.load(G + idx, mask=rvalid, other=0.0)
            delta = tl.load(DELTA + idx, mask=rvalid, other=0.0)
            dlse = tl.load(DLSE + idx, mask=rvalid, other=0.0)
            do = q
            dto = q
            if HAS_DO:
                do = _tile(do_ptr, rows, cv, n_q, D_V, s_don)  # (BLOCK_M, BLOCK_DV)
                dv = tl.dot(tl.trans(p).to(do.dtype), do, dv, input_precision=DOT_PREC)
            if HAS_DTO:
                dto = _tile(dto_ptr, rows, cv, n_q, D_V, s_dton)  # (BLOCK_M, BLOCK_DV)
                if HAS_TS:
                    tp = p * (ts - mu[:, None])  # (BLOCK_M, BLOCK_N): tangent of P
                    dv = tl.dot(tl.trans(tp).to(dto.dtype), dto, dv, input_precision=DOT_PREC)
                if HAS_TV:
                    dtv = tl.dot(tl.trans(p).to(dto.dtype), dto, dtv, input_precision=DOT_PREC)
            ds, dts = _row_grads(p, ts, mu, g, delta, dlse, do, dto, v, tv, HAS_TS, HAS_TV, HAS_DO, HAS_DTO,
                                 DOT_PREC)
            dk = tl.dot(tl.trans(ds).to(q.dtype), q, dk, input_precision=DOT_PREC)
            if HAS_TQ:
                dk = tl.dot(tl.trans(dts).to(tq.dtype), tq, dk, input_precision=DOT_PREC)
            if HAS_TK:
                dtk = tl.dot(tl.trans(dts).to(q.dtype), q, dtk, input_precision=DOT_PREC)
    kmask = (keys < n_k)[:, None]  # padding keys too: their gradients are zero
    out_k = k_base + keys[:, None] * D_QK + cqk[None, :]
    out_v = v_base + keys[:, None] * D_V + cv[None, :]
    tl.store(DK + out_k, (dk * scale).to(DK.dtype.element_ty), mask=kmask & (cqk < D_QK)[None, :])
    tl.store(DV + out_v, dv.to(DV.dtype.element_ty), mask=kmask & (cv < D_V)[None, :])
    if HAS_TK:
        tl.store(DTK + out_k, (dtk * scale).to(DTK.dtype.element_ty), mask=kmask & (cqk < D_QK)[None, :])
    if HAS_TV:
        tl.store(DTV + out_v, dtv.to(DTV.dtype.element_ty), mask=kmask & (cv < D_V)[None, :])


def _unit_dim(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """``x`` as the kernels read it: its (B, H, N, D) view, copied only where the head dim is not
    unit-stride (the tiles load rows of D contiguous elements)."""
    if x is None:
        return None
    x = bhnd_view(x, layout)
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def attn_bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, a: AttnArgs):
    """Gradients ``(dq, dk, dv, dtq, dtk, dtv)`` of ``(o, to, lse, mu) = attention_jvp(...)``
    given the cotangents ``do, dto`` (o's shape) and ``dlse, dmu`` ((B, Hq, Nq)); any cotangent
    and any tangent may be ``None`` (zero; the tangent's gradient is then ``None``). ``lse`` and
    ``mu`` are the forward's float32 statistics. Gradients have their input's shape and layout."""
    L = a.layout
    q, k, v, tq, tk, tv, o, to, do, dto = (_unit_dim(x, L) for x in (q, k, v, tq, tk, tv, o, to, do, dto))
    zeros = torch.zeros_like(lse)
    dlse = zeros if dlse is None else dlse.float().contiguous()
    dmu = zeros if dmu is None else dmu.float().contiguous()
    mu = zeros if mu is None else mu.contiguous()
    if to is None:
        to = o
    dq, dk, dv = (new_buffer(x.shape, x.dtype, x.device) for x in (q, k, v))  # (B, H, N, D) contiguous
    dtq, dtk, dtv = (None if t is None else new_buffer(t.shape, t.dtype, t.device) for t in (tq, tk, tv))
    delta, g = new_buffer(lse.shape, torch.float32, lse.device), new_buffer(lse.shape, torch.float32, lse.device)
    bdqk, bdv = head_blocks(a.d_qk, a.d_v)
    masks, mask_flags = mask_args(a)
    flags = dict(N_Q_BUCKET=length_bucket(a.n_q), N_K_BUCKET=length_bucket(a.n_k), D_QK=a.d_qk, D_V=a.d_v,
                 BLOCK_DQK=bdqk, BLOCK_DV=bdv, **mask_flags, DOT_PREC=dot_precision(q.dtype),
                 HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
                 HAS_DO=do is not None, HAS_DTO=dto is not None, HAS_KV_LENS=a.kv_lens is not None)
    seqs, mstrides = aux_tensors(a, lse), mask_strides(a)
    n_t = (a.n_q, a.n_k) if a.varlen is None else (a.varlen.total_q, a.varlen.total_k)  # rows per (b, h)
    sizes = (a.h_q, a.groups, a.n_q, a.n_k, *n_t, *masks, a.scale * LOG2E, a.scale)
    alt = lambda x, y: y if x is None else x  # noqa: E731  (a tensor the kernel never reads)
    grid_q = lambda m: (triton.cdiv(a.n_q, m["BLOCK_M"]), a.h_q, a.batch)  # noqa: E731
    grid_kv = lambda m: (triton.cdiv(a.n_k, m["BLOCK_N"]), a.h_kv, a.batch)  # noqa: E731
    ins = (q, k, v, alt(tq, q), alt(tk, k), alt(tv, v))
    outs = (alt(do, o), alt(dto, o))
    strides = [st for x in ins for st in _seq3(x, a)]
    out_strides = [st for x in outs for st in _seq3(x, a)]
    with launch_device(q):
        launch_tuned(_attn_bwd_jvp_dq_kernel, grid_q, *ins, o, to, *outs, lse, mu, dlse, dmu, delta, g, dq,
                     alt(dtq, dq), *seqs, *strides, *_seq3(o, a), *_seq3(to, a), *out_strides, *mstrides, *sizes,
                     **flags)
        launch_tuned(_attn_bwd_jvp_dkdv_kernel, grid_kv, *ins, *outs, lse, mu, dlse, delta, g, dk, dv, alt(dtk, dk),
                     alt(dtv, dv), *seqs, *strides, *out_strides, *mstrides, *sizes, **flags)
    return tuple(bhnd_view(x, L) for x in (dq, dk, dv, dtq, dtk, dtv))


def _seq3(x: torch.Tensor, a: AttnArgs) -> tuple[int, int, int]:
    """(batch, head, sequence) strides of a (B, H, N, D) view; batch stride 0 for a packed batch,
    whose sequences are found from their offsets."""
    sb, sh, sn, _ = x.stride()
    return (0 if a.varlen is not None else sb), sh, sn
