"""Sequence parallelism with tangents over ``torch.distributed``: Ulysses attention.

Each rank of ``group`` holds a contiguous shard of the sequence, ``N / P`` rows of q, k and v
(rank r: rows ``[r N/P, (r+1) N/P)``). One all-to-all per tensor turns the sequence shards into
head shards (every rank: the whole sequence for ``H / P`` heads), flashjvp's kernels run on them,
and one all-to-all turns the output back into sequence shards. The exchange is linear, so its
tangent is the same exchange of the tangent and its gradient the inverse exchange: the function
works under ``torch.func.jvp`` and ``forward_ad`` (fused forward+JVP kernel per rank) and
backward, through NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashjvp

__all__ = ["ulysses_attention", "ulysses_attention_jvp"]


def _world(group) -> int:
    return dist.get_world_size(group)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, N/P, H, D) on each rank -> (B, N, H/P, D): rank r gets heads [r H/P, (r+1) H/P)."""
    p = _world(group)
    b, n, h, d = x.shape
    send = x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, N/P, H/P, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's rows of my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: (B, N, H/P, D) -> (B, N/P, H, D)."""
    p = _world(group)
    b, n, h, d = x.shape
    send = x.reshape(b, p, n // p, h, d).permute(1, 0, 2, 3, 4).contiguous()  # (P, B, N/P, H/P, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: my rows of rank r's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // p, p * h, d)


class _Exchange(torch.autograd.Function):
    """One all-to-all, ``to_heads=True``: sequence shards to head shards, else back. Linear: the
    tangent takes the same exchange, the gradient the inverse one."""

    @staticmethod
    def forward(x, group, to_heads: bool):
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.to_heads = inputs[1], inputs[2]

    @staticmethod
    def jvp(ctx, t, *_):
        return (_seq_to_heads if ctx.to_heads else _heads_to_seq)(t, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(g, ctx.group), None, None


def _check(q, k, v, tangents, group, layout):
    """Shapes Ulysses needs, the same on every rank (one small all-gather of the sizes)."""
    if not dist.is_initialized():
        raise RuntimeError("flashjvp.distributed: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    p = _world(group)
    if layout not in ("bhnd", "bnhd"):
        raise ValueError(f"layout: expected 'bhnd' or 'bnhd', got {layout!r}")
    seq = 2 if layout == "bhnd" else 1
    head = 1 if layout == "bhnd" else 2
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-d tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if x.shape[head] % p:
            raise ValueError(f"{name}: expected a number of heads divisible by the group size {p}, "
                             f"got {x.shape[head]}")
    for name, t, x in zip(("tq", "tk", "tv"), tangents, (q, k, v)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name}: expected shape {tuple(x.shape)} (that of {name[1]}), got {tuple(t.shape)}")
    sizes = torch.tensor([q.shape[seq], k.shape[seq]], dtype=torch.int64,
                         device=q.device if q.is_cuda else "cpu")
    every = [torch.empty_like(sizes) for _ in range(p)]
    dist.all_gather(every, sizes, group=group)
    if any(not torch.equal(s, every[0]) for s in every):
        raise ValueError("flashjvp.distributed: every rank must hold a shard of the same length; got "
                         f"(q rows, k rows) per rank {[tuple(s.tolist()) for s in every]}")


def _to_bnhd(x, layout):
    return x if (x is None or layout == "bnhd") else x.transpose(1, 2)


def ulysses_attention(q, k, v, *, group=None, causal=False, scale=None, layout="bnhd"):
    """Attention over a sequence sharded across the ranks of ``group`` (DeepSpeed-Ulysses).

    Args:
        q: this rank's shard, (B, Nq/P, Hq, Dqk) for ``layout="bnhd"`` (or (B, Hq, Nq/P, Dqk)
            for ``"bhnd"``): rows ``[r Nq/P, (r+1) Nq/P)`` of the sequence on rank ``r``.
        k, v: (B, Nk/P, Hkv, Dqk) and (B, Nk/P, Hkv, Dv) shards, likewise. ``Hq`` and ``Hkv``
            must be divisible by the group size ``P``; every rank's shards have the same length.
        group: the process group (default: the world).
        causal, scale: as in :func:`flashjvp.attention`, over global positions.

    Returns:
        this rank's shard of the output, (B, Nq/P, Hq, Dv) (or bhnd).

    Differentiable, and forward-differentiable (``torch.func.jvp``, ``forward_ad``): tangents
    take the same all-to-all as their primals, each rank runs the fused forward+JVP kernel.
    """
    _check(q, k, v, (None, None, None), group, layout)
    q, k, v = (_Exchange.apply(_to_bnhd(x, layout), group, True) for x in (q, k, v))
    o = flashjvp.attention(q, k, v, causal=causal, scale=scale, layout="bnhd")
    return _to_bnhd(_Exchange.apply(o, group, False), layout)


def ulysses_attention_jvp(q, k, v, tq=None, tk=None, tv=None, *, group=None, causal=False, scale=None,
                          layout="bnhd"):
    """:func:`ulysses_attention` and its tangent ``(o, to)`` for explicit tangents (``None`` is
    zero), each primal sent in one all-to-all together with its tangent."""
    _check(q, k, v, (tq, tk, tv), group, layout)

    def exchange(x, t, to_heads):  # primal and tangent stacked along the batch: one call
        x, t = _to_bnhd(x, layout), _to_bnhd(t, layout)
        if t is None:
            return _Exchange.apply(x, group, to_heads), None
        both = _Exchange.apply(torch.cat((x, t)), group, to_heads)
        return both[: x.shape[0]], both[x.shape[0]:]

    (q, tq), (k, tk), (v, tv) = (exchange(x, t, True) for x, t in ((q, tq), (k, tk), (v, tv)))
    o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, scale=scale, layout="bnhd")
    o, to = exchange(o, to, False)
    return _to_bnhd(o, layout), _to_bnhd(to, layout)
