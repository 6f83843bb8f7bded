"""Device-side helpers shared by the Triton kernels, and the base-2 constants.

The kernels work in base 2 (exp2 and log2 are single instructions): exp(x) == exp2(x * LOG2E) and
log(x) == log2(x) * LN2. Host code uses the floats, kernels the constexpr twins.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(LN2)


@triton.jit
def aligned(x, ALIGN: tl.constexpr):
    """``x`` rounded down to a multiple of ALIGN: the same value where the host checked
    (``vector_align``), written so that Triton's alignment analysis sees the multiple
    (``tl.multiple_of`` on a scalar argument is dropped by Triton 3.6)."""
    return (x // ALIGN) * ALIGN


@triton.jit
def aligned3(a, b, c, ALIGN: tl.constexpr):
    """``aligned`` for the (batch, head, sequence) strides of one tensor."""
    return aligned(a, ALIGN), aligned(b, ALIGN), aligned(c, ALIGN)


@triton.jit
def load_tile(ptrs, mask0, mask1, MASK0: tl.constexpr, MASK1: tl.constexpr):
    """Load a 2-d tile, masking rows (``mask0``) and/or columns (``mask1``) only where asked,
    so that interior tiles compile to unmasked loads. Masked elements read as zero."""
    if MASK0 and MASK1:
        x = tl.load(ptrs, mask=mask0[:, None] & mask1[None, :], other=0.0)
    elif MASK0:
        x = tl.load(ptrs, mask=mask0[:, None], other=0.0)
    elif MASK1:
        x = tl.load(ptrs, mask=mask1[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def sequence(CU_Q, CU_K, KV_LENS, b, N_Q, N_K, VARLEN: tl.constexpr, HAS_KV_LENS: tl.constexpr):
    """Where batch element ``b`` lies: ``(q0, n_q, k0, n_k, n_kv)``, its first query row and key
    in the tensors (0 unless VARLEN: packed sequences at the offsets ``CU_Q``/``CU_K``), its query
    and key counts, and how many of its keys are valid (``n_k`` clamped by ``KV_LENS``)."""
    if VARLEN:
        q0 = tl.load(CU_Q + b)
        k0 = tl.load(CU_K + b)
        n_q = tl.load(CU_Q + b + 1) - q0
        n_k = tl.load(CU_K + b + 1) - k0
        q0 = q0.to(tl.int64)
        k0 = k0.to(tl.int64)
    else:
        q0 = b * 0
        k0 = b * 0
        n_q = N_Q
        n_k = N_K
    n_kv = n_k
    if HAS_KV_LENS:
        n_kv = tl.minimum(tl.maximum(tl.load(KV_LENS + b), 0), n_k)
    return q0, n_q, k0, n_k, n_kv


@triton.jit
def diagonals(n_q, n_k, bottom_right, win_r, win_l):
    """``(off_r, off_l)``: query ``i`` sees key ``j`` only if ``i + off_l <= j <= i + off_r`` (each
    bound where its flag is set: RIGHT for causal attention or a window's right side, LEFT for a
    window's left side). The diagonal is ``n_k - n_q`` for bottom-right alignment, else 0."""
    diag = bottom_right * (n_k - n_q)
    return diag + win_r, diag - win_l


@triton.jit
def visible(rows, keys, n_kv, off_r, off_l, RIGHT: tl.constexpr, LEFT: tl.constexpr):
    """(len(rows), len(keys)) bool: which keys each query row sees."""
    vis = (keys < n_kv)[None, :]
    if RIGHT:
        vis = vis & (keys[None, :] <= rows[:, None] + off_r)
    if LEFT:
        vis = vis & (keys[None, :] >= rows[:, None] + off_l)
    return vis


@triton.jit
def key_blocks(m0, n_kv, off_r, off_l, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               RIGHT: tl.constexpr, LEFT: tl.constexpr):
    """Key ranges for query rows [m0, m0 + BLOCK_M): ``(lo, full_lo, full_hi, hi)``. Keys in
    [full_lo, full_hi) (whole blocks) are visible to every row and need no mask; [lo, full_lo) and
    [full_hi, hi) need it; keys outside [lo, hi) are seen by no row of the block."""
    lo = m0 * 0
    full_lo = m0 * 0
    full_hi = (n_kv // BLOCK_N) * BLOCK_N
    hi = n_kv
    if RIGHT:
        hi = tl.minimum(n_kv, tl.maximum(m0 + BLOCK_M + off_r, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + off_r + 1, 0) // BLOCK_N) * BLOCK_N)
    if LEFT:
        lo = tl.minimum((tl.maximum(m0 + off_l, 0) // BLOCK_N) * BLOCK_N, hi)
        full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + off_l, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_blocks(n0, n_q, off_r, off_l, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 RIGHT: tl.constexpr, LEFT: tl.constexpr):
    """Query ranges for keys [n0, n0 + BLOCK_N), as ``key_blocks`` for rows: ``(lo, full_lo,
    full_hi, hi)``, multiples of BLOCK_M (rows past ``n_q`` are masked by the caller)."""
    m_end = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
    lo = n0 * 0
    full_lo = n0 * 0
    full_hi = m_end
    hi = m_end
    if RIGHT:  # row i sees key j only if i >= j - off_r
        lo = tl.minimum((tl.maximum(n0 - off_r, 0) // BLOCK_M) * BLOCK_M, m_end)
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - off_r, 0), BLOCK_M) * BLOCK_M
    if LEFT:  # ... and i <= j - off_l
        hi = tl.minimum(m_end, tl.cdiv(tl.maximum(n0 + BLOCK_N - off_l, 0), BLOCK_M) * BLOCK_M)
        full_hi = (tl.maximum(n0 - off_l + 1, 0) // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def mask_bias(base, rows, keys, n_q, n_k, s_mm, s_mn, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The (len(rows), len(keys)) tile of an attention mask at ``base`` (one batch element and
    head; strides ``s_mm`` along query rows, ``s_mn`` along keys) as an additive float32 bias in
    natural-log units: a boolean mask (bytes, non-zero = attend) gives 0 or -inf, a float mask
    itself. Without MASK_ROWS (a key-padding mask: the same for every row) one key vector is read."""
    kin = keys < n_k
    if MASK_ROWS:
        x = tl.load(base + rows[:, None] * s_mm + keys[None, :] * s_mn,
                    mask=(rows < n_q)[:, None] & kin[None, :], other=0)
    else:
        x = tl.load(base + keys * s_mn, mask=kin, other=0)[None, :]
    if MASK_BOOL:
        x = tl.where(x != 0, 0.0, float("-inf"))
    x = x.to(tl.float32)
    if not MASK_ROWS:
        x = tl.broadcast_to(x, [rows.shape[0], keys.shape[0]])
    return x


@triton.jit
def sparse_start(lst, pos, SP_B: tl.constexpr):
    """Block-sparse iteration (``_sparse.SparsePlan``): the loops of a program run over
    virtual positions ``pos`` (multiples of the tile, ``SP_B`` per listed block); entry ``j``
    of the block list ``lst`` names the mask block. Returns ``(start, j)``: the first row or
    key of the tile in the sequence, and the entry."""
    j = pos // SP_B
    return tl.load(lst + 2 + j) * SP_B + pos % SP_B, j


@triton.jit
def sparse_bits(BITS, lst, j, rows, keys, maxb, SP_BM: tl.constexpr, SP_BN: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """Which (row, key) pairs of list entry ``j`` are visible: its partial block's bitmask tile
    (all True for a full block, slot -1), (len(rows), len(keys)) bool, or (len(keys), len(rows))
    when TRANSPOSED."""
    WORDS: tl.constexpr = (SP_BN + 31) // 32
    slot = tl.load(lst + 2 + maxb + j)
    base = BITS + slot.to(tl.int64) * (SP_BM * WORDS)
    r = rows % SP_BM
    c = keys % SP_BN
    # The load mask (listed: slot >= 0) compares the slot broadcast to the tile, rather than broadcasting
    # a scalar compare: Triton 3.9's interpreter gives a broadcast scalar compare the int32 dtype of its
    # operand, which its load rejects as a mask. Compiled, it folds to one scalar compare of the slot.
    if TRANSPOSED:
        offs = r[None, :] * WORDS + (c // 32)[:, None]  # (len(keys), len(rows))
        w = tl.load(base + offs, mask=tl.broadcast_to(slot, offs.shape) >= 0, other=-1)
        vis = ((w >> (c % 32)[:, None]) & 1) != 0
    else:
        offs = r[:, None] * WORDS + (c // 32)[None, :]  # (len(rows), len(keys))
        w = tl.load(base + offs, mask=tl.broadcast_to(slot, offs.shape) >= 0, other=-1)
        vis = ((w >> (c % 32)[None, :]) & 1) != 0
    return vis


@triton.jit
def sparse_list(LIST, b, h, blk, s_b, s_h, s_n):
    """``(lst, n_full, n_partial, maxb)``: the block list of (``b``, ``h``, block ``blk``)."""
    lst = LIST + b * s_b + h * s_h + blk * s_n
    return lst, tl.load(lst), tl.load(lst + 1), (s_n - 2) // 2
