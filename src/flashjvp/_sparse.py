"""FlexAttention ``BlockMask`` as the kernels read it: per block row (and per block column, for
dK/dV) the full blocks first and then the partial ones, and one bitmask tile per partial block.

``SparsePlan`` is built once per ``BlockMask`` (``plan_of``) and cached on the mask object. Its
``row`` tensor is (Bm, Hm, NQB, 2 + 2 * MAXR) int32: per query block ``[n_full, n_partial,
block indices (full first, then partial), bitmask slots (-1 for full blocks)]``; ``col`` is the
same per key block over query blocks. ``bits`` is (P + 1, BLOCK_M, ceil(BLOCK_N / 32)) int32:
bit ``c % 32`` of word ``c // 32`` of row ``r`` of slot ``s`` says whether query ``r`` of that
partial block sees its key ``c`` (``mask_mod`` evaluated once, keys past ``KV_LEN`` cleared).
Memory is O(partial blocks x tile / 32) words, never Nq x Nk. A full block that reaches past
the last key is listed as partial, so that full blocks load their keys unmasked. Where every
list's full blocks are consecutive (``runs``), the kernels' unmasked loops step through the keys
(queries) from the first full block instead of reading each block's index from the list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# mask_mod is evaluated on this many (query, key) pairs at a time
_CHUNK_PAIRS = 1 << 24


@dataclass(frozen=True)
class SparsePlan:
    row: torch.Tensor  # (Bm, Hm, NQB, 2 + 2 * MAXR) int32
    col: torch.Tensor  # (Bm, Hm, NKB, 2 + 2 * MAXC) int32
    bits: torch.Tensor  # (P + 1, block_m, words) int32
    block_m: int
    block_n: int
    visible: float  # share of the (query, key) pairs that the mask lets through (benchmarks)
    n_q: int
    n_k: int
    # every row's and column's full blocks are consecutive (causal-like, frame-causal, document and
    # window masks): the kernels then run the unmasked loop from the first one, as without a mask
    runs: bool = False


def dense_mask(plan: SparsePlan) -> torch.Tensor:
    """The (Bm, Hm, Nq, Nk) bool mask a plan stands for (the math reference's form: O(Nq * Nk))."""
    row, bm, bn = plan.row, plan.block_m, plan.block_n
    nqb, nkb = row.shape[2], plan.col.shape[2]
    width = (row.shape[-1] - 2) // 2
    n_full, n_part, idx, slot = row[..., 0], row[..., 1], row[..., 2:2 + width].long(), row[..., 2 + width:].long()
    listed = torch.arange(width, device=row.device) < (n_full + n_part)[..., None]
    # per block: -2 empty, -1 full, else its bitmask slot (1 ... P)
    slots = torch.full((*row.shape[:3], nkb + 1), -2, dtype=torch.long, device=row.device)
    slots.scatter_(-1, torch.where(listed, idx, nkb), torch.where(listed, slot, -2))
    slots = slots[..., :nkb]
    shifts = torch.arange(32, device=row.device, dtype=torch.int32)
    tiles = ((plan.bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :bn]  # (P + 1, BM, BN)
    vis = tiles[slots.clamp(min=0)] | (slots == -1)[..., None, None]  # (Bm, Hm, NQB, NKB, BM, BN)
    vis = vis.permute(0, 1, 2, 4, 3, 5).reshape(*row.shape[:2], nqb * bm, nkb * bn)
    return vis[..., :plan.n_q, :plan.n_k]


def _block_state(bm, nqb: int, nkb: int) -> torch.Tensor:
    """(Bm, Hm, NQB, NKB) int8: 0 empty, 1 partial, 2 full."""
    kv_num = bm.kv_num_blocks[..., :nqb]
    state = torch.zeros(*kv_num.shape, nkb + 1, dtype=torch.int8, device=kv_num.device)
    pairs = [(bm.kv_num_blocks, bm.kv_indices, 1)]
    if bm.full_kv_num_blocks is not None:
        pairs.append((bm.full_kv_num_blocks, bm.full_kv_indices, 2))
    for num, idx, value in pairs:
        num, idx = num[..., :nqb], idx[..., :nqb, :]
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        cols = torch.where(valid, idx.long().clamp(0, nkb - 1), nkb)  # invalid entries: the spare column
        state.scatter_(-1, cols, torch.full_like(cols, value, dtype=torch.int8))
    return state[..., :nkb]


def _lists(state: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Per block row of ``state`` (..., R, C): ``[n_full, n_partial, indices..., slots...]``."""
    c = state.shape[-1]
    rank = torch.where(state == 2, 0, torch.where(state == 1, 1, 2)).long() * c
    order = (rank + torch.arange(c, device=state.device)).argsort(-1)
    n_full = (state == 2).sum(-1, keepdim=True)
    n_part = (state == 1).sum(-1, keepdim=True)
    width = max(int((n_full + n_part).max()), 1)
    idx = order[..., :width]
    return torch.cat([n_full, n_part, idx, slot.gather(-1, idx)], -1).to(torch.int32).contiguous()


def _mask_fn(mask_mod):
    """``mask_mod`` over (P,) batch/head indices and (P, BM) queries x (P, BN) keys: (P, BM, BN)."""
    vmap = torch.func.vmap
    fn = vmap(mask_mod, in_dims=(None, None, None, 0))
    fn = vmap(fn, in_dims=(None, None, 0, None))
    return vmap(fn, in_dims=(0, 0, 0, 0))


def _bits(bm, where: torch.Tensor, block_m: int, block_n: int, n_q: int, n_k: int) -> torch.Tensor:
    """(P + 1, block_m, words) int32 bitmask tiles of the partial blocks ``where`` (P, 4)."""
    words = -(-block_n // 32)
    dev = where.device
    out = torch.zeros(where.shape[0] + 1, block_m, words, dtype=torch.int32, device=dev)
    fn = _mask_fn(bm.mask_mod)
    rq, rk = torch.arange(block_m, device=dev), torch.arange(block_n, device=dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int64)
    step = max(1, _CHUNK_PAIRS // (block_m * block_n))
    for s in range(0, where.shape[0], step):
        b, h, qb, kb = where[s:s + step].unbind(1)
        qi = qb[:, None] * block_m + rq  # (P', BM)
        ki = kb[:, None] * block_n + rk  # (P', BN)
        m = fn(b, h, qi.clamp(max=n_q - 1), ki.clamp(max=n_k - 1)).to(torch.bool)  # (P', BM, BN)
        m = m & (ki < n_k)[:, None, :]
        m = torch.nn.functional.pad(m, (0, words * 32 - block_n)).view(m.shape[0], block_m, words, 32)
        w = (m.long() << shifts).sum(-1)  # (P', BM, words) in [0, 2^32)
        out[1 + s:1 + s + m.shape[0]] = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return out


def build_plan(bm) -> SparsePlan:
    """The kernels' ``SparsePlan`` of a FlexAttention ``BlockMask`` (see the module docstring)."""
    block_m, block_n = bm.BLOCK_SIZE
    n_q, n_k = bm.seq_lengths
    nqb, nkb = -(-n_q // block_m), -(-n_k // block_n)
    state = _block_state(bm, nqb, nkb)
    if n_k % block_n:  # full blocks past the last key: masked like partial ones
        state[..., -1] = torch.where(state[..., -1] == 2, 1, state[..., -1])
    part = state == 1
    slot = torch.where(part, part.flatten().long().cumsum(0).view(part.shape), 0)  # 1-based: slot 0 is spare
    where = part.nonzero()
    bits = _bits(bm, where, block_m, block_n, n_q, n_k)
    slot = torch.where(part, slot, -1)
    # share of visible pairs: full blocks (clipped at the sequence ends) and the bits set
    rows = (n_q - torch.arange(nqb, device=state.device) * block_m).clamp(max=block_m)
    keys = (n_k - torch.arange(nkb, device=state.device) * block_n).clamp(max=block_n)
    full = ((state == 2) * rows[:, None] * keys[None, :]).sum()
    partial = _popcount(bits[1:], where, block_m, rows)
    visible = float(full + partial) / (state.shape[0] * state.shape[1] * n_q * n_k)
    row, col = _lists(state, slot), _lists(state.transpose(-1, -2), slot.transpose(-1, -2))
    return SparsePlan(row, col, bits, block_m, block_n, visible, n_q, n_k, _full_runs(row) and _full_runs(col))


def _full_runs(lists: torch.Tensor) -> bool:
    """Whether the full blocks of every list are consecutive (listed in ascending order)."""
    n_full, first = lists[..., 0].long(), lists[..., 2].long()
    last = lists[..., 2:].gather(-1, (n_full - 1).clamp(min=0)[..., None])[..., 0].long()
    return bool(((n_full == 0) | (last - first == n_full - 1)).all())


def _popcount(bits: torch.Tensor, where: torch.Tensor, block_m: int, rows: torch.Tensor) -> int:
    """Set bits of the partial tiles, counting only rows below the query count."""
    if bits.shape[0] == 0:
        return 0
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    per_row = ((bits[..., None] >> shifts) & 1).sum((-1, -2))  # (P, BM)
    live = torch.arange(block_m, device=bits.device)[None, :] < rows[where[:, 2]][:, None]
    return int((per_row * live).sum())


def _unwrapped(x: torch.Tensor) -> torch.Tensor:
    """``x`` without the wrappers of ``torch.func`` levels (a plan first built inside a transform
    outlives it, and the kernels read memory)."""
    fn = torch._C._functorch
    while fn.is_functorch_wrapped_tensor(x) and not fn.is_batchedtensor(x):
        x = fn.get_unwrapped(x)
    return x


def plan_of(bm) -> SparsePlan:
    """``bm``'s plan, built on first use and kept on the mask object (a BlockMask's tensors are
    not changed in place by FlexAttention)."""
    plan = getattr(bm, "_flashjvp_plan", None)
    if plan is None:
        plan = build_plan(bm)
        plan = dataclasses.replace(plan, row=_unwrapped(plan.row), col=_unwrapped(plan.col),
                                   bits=_unwrapped(plan.bits))
        bm._flashjvp_plan = plan
    return plan


def list_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, block) strides of a plan list; 0 along a broadcast (size-1) dim."""
    return (0 if t.shape[0] == 1 else t.stride(0), 0 if t.shape[1] == 1 else t.stride(1), t.stride(2))
