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
def key_range(m0, N_K, causal_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key blocks for query rows [m0, m0 + BLOCK_M): ``[0, full_end)`` are visible to every row
    (no mask needed), ``[full_end, hi)`` need the bounds/causal mask."""
    full_end = (N_K // BLOCK_N) * BLOCK_N
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, tl.maximum(m0 + BLOCK_M + causal_off, 0))
        full_end = tl.minimum(full_end, (tl.maximum(m0 + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    return full_end, hi
