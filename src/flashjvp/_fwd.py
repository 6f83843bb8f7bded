"""Fused attention forward + forward-mode tangent (JVP) in one Triton pass.

Per (batch, query head, block of BLOCK_M query rows) one program streams over the key blocks
once, keeping the online-softmax state: the running max ``m`` (log2 units), the denominator
``l``, the output accumulator ``acc_o``, one tangent accumulator ``acc_t`` and ``r``, the running
row sum of E * tS (docs/math.md). Which tangents exist is a compile-time choice (HAS_TQ, HAS_TK,
HAS_TV), so a zero tangent costs no matrix product. Non-causal launches over many keys (``SPLIT``)
run on a 1-D grid whose last, partial wave of row blocks is split into key shards and merged by
a second launch (``_split.py``).

On the ``TMA`` path (``_policy.use_tma``) every tile is loaded through tensor descriptors: K, V,
tK, tV through 4-D ones made on the host over a (B, H, N, D) view of either storage order, q and
tq through ones built in the kernel. Outputs are stored through pointers on both paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashjvp._jit import (
    LN2_K,
    LOG2E,
    aligned,
    aligned3,
    diagonals,
    key_blocks,
    load_tile,
    mask_bias,
    sequence,
    sparse_bits,
    sparse_list,
    sparse_start,
    visible,
)
from flashjvp._launch import (
    PLANS,
    aligned16,
    all_seq_strides,
    allow_tf32,
    aux_tensors,
    dot_precision,
    ensure_tma_allocator,
    launch_device,
    mask_args,
    mask_strides,
    out_buffer,
    plan_tuned,
    stat_buffer,
    stat_strides,
    strides_bhnd,
    vector_align,
)
from flashjvp._policy import (
    BLOCK_MS,
    FWD_TILES,
    MAX_BLOCK_N,
    head_blocks,
    length_bucket,
    prune_fwd_configs,
    split_grid,
    split_slots,
    tail_split_enabled,
    tile_configs,
    tma_mode,
    use_tma,
)
from flashjvp._split import attn_merge, split_decode, split_scratch
from flashjvp._validate import AttnArgs

_MAX_BLOCK_N = tl.constexpr(MAX_BLOCK_N)


def _set_tma_boxes(*args, **kwargs) -> None:
    """Pre-run hook of the kernel (every launch, whatever the config and however it was picked):
    on the TMA path give the host-made descriptors of k, v, tk, tv (arguments 1, 2, 4, 5) the
    (1, 1, BLOCK_N, BLOCK_D) box of the launched tile."""
    if not isinstance(args[1], TensorDescriptor):
        return
    bn, dqk, dv = kwargs["BLOCK_N"], kwargs["BLOCK_DQK"], kwargs["BLOCK_DV"]
    for i, d in ((1, dqk), (2, dv), (4, dqk), (5, dv)):
        args[i].block_shape = [1, 1, bn, d]


def _tma_descriptor(x: torch.Tensor, layout: str) -> TensorDescriptor:
    """4-D descriptor over a (B, H, N, D) view of ``x`` (strides from ``strides_bhnd``, either
    storage order; ``tma_usable`` checked that TMA can address it); the box is set per launch by
    ``_set_tma_boxes``."""
    shape = x.shape if layout == "bhnd" else (x.shape[0], x.shape[2], x.shape[1], x.shape[3])
    return TensorDescriptor(x, list(shape), list(strides_bhnd(x, layout)), [1, 1, 1, 16])


@triton.jit
def _tma_tile(desc, b, h, row):
    """The (rows, D) box at sequence position ``row`` of (batch ``b``, head ``h``) from a host-made
    4-D tensor descriptor over a (B, H, N, D) view; rows past N and columns past D read as zero."""
    x = desc.load([b, h, row, 0])  # (1, 1, rows, D)
    return tl.reshape(x, [x.shape[2], x.shape[3]])  # (rows, D)


@triton.jit
def _q_tile(base, N, D, stride_n, row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (BLOCK_ROWS, BLOCK_D) tile at row ``row`` of one (batch, head)'s (N, D) matrix at
    ``base`` (unit stride along D), through a descriptor built on the device; rows past N and
    columns past D read as zero."""
    return tl.make_tensor_descriptor(base, [N, D], [stride_n, 1], [BLOCK_ROWS, BLOCK_D]).load([row, 0])


