"""Tail splitting for the forward kernel: the last, partial wave of row blocks runs in key shards.

When the last wave of a long non-causal launch is at most half full (``_policy.split_plan``), its
``R`` row blocks run as ``s`` programs each, every one over a contiguous shard of the keys, which
write ``o``, ``to``, ``lse`` and ``mu`` of their shard to a small float32 scratch; ``attn_merge``
then combines the shards of each row exactly (docs/math.md, "Merging partial results"):

    LSE = logsumexp_i LSE_i ;  w_i = exp(LSE_i - LSE) ;  O = sum w_i O_i ;  mu = sum w_i mu_i
    tO = sum w_i (tO_i + mu_i O_i) - mu O

Programs are launched in order (full row blocks first, shards last), so the shards fill the SMs
that the full blocks free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashjvp._jit import LN2_K, LOG2E_K
from flashjvp._launch import LaunchLog, launch_device, new_buffer, record_launch
from flashjvp._policy import split_plan


@triton.jit
def split_decode(n_blocks, SLOTS):
    """In the kernel: ``(block, shard, part, shards)`` of this program under ``split_plan``
    (``part``: index into the scratch, negative for a whole row block, which is one shard)."""
    pid = tl.program_id(0)
    tail = n_blocks % SLOTS
    split = tl.num_programs(0) > n_blocks
    n_full = n_blocks - tl.where(split, tail, 0)
    shards = 1 + (tl.num_programs(0) - n_blocks) // tl.maximum(tail, 1)
    part = pid - n_full
    block = tl.where(part >= 0, n_full + part // shards, pid)
    shard = tl.where(part >= 0, part % shards, 0)
    return block, shard, part, tl.where(part >= 0, shards, 1)


def split_scratch(slots: int, block_dv: int, jvp: bool, device, blocks: dict[int, int], n_k: int):
    """float32 scratch of the shards, ``(o, to, lse, mu)`` (``to`` None without tangents), with
    room for the largest tail any candidate tile would split (``blocks``: BLOCK_M -> row-block
    programs); None where none of them splits (or ``slots`` is 0). A tile whose BLOCK_M is not
    among them (a forced one) splits only where its shards fit (``split_plan``'s capacity)."""
    rows = 0
    for bm, nb in blocks.items():
        n_full, shards = split_plan(nb, slots, n_k)
        if shards > 1:
            rows = max(rows, (nb - n_full) * shards * bm)
    if not rows:
        return None
    o = new_buffer((rows, block_dv), torch.float32, device)
    to = new_buffer((rows, block_dv), torch.float32, device) if jvp else None
    return o, to, new_buffer((rows,), torch.float32, device), new_buffer((rows,), torch.float32, device)


@triton.jit
def _attn_merge_kernel(
    O, TO, LSE, MU, OP, TOP, LSEP, MUP,
    s_ob, s_oh, s_on, s_od, s_tob, s_toh, s_ton, s_tod,
    H_Q, N_Q, D_V, N_FULL, SHARDS, BLOCK_M,
    ROWS: tl.constexpr, BLOCK_DV: tl.constexpr, JVP: tl.constexpr, STORE_MU: tl.constexpr,
):
    """Program (i, j): rows [j * ROWS, (j + 1) * ROWS) of split row block N_FULL + i; merges its
    SHARDS partial results into the outputs."""
    t = N_FULL + tl.program_id(0)  # the row block, numbered as in the forward kernel
    n_mb = tl.cdiv(N_Q, BLOCK_M)
    bh = t // n_mb
    m0 = (t % n_mb) * BLOCK_M + tl.program_id(1) * ROWS  # first row of this program
    h = (bh % H_Q).to(tl.int64)
    b = (bh // H_Q).to(tl.int64)
    rows = tl.arange(0, ROWS)  # (ROWS,)
    offs_dv = tl.arange(0, BLOCK_DV)  # (BLOCK_DV,)
    first = tl.program_id(0) * SHARDS * BLOCK_M + tl.program_id(1) * ROWS  # scratch row of shard 0

    m = tl.full([ROWS], float("-inf"), tl.float32)  # max over shards of lse_i
    for i in range(SHARDS):
        m = tl.maximum(m, tl.load(LSEP + first + i * BLOCK_M + rows))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # rows no shard saw a key of
    z = tl.zeros([ROWS], tl.float32)
    for i in range(SHARDS):
        z += tl.math.exp2((tl.load(LSEP + first + i * BLOCK_M + rows) - m_safe) * LOG2E_K)
    lse = tl.where(m == float("-inf"), float("-inf"), m_safe + tl.math.log2(tl.maximum(z, 1.0)) * LN2_K)
    lse_safe = tl.where(m == float("-inf"), 0.0, lse)

    o = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    acc_t = tl.zeros([ROWS, BLOCK_DV], tl.float32)  # sum w_i (tO_i + mu_i O_i)
    mu = tl.zeros([ROWS], tl.float32)
    for i in range(SHARDS):
        part = first + i * BLOCK_M + rows  # (ROWS,) scratch rows
        w = tl.math.exp2((tl.load(LSEP + part) - lse_safe) * LOG2E_K)  # (ROWS,), 0 for empty shards
        o_i = tl.load(OP + part[:, None] * BLOCK_DV + offs_dv[None, :])  # (ROWS, BLOCK_DV)
        o += w[:, None] * o_i
        if JVP:
            mu_i = tl.load(MUP + part)  # (ROWS,)
            mu += w * mu_i
            acc_t += w[:, None] * (tl.load(TOP + part[:, None] * BLOCK_DV + offs_dv[None, :]) + mu_i[:, None] * o_i)

    rmask = rows < N_Q - m0  # (ROWS,)
    omask = rmask[:, None] & (offs_dv < D_V)[None, :]  # (ROWS, BLOCK_DV)
    tl.store(O + b * s_ob + h * s_oh + (m0 + rows)[:, None] * s_on + offs_dv[None, :] * s_od,
             o.to(O.dtype.element_ty), mask=omask)
    row0 = (b * H_Q + h) * N_Q + m0  # flat index of row m0 in (B, H, N_Q)
    tl.store(LSE + row0 + rows, lse, mask=rmask)
    if JVP:
        to = acc_t - mu[:, None] * o  # (ROWS, BLOCK_DV)
        tl.store(TO + b * s_tob + h * s_toh + (m0 + rows)[:, None] * s_ton + offs_dv[None, :] * s_tod,
                 to.to(TO.dtype.element_ty), mask=omask)
        if STORE_MU:
            tl.store(MU + row0 + rows, mu, mask=rmask)


def attn_merge(o, to, lse, mu, scratch, strides, *, h_q: int, n_q: int, d_v: int, block_m: int,
               block_dv: int, n_blocks: int, slots: int, n_k: int) -> bool:
    """Merge the shards the forward kernel wrote to ``scratch`` (``split_scratch``) into
    ``o``/``to``/``lse``/``mu`` (``to``/``mu`` may be None); ``strides``: (B, H, N, D) strides of
    ``o`` and ``to``. Returns whether the launch was split (else nothing to do)."""
    op, top, lsep, mup = scratch
    n_full, shards = split_plan(n_blocks, slots, n_k, block_m=block_m, capacity=op.shape[0])
    if shards == 1:
        return False
    with launch_device(o):
        rows = min(block_m, 16)  # 16-row programs: three (16, BLOCK_DV) float32 tiles in registers
        _attn_merge_kernel[(n_blocks - n_full, block_m // rows)](
            o, o if to is None else to, lse, lse if mu is None else mu,
            op, op if top is None else top, lsep, mup, *strides[0], *strides[1],
            h_q, n_q, d_v, n_full, shards, block_m,
            ROWS=rows, BLOCK_DV=block_dv, JVP=to is not None, STORE_MU=mu is not None,
        )
    if LaunchLog._active:
        record_launch("_attn_merge_kernel", {"ROWS": rows}, SHARDS=shards)
    return True