@triton.jit
def _load_kv(src, start_n, stride_n, mask0, mask1, b, h, MASK0: tl.constexpr, MASK1: tl.constexpr,
             TMA: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Key block ``start_n`` of K/V/tK/tV: from a tensor descriptor ((BLOCK_N, D) boxes of batch
    ``b``, head ``h``; transposed for K) or from a pointer tile (already laid out as wanted)."""
    if TMA:
        x = _tma_tile(src, b, h, start_n)  # (BLOCK_N, BLOCK_D)
        if TRANSPOSED:
            x = tl.trans(x)  # (BLOCK_D, BLOCK_N)
    else:
        x = load_tile(src + start_n * stride_n, mask0, mask1, MASK0, MASK1)
    return x


@triton.jit
def _tangent_logits(q, tq, k, tk_src, start_n, stride_tkn, mask_dqk, kvalid, s, b, h_kv,
                    MASKED: tl.constexpr, EVEN_DQK: tl.constexpr, HAS_TQ: tl.constexpr,
                    HAS_TK: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr):
    """tS = tQ.K^T + Q.tK^T for key block ``start_n``: (BLOCK_M, BLOCK_N), like ``s``."""
    ts = tl.zeros_like(s)
    if HAS_TQ:
        ts = tl.dot(tq, k, ts, input_precision=DOT_PREC)
    if HAS_TK:
        tk = _load_kv(tk_src, start_n, stride_tkn, mask_dqk, kvalid, b, h_kv, not EVEN_DQK, MASKED,
                      TMA, True)  # (BLOCK_DQK, BLOCK_N)
        ts = tl.dot(q, tk, ts, input_precision=DOT_PREC)
    return ts


@triton.jit
def _fwd_inner(
    acc_o, acc_t, m_i, l_i, r_i, q, tq,
    k_src, v_src, tk_src, tv_src, stride_kn, stride_vn, stride_tkn, stride_tvn,
    rows, offs_n, mask_dqk, mask_dv, lo, hi, n_kv, off_r, off_l, scale_log2, scale, b, h_kv,
    mask_src, n_q, s_mm, s_mn, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    lst, bits, maxb, SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, RIGHT: tl.constexpr, LEFT: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold key blocks [lo, hi) into the running state; MASKED blocks apply the key count
    ``n_kv``, the diagonal bounds (``_jit.visible``) and an attention mask (HAS_MASK: at
    ``mask_src``, added to the logits) to the query rows ``rows``. SPARSE: [lo, hi) are virtual
    positions over the block list ``lst`` (``_jit.sparse_start``), whose partial blocks MASKED
    loops mask with their bitmask tiles at ``bits``. With TMA the
    K/V sources are host-made tensor descriptors read at (``b``, ``h_kv``; zero-filled out of
    bounds), else pointers."""
    HAS_TS: tl.constexpr = HAS_TQ or HAS_TK
    # tS is issued right after S, so that the MMA of E.V overlaps the E * tS arithmetic (Triton
    # waits for a dot at once unless it only feeds a loop-carried accumulator). Not for 16-wide
    # head blocks: there Triton 3.6 compiled that order to an illegal memory access on sm_90.
    EARLY_TS: tl.constexpr = q.shape[1] >= 32
    for pos in range(lo, hi, BLOCK_N):
        start_n = pos
        j = pos
        if SPARSE:
            start_n, j = sparse_start(lst, pos, SP_BN)
        keys = start_n + offs_n  # (BLOCK_N,)
        kvalid = keys < n_kv  # (BLOCK_N,)
        k = _load_kv(k_src, start_n, stride_kn, mask_dqk, kvalid, b, h_kv, not EVEN_DQK, MASKED,
                     TMA, True)  # (BLOCK_DQK, BLOCK_N), K transposed
        s = tl.dot(q, k, input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N), unscaled logits
        if HAS_TS and EARLY_TS:
            ts = _tangent_logits(q, tq, k, tk_src, start_n, stride_tkn, mask_dqk, kvalid, s, b, h_kv,
                                 MASKED, EVEN_DQK, HAS_TQ, HAS_TK, DOT_PREC, TMA)
        if MASKED:
            if HAS_MASK:  # the bias in units of the unscaled logits (scale > 0)
                s += mask_bias(mask_src, rows, keys, n_q, n_kv, s_mm, s_mn, MASK_BOOL, MASK_ROWS) / scale
            vis = visible(rows, keys, n_kv, off_r, off_l, RIGHT, LEFT)  # (BLOCK_M, BLOCK_N)
            if SPARSE:
                vis = vis & sparse_bits(bits, lst, j, rows, keys, maxb, SP_BM, SP_BN, False)
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)  # (BLOCK_M,), log2 units (scale > 0)
        m_use = m_new
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_use)  # (BLOCK_M,)
        e = tl.math.exp2(s * scale_log2 - m_use[:, None])  # (BLOCK_M, BLOCK_N), unnormalised P (one FMA)
        l_i = l_i * alpha + tl.sum(e, 1)
        v = _load_kv(v_src, start_n, stride_vn, kvalid, mask_dv, b, h_kv, MASKED, not EVEN_DV,
                     TMA, False)  # (BLOCK_N, BLOCK_DV)
        acc_o = tl.dot(e.to(v.dtype), v, acc_o * alpha[:, None], input_precision=DOT_PREC)
        if HAS_TS or HAS_TV:
            acc_t = acc_t * alpha[:, None]  # (BLOCK_M, BLOCK_DV)
        if HAS_TS:
            if not EARLY_TS:
                ts = _tangent_logits(q, tq, k, tk_src, start_n, stride_tkn, mask_dqk, kvalid, s, b, h_kv,
                                     MASKED, EVEN_DQK, HAS_TQ, HAS_TK, DOT_PREC, TMA)
            if HAS_TV:
                hs = e * (ts * scale)  # (BLOCK_M, BLOCK_N): E * tS
            else:  # acc_t and r hold E * tS / scale: scaled once in the epilogue
                hs = e * ts  # (BLOCK_M, BLOCK_N)
            r_i = r_i * alpha + tl.sum(hs, 1)
            acc_t = tl.dot(hs.to(v.dtype), v, acc_t, input_precision=DOT_PREC)
        if HAS_TV:
            tv = _load_kv(tv_src, start_n, stride_tvn, kvalid, mask_dv, b, h_kv, MASKED, not EVEN_DV,
                          TMA, False)  # (BLOCK_N, BLOCK_DV)
            acc_t = tl.dot(e.to(tv.dtype), tv, acc_t, input_precision=DOT_PREC)
        m_i = m_new
    return acc_o, acc_t, m_i, l_i, r_i


@triton.jit
def _lse(m_i, l_i):
    """Natural-log logsumexp of the rows from the running max (log2 units) and denominator;
    -inf for rows that saw no key (l == 0)."""
    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2_K)


_FWD_KEY = ["N_Q_BUCKET", "N_K_BUCKET", "BLOCK_DQK", "BLOCK_DV", "RIGHT", "LEFT", "VARLEN", "HAS_MASK",
            "SPARSE", "SP_BM", "SP_BN", "SP_RUNS", "HAS_TQ", "HAS_TK", "HAS_TV", "DOT_PREC", "TMA", "SPLIT"]


@triton.autotune(configs=tile_configs(FWD_TILES), key=_FWD_KEY,
                 prune_configs_by={"early_config_prune": prune_fwd_configs})
@triton.heuristics({
    "EVEN_DQK": lambda a: a["D_QK"] == a["BLOCK_DQK"],
    "EVEN_DV": lambda a: a["D_V"] == a["BLOCK_DV"],
})
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, TQ, TK, TV, O, TO, LSE, MU, OP, TOP, LSEP, MUP, KV_LENS, CU_Q, CU_K, MASK, SP_ROW, SP_COL, SP_BITS,
    s_qb, s_qh, s_qn, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd,
    s_tqb, s_tqh, s_tqn, s_tqd, s_tkb, s_tkh, s_tkn, s_tkd, s_tvb, s_tvh, s_tvn, s_tvd,
    s_ob, s_oh, s_on, s_od, s_tob, s_toh, s_ton, s_tod, s_lb, s_lh, s_mb, s_mh, s_mm, s_mn,
    s_rb, s_rh, s_rn, s_cb, s_ch, s_cn,
    BATCH, H_Q, GROUPS, N_Q, N_K, bottom_right, win_r, win_l, scale_log2, scale, SLOTS, N_Q_BUCKET, N_K_BUCKET,
    D_QK, D_V, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    RIGHT: tl.constexpr, LEFT: tl.constexpr, VARLEN: tl.constexpr, KEY_TAIL: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
    STORE_MU: tl.constexpr, DOT_PREC: tl.constexpr, ALIGN: tl.constexpr, TMA: tl.constexpr,
    EVEN_DQK: tl.constexpr, EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, HAS_KV_LENS: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
    SPARSE: tl.constexpr, SP_BM: tl.constexpr, SP_BN: tl.constexpr, SP_RUNS: tl.constexpr,
):
    # SP_RUNS: every list's full blocks are consecutive, so the unmasked loop needs no list
    FULL_LIST: tl.constexpr = SPARSE and not SP_RUNS
    if SPLIT:  # a 1-D grid: row blocks in (batch, head, block) order, then the key shards (_split.py)
        n_mb = tl.cdiv(N_Q, BLOCK_M)
        block, shard, part, shards = split_decode(n_mb * H_Q * BATCH, SLOTS)
        pid_m = block % n_mb
        h32 = (block // n_mb) % H_Q
        b32 = block // (n_mb * H_Q)
    else:
        pid_m = tl.program_id(0)
        if SPARSE:  # last row blocks first: with causal-like masks they carry the most key blocks
            pid_m = tl.cdiv(N_Q, BLOCK_M) - 1 - pid_m
        h32 = tl.program_id(1)
        b32 = tl.program_id(2)
        part = -1  # a whole row block
    hkv32 = h32 // GROUPS  # descriptor coordinates are 32-bit, pointer offsets 64-bit
    b = b32.to(tl.int64)
    h_kv = hkv32.to(tl.int64)
    h = h32.to(tl.int64)
    # Multiples of ALIGN (vector_align): 16-byte loads and stores also for D = 40, 72, ...
    s_qb, s_qh, s_qn = aligned3(s_qb, s_qh, s_qn, ALIGN)
    s_kb, s_kh, s_kn = aligned3(s_kb, s_kh, s_kn, ALIGN)
    s_vb, s_vh, s_vn = aligned3(s_vb, s_vh, s_vn, ALIGN)
    s_tqb, s_tqh, s_tqn = aligned3(s_tqb, s_tqh, s_tqn, ALIGN)
    s_tkb, s_tkh, s_tkn = aligned3(s_tkb, s_tkh, s_tkn, ALIGN)
    s_tvb, s_tvh, s_tvn = aligned3(s_tvb, s_tvh, s_tvn, ALIGN)
    s_ob, s_oh, s_on = aligned3(s_ob, s_oh, s_on, ALIGN)
    s_tob, s_toh, s_ton = aligned3(s_tob, s_toh, s_ton, ALIGN)
    D_QK, D_V = aligned(D_QK, ALIGN), aligned(D_V, ALIGN)
    m0 = pid_m * BLOCK_M
    # this batch element's rows and keys (packed sequences: from the offsets; past n_kv: padding)
    q0, n_q, k0, n_k, n_kv = sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN, HAS_KV_LENS)
    if VARLEN:  # pointer path only (TMA descriptors span the whole packed tensor)
        if m0 >= n_q:  # the grid covers the longest sequence
            return
        Q += q0 * s_qn
        TQ += q0 * s_tqn
        O += q0 * s_on
        TO += q0 * s_ton
        K += k0 * s_kn
        TK += k0 * s_tkn
        V += k0 * s_vn
        TV += k0 * s_tvn
    off_r, off_l = diagonals(n_q, n_k, bottom_right, win_r, win_l)
    rows = tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows within the block
    offs_m = m0 + rows  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key offsets within a block
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < n_q
    mask_dqk = offs_dqk < D_QK
    mask_dv = offs_dv < D_V

    if TMA:
        # q and tq through descriptors built here, K..TV through host-made 4-D ones (_set_tma_boxes)
        q = _q_tile(Q + b * s_qb + h * s_qh, n_q, D_QK, s_qn, m0, BLOCK_M, BLOCK_DQK)  # (BLOCK_M, BLOCK_DQK)
        tq = q
        if HAS_TQ:
            tq = _q_tile(TQ + b * s_tqb + h * s_tqh, n_q, D_QK, s_tqn, m0, BLOCK_M, BLOCK_DQK)  # (BLOCK_M, BLOCK_DQK)
        k_src, tk_src, v_src, tv_src = K, TK, V, TV
    else:
        qmask = mask_m[:, None] & mask_dqk[None, :]
        q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qn + offs_dqk[None, :] * s_qd,
                    mask=qmask, other=0.0)  # (BLOCK_M, BLOCK_DQK)
        tq = q
        if HAS_TQ:
            tq = tl.load(TQ + b * s_tqb + h * s_tqh + offs_m[:, None] * s_tqn + offs_dqk[None, :] * s_tqd,
                         mask=qmask, other=0.0)  # (BLOCK_M, BLOCK_DQK)
        # K and tK are read transposed: (BLOCK_DQK, BLOCK_N) tiles.
        k_src = K + b * s_kb + h_kv * s_kh + offs_dqk[:, None] * s_kd + offs_n[None, :] * s_kn
        tk_src = TK + b * s_tkb + h_kv * s_tkh + offs_dqk[:, None] * s_tkd + offs_n[None, :] * s_tkn
        v_src = V + b * s_vb + h_kv * s_vh + offs_n[:, None] * s_vn + offs_dv[None, :] * s_vd
        tv_src = TV + b * s_tvb + h_kv * s_tvh + offs_n[:, None] * s_tvn + offs_dv[None, :] * s_tvd

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running denominator
    r_i = tl.zeros([BLOCK_M], tl.float32)  # running rowsum(E * tS)
    acc_o = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_t = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    mask_src = MASK + b * s_mb + h * s_mh
    lst = SP_ROW  # the block list (SPARSE)
    maxb = s_rn
    run0 = 0  # the unmasked loop's offset (SP_RUNS)
    if SPARSE:  # this row block's list of the block mask: its full blocks unmasked, then the partial ones
        tl.static_assert(SP_BM % BLOCK_M == 0 and SP_BN % BLOCK_N == 0, "the tiles divide the mask's blocks")
        lst, n_full, n_part, maxb = sparse_list(SP_ROW, b, h, m0 // SP_BM, s_rb, s_rh, s_rn)
        # Virtual positions over the list: [0, full_hi) its full blocks, [full_hi, hi) its partial ones.
        lo = 0
        full_lo = 0
        full_hi = n_full * SP_BN
        hi = (n_full + n_part) * SP_BN
        if SP_RUNS:  # the unmasked loop over keys from the first full block on
            run0 = tl.load(lst + 2) * SP_BN
    else:
        # Key blocks every row of this block sees completely run unmasked; the rest are masked. The
        # masked loops are compiled only where they can run: a window's left edge (LEFT), causality or
        # a window's right edge (RIGHT), a partial last key block (KEY_TAIL), a mask (HAS_MASK, SPARSE).
        tl.static_assert(_MAX_BLOCK_N % BLOCK_N == 0, "KEY_TAIL assumes BLOCK_N divides _MAX_BLOCK_N")
        lo, full_lo, full_hi, hi = key_blocks(m0, n_kv, off_r, off_l, BLOCK_M, BLOCK_N, RIGHT, LEFT)
        if HAS_MASK:  # every block reads its tile of the mask
            full_hi = full_lo
        if SPLIT:  # this program's shard of the key blocks: [lo, hi) (never with RIGHT or LEFT)
            per_shard = tl.cdiv(tl.cdiv(hi, BLOCK_N), shards) * BLOCK_N  # keys, a multiple of BLOCK_N
            lo = shard * per_shard
            hi = tl.minimum(hi, lo + per_shard)
            full_lo = lo
            full_hi = tl.minimum(tl.maximum(full_hi, lo), hi)
    if LEFT:
        acc_o, acc_t, m_i, l_i, r_i = _fwd_inner(
            acc_o, acc_t, m_i, l_i, r_i, q, tq, k_src, v_src, tk_src, tv_src,
            s_kn, s_vn, s_tkn, s_tvn, offs_m, offs_n, mask_dqk, mask_dv, lo, full_lo, n_kv, off_r, off_l,
            scale_log2, scale, b32, hkv32, mask_src, n_q, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
            lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN, BLOCK_N, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV,
            HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, TMA)
    acc_o, acc_t, m_i, l_i, r_i = _fwd_inner(
        acc_o, acc_t, m_i, l_i, r_i, q, tq, k_src, v_src, tk_src, tv_src,
        s_kn, s_vn, s_tkn, s_tvn, offs_m, offs_n, mask_dqk, mask_dv, full_lo + run0, full_hi + run0, n_kv,
        off_r, off_l, scale_log2, scale, b32, hkv32, mask_src, n_q, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
        lst, SP_BITS, maxb, FULL_LIST, SP_BM, SP_BN, BLOCK_N, False, RIGHT, LEFT, EVEN_DQK, EVEN_DV,
        HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, TMA)
    if RIGHT or KEY_TAIL or HAS_MASK or SPARSE:
        acc_o, acc_t, m_i, l_i, r_i = _fwd_inner(
            acc_o, acc_t, m_i, l_i, r_i, q, tq, k_src, v_src, tk_src, tv_src,
            s_kn, s_vn, s_tkn, s_tvn, offs_m, offs_n, mask_dqk, mask_dv, full_hi, hi, n_kv, off_r, off_l,
            scale_log2, scale, b32, hkv32, mask_src, n_q, s_mm, s_mn, HAS_MASK, MASK_BOOL, MASK_ROWS,
            lst, SP_BITS, maxb, SPARSE, SP_BM, SP_BN, BLOCK_N, True, RIGHT, LEFT, EVEN_DQK, EVEN_DV,
            HAS_TQ, HAS_TK, HAS_TV, DOT_PREC, TMA)

    # Epilogue: rows that saw no key (l == 0) give o = to = mu = 0 and lse = -inf.
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)  # (BLOCK_M,)
    o = acc_o * inv_l[:, None]  # (BLOCK_M, BLOCK_DV)
    inv_l_t = inv_l  # (BLOCK_M,) 1 / l, with the logit scale the key loop left out (no tV)
    if not HAS_TV:
        inv_l_t = inv_l * scale
    JVP: tl.constexpr = HAS_TQ or HAS_TK or HAS_TV
    if part >= 0:  # a key shard (SPLIT): float32 results of its keys, merged by _split.attn_merge
        prow = part * BLOCK_M + rows  # (BLOCK_M,) scratch rows
        tl.store(OP + prow[:, None] * BLOCK_DV + offs_dv[None, :], o)
        mu = r_i * inv_l_t  # (BLOCK_M,)
        if JVP:
            tl.store(TOP + prow[:, None] * BLOCK_DV + offs_dv[None, :], acc_t * inv_l_t[:, None] - mu[:, None] * o)
        tl.store(LSEP + prow, _lse(m_i, l_i))
        tl.store(MUP + prow, mu)
    else:  # o is stored before `to` is formed: holding both at once spills registers
        omask = mask_m[:, None] & mask_dv[None, :]  # (BLOCK_M, BLOCK_DV)
        tl.store(O + b * s_ob + h * s_oh + offs_m[:, None] * s_on + offs_dv[None, :] * s_od,
                 o.to(O.dtype.element_ty), mask=omask)
        lse = _lse(m_i, l_i)  # (BLOCK_M,)
        mu = r_i * inv_l_t  # (BLOCK_M,) tangent of lse (zero without tangents)
        if JVP:
            to = acc_t * inv_l_t[:, None] - mu[:, None] * o  # (BLOCK_M, BLOCK_DV)
            tl.store(TO + b * s_tob + h * s_toh + offs_m[:, None] * s_ton + offs_dv[None, :] * s_tod,
                     to.to(TO.dtype.element_ty), mask=omask)
        row0 = b * s_lb + h * s_lh + q0  # flat index of row 0 in (B, H, N_Q)
        tl.store(LSE + row0 + offs_m, lse, mask=mask_m)
        if STORE_MU:
            tl.store(MU + row0 + offs_m, mu, mask=mask_m)


_attn_fwd_kernel.fn.fn.add_pre_run_hook(_set_tma_boxes)  # autotune -> heuristics -> jit


def _scratch_args(scratch, o, lse):
    """The kernel's OP, TOP, LSEP, MUP: the tail-split scratch, or stand-ins it never touches."""
    if scratch is None:
        return o, o, lse, lse
    op, top, lsep, mup = scratch
    return op, op if top is None else top, lsep, mup


_N_TENSORS = 21  # Q ... SP_BITS: the kernel's leading tensor arguments


def _plan_key(q, k, v, tq, tk, tv, a: AttnArgs, store_mu: bool):
    """What fixes every non-tensor argument, the grid and the compiled variant of a forward launch
    without tensor options (kv_lens, mask, packed batch: their tensors are read from ``a``): the
    call's sizes and options, every input's strides, 16-byte alignment, the dtype, the device and
    the switches the launch reads. None where no plan is kept."""
    if a.kv_lens is not None or a.mask is not None or a.varlen is not None or a.sparse is not None \
            or not q.is_cuda \
            or not aligned16(q, k, v, tq, tk, tv):
        return None
    st = lambda x: None if x is None else x.stride()  # noqa: E731
    return ("fwd", a, q.dtype, q.device.index, q.stride(), k.stride(), v.stride(), st(tq), st(tk), st(tv), store_mu,
            allow_tf32(), tma_mode(), tail_split_enabled())


def _fwd_tensors(inputs, o, to, lse, mu, scratch, aux):
    """The kernel's leading tensor arguments, Q ... SP_BITS (stand-ins where absent, never read)."""
    return (*inputs, o, o if to is None else to, lse, lse if mu is None else mu,
            *_scratch_args(scratch, o, lse), *aux)


def attn_fwd(q, k, v, tq, tk, tv, a: AttnArgs, *, store_mu: bool = False,
             o: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Launch the fused kernel (Triton, whatever the route: ``_backends.run_fwd`` picks the
    backend). Returns ``(o, to, lse, mu)``; ``to`` and ``mu`` are ``None`` without tangents (``mu``
    also unless ``store_mu``). ``o``/``lse`` may be given to write into (contiguous buffers as
    ``out_buffer``/``stat_buffer`` make). The kernel always stores the log-sum-exp."""
    jvp = tq is not None or tk is not None or tv is not None
    store_mu = jvp and store_mu
    if o is None:
        o = out_buffer(a, q)
    if lse is None:
        lse = stat_buffer(a, q.device)
    to = out_buffer(a, q) if jvp else None
    mu = stat_buffer(a, q.device) if store_mu else None
    key = _plan_key(q, k, v, tq, tk, tv, a, store_mu)
    plan = None if key is None else PLANS.get(key)
    if plan is not None:  # the same launch as before: no argument to recompute
        with launch_device(q):
            plan(*_fwd_tensors((q, k, v, q if tq is None else tq, k if tk is None else tk, v if tv is None else tv),
                               o, to, lse, mu, None, aux_tensors(a, lse)))
        return o, to, lse, mu
    bdqk, bdv = head_blocks(a.d_qk, a.d_v)
    strides = all_seq_strides((q, k, v, tq, tk, tv, o, to), a)
    masks, mask_flags = mask_args(a)
    tma = a.varlen is None and use_tma((q, k, v, tq, tk, tv), kv_tangents=tk is not None or tv is not None,
                                       head_dims=(a.d_qk, a.d_v), n_k=a.n_k)
    # on the TMA path k, v, tk, tv go as host-made descriptors, one per slot (its box is set per
    # launch); q and tq as tensors (the kernel builds their descriptors: scratch memory)
    arg = (lambda x: _tma_descriptor(x, a.layout)) if tma else (lambda x: x)  # noqa: E731
    if tma:
        ensure_tma_allocator()
    kv = [arg(k), arg(v)]
    inputs = [q, *kv, q if tq is None else tq] + [p if t is None else arg(t) for p, t in zip(kv, (tk, tv))]
    # tail splitting (_split.py): a 1-D grid whose last programs are key shards of the last wave
    k_bucket = length_bucket(a.n_k)  # autotune key and split policy
    bounded = (a.causal is not None or a.window is not None or a.varlen is not None or a.mask is not None
               or a.sparse is not None)
    slots = split_slots(q, causal=bounded, n_k_bucket=k_bucket)  # not where row blocks differ in work
    n_blocks = lambda bm: triton.cdiv(a.n_q, bm) * a.h_q * a.batch  # noqa: E731
    scratch = (split_scratch(slots, bdv, jvp, q.device, {bm: n_blocks(bm) for bm in BLOCK_MS}, a.n_k)
               if slots else None)  # most launches: nothing to size
    capacity = 0 if scratch is None else scratch[0].shape[0]  # scratch rows

    def grid(meta):
        bm = meta["BLOCK_M"]
        if slots:
            return (split_grid(n_blocks(bm), slots, a.n_k, block_m=bm, capacity=capacity),)
        return (triton.cdiv(a.n_q, bm), a.h_q, a.batch)

    with launch_device(q):
        config, plan = plan_tuned(
            _attn_fwd_kernel, grid, _N_TENSORS,
            *_fwd_tensors(inputs, o, to, lse, mu, scratch, aux_tensors(a, lse)),
            *[s for st in strides for s in st], *stat_strides(a), *mask_strides(a),
            a.batch, a.h_q, a.groups, a.n_q, a.n_k, *masks, a.scale * LOG2E, a.scale, max(slots, 1),
            N_Q_BUCKET=length_bucket(a.n_q), N_K_BUCKET=k_bucket,
            D_QK=a.d_qk, D_V=a.d_v, BLOCK_DQK=bdqk, BLOCK_DV=bdv, **mask_flags,
            KEY_TAIL=a.n_k % MAX_BLOCK_N != 0 or a.kv_lens is not None or a.varlen is not None,
            HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
            STORE_MU=mu is not None, DOT_PREC=dot_precision(q.dtype),
            ALIGN=vector_align(strides, a.d_qk, a.d_v), TMA=tma, SPLIT=slots > 0,
            HAS_KV_LENS=a.kv_lens is not None, SP_RUNS=a.sparse is not None and a.sparse.runs,
        )
    if key is not None and plan is not None and not tma and not slots:  # one launch, tensors only: kept
        PLANS.put(key, plan)
    if scratch:
        bm = config["BLOCK_M"]
        attn_merge(o, to, lse, mu, scratch, strides[6:], h_q=a.h_q, n_q=a.n_q, d_v=a.d_v,
                   block_m=bm, block_dv=bdv, n_blocks=n_blocks(bm), slots=slots, n_k=a.n_k)
    return o, to, lse, mu
