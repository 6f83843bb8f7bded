"""Sequence parallelism with tangents over ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Each rank of ``group`` holds a shard of the sequence of q, k and v.

* Ulysses (:func:`ulysses_attention`): rank r holds rows ``[r N/P, (r+1) N/P)``. One all-to-all
  per tensor turns the sequence shards into head shards (every rank: the whole sequence for
  ``H / P`` heads), flashjvp's kernels run on them, one all-to-all turns the output back. The
  exchange is linear: its tangent is the same exchange of the tangent, its gradient the inverse.
* Ring (:func:`ring_attention`): the key/value shards (and their tangents) travel around the ring
  while each rank attends its queries to the shard it holds; the partial results are merged
  exactly with their log-sum-exp and its tangent (docs/math.md, "Merging results over key
  shards"). Causal attention uses the zig-zag layout (:func:`zigzag_shard`) so that every rank
  does the same work. A rank holds the shards it receives and attends to several at a time, one
  launch over their keys (``kv_blocks_per_launch``). The backward passes dK, dV around the ring
  with the keys and values, one shard at a time.

Both work under ``torch.func.jvp`` and ``forward_ad`` (fused forward+JVP kernel per rank and
shard) and backward.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist

import flashjvp
from flashjvp._backends import route_of, run_bwd
from flashjvp._validate import LAYOUTS, _norm_causal, _norm_scale, check_inputs

__all__ = ["ulysses_attention", "ulysses_attention_jvp", "ring_attention", "ring_attention_jvp", "zigzag_shard",
           "zigzag_unshard"]


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
    def jvp(ctx, t, *_):  # through apply: the tangent stays differentiable (second order)
        return _Exchange.apply(t, ctx.group, ctx.to_heads)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(g, ctx.group), None, None


def _check(q, k, v, tangents, group, layout, heads=True):
    """Shapes the exchanges need (``heads``: head counts divisible by the group size, for
    Ulysses), the same on every rank (one small all-gather of the sizes)."""
    if not dist.is_initialized():
        raise RuntimeError("flashjvp.distributed: torch.distributed is not initialised "
                           "(call torch.distributed.init_process_group first)")
    p = _world(group)
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    seq = 2 if layout == "bhnd" else 1
    head = 1 if layout == "bhnd" else 2
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            want = "(B, H, N/P, D)" if layout == "bhnd" else "(B, N/P, H, D)"
            raise ValueError(f"{name}: expected a 4-d shard {want} for layout={layout!r}, got shape {tuple(x.shape)}")
        if heads and x.shape[head] % p:
            raise ValueError(f"{name}: expected a number of heads divisible by the group size {p}, "
                             f"got {x.shape[head]}")
    for name, t, x in zip(("tq", "tk", "tv"), tangents, (q, k, v)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
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


def ulysses_attention(q, k, v, *, group=None, causal=False, scale=None, layout="bhnd"):
    """Attention over a sequence sharded across the ranks of ``group`` (DeepSpeed-Ulysses).

    Args:
        q: this rank's shard, (B, Hq, Nq/P, Dqk) for ``layout="bhnd"`` (the default, as in
            :func:`flashjvp.attention`) or (B, Nq/P, Hq, Dqk) for ``"bnhd"``: rows
            ``[r Nq/P, (r+1) Nq/P)`` of the sequence on rank ``r``.
        k, v: (B, Hkv, Nk/P, Dqk) and (B, Hkv, Nk/P, Dv) shards (or bnhd), likewise. ``Hq`` and
            ``Hkv`` must be divisible by the group size ``P``; every rank's shards have the same length.
        group: the process group (default: the world).
        causal, scale: as in :func:`flashjvp.attention`, over global positions.
        layout: ``"bhnd"`` or ``"bnhd"``; the output uses the same one.

    Returns:
        this rank's shard of the output, (B, Hq, Nq/P, Dv) (or bnhd).

    Differentiable, and forward-differentiable (``torch.func.jvp``, ``forward_ad``): tangents
    take the same all-to-all as their primals, each rank runs the fused forward+JVP kernel.
    """
    _check(q, k, v, (None, None, None), group, layout)
    q, k, v = (_Exchange.apply(_to_bnhd(x, layout), group, True) for x in (q, k, v))
    o = flashjvp.attention(q, k, v, causal=causal, scale=scale, layout="bnhd")
    return _to_bnhd(_Exchange.apply(o, group, False), layout)


def ulysses_attention_jvp(q, k, v, tq=None, tk=None, tv=None, *, group=None, causal=False, scale=None,
                          layout="bhnd", return_lse=False):
    """:func:`ulysses_attention` and its tangent for explicit tangents (``None`` is zero), each
    primal sent in one all-to-all together with its tangent: ``(o, to)`` or, with ``return_lse``,
    ``(o, to, lse, mu)`` with lse, mu (B, Hq, Nq/P) float32 (this rank's rows), as
    :func:`ring_attention_jvp` returns them. Every output is differentiable."""
    _check(q, k, v, (tq, tk, tv), group, layout)

    def exchange(x, t, to_heads):  # bnhd primal and tangent stacked along the batch: one call
        if t is None:
            return _Exchange.apply(x, group, to_heads), None
        both = _Exchange.apply(torch.cat((x, t)), group, to_heads)
        return both[: x.shape[0]], both[x.shape[0]:]

    pairs = ((q, tq), (k, tk), (v, tv))
    (q, tq), (k, tk), (v, tv) = (exchange(_to_bnhd(x, layout), _to_bnhd(t, layout), True) for x, t in pairs)
    o, to, lse, mu = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, scale=scale, layout="bnhd",
                                            return_lse=True)
    o, to = exchange(o, to, False)
    o, to = _to_bnhd(o, layout), _to_bnhd(to, layout)
    if not return_lse:
        return o, to
    # (B, H/P, N) head shards of every row -> (B, H, N/P): the exchange of (B, N, H/P, 1) tensors
    lse, mu = exchange(lse.transpose(1, 2).unsqueeze(-1), mu.transpose(1, 2).unsqueeze(-1), False)
    return o, to, lse.squeeze(-1).transpose(1, 2), mu.squeeze(-1).transpose(1, 2)


# --------------------------------------------------------------------------- ring attention


def _seq_dim(dim, layout) -> int:
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim: expected an int or None, got {type(dim).__name__}")
        return dim
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return 2 if layout == "bhnd" else 1


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int | None = None, *,
                 layout: str = "bhnd") -> torch.Tensor:
    """Rank ``rank``'s zig-zag shard of a whole sequence along ``dim`` (default: the sequence dim
    of ``layout``, 2 for ``"bhnd"``, 1 for ``"bnhd"``): the sequence cut into ``2 * world`` equal
    chunks, the rank holding chunks ``rank`` and ``2 world - 1 - rank``. Causal ring attention
    expects its inputs in this layout (the early chunks' light rows and the late chunks' heavy rows
    on every rank)."""
    dim = _seq_dim(dim, layout)
    if x.shape[dim] % (2 * world):
        raise ValueError(f"x: expected a length divisible by 2 * world = {2 * world} along dim {dim}, "
                         f"got {x.shape[dim]}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int | None = None, *, layout: str = "bhnd") -> torch.Tensor:
    """The whole sequence from every rank's zig-zag shard (``shards[r]`` from rank r); ``dim`` and
    ``layout`` as in :func:`zigzag_shard`."""
    dim = _seq_dim(dim, layout)
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[c][0] if c < world else halves[2 * world - 1 - c][1] for c in range(2 * world)], dim=dim)


def _ring_blocks(rank: int, src: int, world: int, causal: bool):
    """``(q_chunk, kv_chunk, causal)`` attention calls of this rank's queries against the shard of
    rank ``src``: the whole shards without ``causal``; with it, the zig-zag chunks pairwise, a
    chunk seeing all of an earlier chunk, the diagonal causally and nothing of a later one."""
    if not causal:
        return [(None, None, False)]
    mine, theirs = (rank, 2 * world - 1 - rank), (src, 2 * world - 1 - src)
    return [(i, j, a == c) for i, a in enumerate(mine) for j, c in enumerate(theirs) if c <= a]


def _chunk(x, i):
    return x if (x is None or i is None) else x.chunk(2, dim=1)[i]


class _MergedRows:
    """Running exact merge of partial attention results over disjoint key shards for one block of
    query rows (bnhd ``o``; lse, mu (B, H, N)): LSE = logaddexp, weights exp(lse_i - LSE), and
    ``acc`` = sum of w_i (to_i + mu_i o_i), from which to = acc - mu o (float32)."""

    def __init__(self):
        self.o = self.acc = self.lse = self.mu = None

    def add(self, o, to, lse, mu):
        o = o.float()
        w_rows = lambda w: w.transpose(1, 2).unsqueeze(-1)  # (B, H, N) -> (B, N, H, 1)  # noqa: E731
        t = None if to is None else to.float() + w_rows(mu) * o
        if self.o is None:
            self.o, self.acc, self.lse, self.mu = o, t, lse, mu
            return
        new = torch.logaddexp(self.lse, lse)
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no shard saw a key of
        w_old, w_new = torch.exp(self.lse - safe), torch.exp(lse - safe)
        self.o = w_rows(w_old) * self.o + w_rows(w_new) * o
        if t is not None:
            self.acc = w_rows(w_old) * self.acc + w_rows(w_new) * t
            self.mu = w_old * self.mu + w_new * mu
        self.lse = new

    def result(self, dtype):
        to = None
        if self.acc is not None:
            to = (self.acc - self.mu.transpose(1, 2).unsqueeze(-1) * self.o).to(dtype)
        return self.o.to(dtype), to, self.lse, self.mu


def _ring_step(tensors, group):
    """Send ``tensors`` to the next rank and receive the previous rank's (same shapes); returns
    the receive buffers and the pending requests (wait on them before reading)."""
    world, rank = _world(group), dist.get_rank(group)
    peer = lambda r: r % world if group is None else dist.get_global_rank(group, r % world)  # noqa: E731
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, peer(rank + 1), group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, peer(rank - 1), group) for r in recv]
    return recv, dist.batch_isend_irecv(ops)


# Keys per launch that the automatic ``kv_blocks_per_launch`` aims at: small blocks are bound by
# their launch and the float32 merge after it, not by their FLOPs (docs/integration.md, the ring
# at many ranks), and a few thousand keys per launch amortise both.
_KEYS_PER_LAUNCH = 4096


def _blocks_per_launch(kv_blocks_per_launch, shard_keys: int, world: int) -> int:
    """``g``: how many received kv shards one launch covers. None picks enough shards for
    ``_KEYS_PER_LAUNCH`` keys; any value is capped at ``world`` (a rank sees ``world`` shards)."""
    g = kv_blocks_per_launch
    if g is None:
        g = -(-_KEYS_PER_LAUNCH // max(shard_keys, 1))
    return max(1, min(g, world))


def _check_blocks_per_launch(kv_blocks_per_launch):
    if kv_blocks_per_launch is None:
        return
    if isinstance(kv_blocks_per_launch, bool) or not isinstance(kv_blocks_per_launch, int):
        raise TypeError(f"kv_blocks_per_launch: expected an int >= 1 or None (automatic), "
                        f"got {type(kv_blocks_per_launch).__name__}")
    if kv_blocks_per_launch < 1:
        raise ValueError(f"kv_blocks_per_launch: expected an int >= 1 or None (automatic), "
                         f"got {kv_blocks_per_launch}")


def _cat_keys(xs):
    """The concatenation of key blocks along the sequence (bnhd dim 1); one block as it is."""
    if xs[0] is None:
        return None
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)


class _RankCompute:
    """One rank's ring compute over the kv shards it receives, without the communication: feed
    ``add(src, (k, v, tk, tv))`` the shards in arrival order (bnhd, absent tangents None), then
    ``result(dtype)`` -> ``(o, to, lse, mu)``.

    The shards are held in a buffer and every ``g`` of them one ``attention_jvp`` launch per q
    chunk covers the concatenation of their visible kv chunks (then one merge): at small shards
    a launch per shard is bound by launch overhead, not by its FLOPs. With ``causal`` (zig-zag)
    the diagonal blocks (``src == rank``) are their own causal calls, run on arrival."""

    def __init__(self, q, tq, rank, world, causal, scale, g, jvp):
        self.q, self.tq, self.rank, self.world, self.causal, self.scale = q, tq, rank, world, causal, scale
        self.g, self.jvp = g, jvp
        self.halves = [None] if not causal else [0, 1]
        self.merged = {i: _MergedRows() for i in self.halves}
        self.buffer = []  # (blocks [(i, j)], (k, v, tk, tv)) of the shards not yet attended to

    def _call(self, i, k, v, tk, tv, diag):
        out = flashjvp.attention_jvp(_chunk(self.q, i), k, v, _chunk(self.tq, i), tk, tv, causal=diag,
                                     scale=self.scale, layout="bnhd", return_lse=True)
        self.merged[i].add(out[0], out[1] if self.jvp else None, out[2], out[3])

    def add(self, src, kv):
        blocks = []
        for i, j, diag in _ring_blocks(self.rank, src, self.world, self.causal):
            if diag:
                self._call(i, *(_chunk(x, j) for x in kv), diag=True)
            else:
                blocks.append((i, j))
        self.buffer.append((blocks, kv))
        if len(self.buffer) >= self.g:
            self.flush()

    def flush(self):
        for i in self.halves:
            parts = [[_chunk(x, j) for x in kv] for blocks, kv in self.buffer for bi, j in blocks if bi == i]
            if parts:
                self._call(i, *(_cat_keys(xs) for xs in zip(*parts)), diag=False)
        self.buffer = []

    def result(self, dtype):
        self.flush()
        parts = [self.merged[i].result(dtype) for i in self.halves]
        if len(parts) == 1:
            return parts[0]
        o, to, lse, mu = zip(*parts)
        cat = lambda xs, d: None if xs[0] is None else torch.cat(xs, dim=d)  # noqa: E731
        return cat(o, 1), cat(to, 1), cat(lse, 2), cat(mu, 2)


def _rank_compute(q, tq, shards, rank, world, causal, scale, kv_blocks_per_launch=None):
    """``(o, to, lse, mu)`` of rank ``rank``'s bnhd queries against ``shards``, an iterable of
    ``(src, (k, v, tk, tv))`` in arrival order (a list, or the ring's transfers): the compute of
    a rank's ring steps, callable without a process group (benchmarks.sequence_parallel_model)."""
    compute = None
    for src, kv in shards:
        if compute is None:
            g = _blocks_per_launch(kv_blocks_per_launch, kv[0].shape[1], world)
            jvp = tq is not None or any(t is not None for t in kv[2:])
            compute = _RankCompute(q, tq, rank, world, causal, scale, g, jvp)
        compute.add(src, kv)
    return compute.result(q.dtype)


def _ring_shards(k, v, tk, tv, group):
    """The kv shards this rank sees, ``(src, (k, v, tk, tv))``, in ring order: each is yielded
    after its transfer to the next rank has started, and the next one's receive is waited on
    only when the consumer asks for it, so the transfer runs while the consumer computes."""
    world, rank = _world(group), dist.get_rank(group)
    present = [x is not None for x in (k, v, tk, tv)]
    kv = [x.contiguous() for x in (k, v, tk, tv) if x is not None]  # sent as they are
    for step in range(world):
        pending = _ring_step(kv, group) if step < world - 1 else None
        yield (rank - step) % world, tuple(_unpack(kv, present))
        if pending is not None:
            kv, reqs = pending  # fresh buffers: the shards yielded before stay valid
            for req in reqs:
                req.wait()


def _ring_forward(q, k, v, tq, tk, tv, group, causal, scale, kv_blocks_per_launch=None):
    """Ring attention on bnhd shards: ``(o, to, lse, mu)``, ``to``/``mu`` None without tangents.
    The next shard's transfer runs while the kernels work on the present ones (every
    ``kv_blocks_per_launch`` shards, :class:`_RankCompute`)."""
    jvp = tq is not None or tk is not None or tv is not None
    out = _rank_compute(q, tq, _ring_shards(k, v, tk, tv, group), dist.get_rank(group), _world(group), causal,
                        scale, kv_blocks_per_launch)
    return out if jvp else (out[0], None, out[2], None)


def _unpack(kv, present):
    it = iter(kv)
    return [next(it) if p else None for p in present]


def _ring_backward(do, q, k, v, o, lse, group, causal, scale):
    """Gradients of ring attention's ``o``: dQ stays, dK and dV travel around the ring with their
    keys and values and arrive back at their rank after a full turn. Each block's gradients come
    from the merged ``o`` and ``lse`` (the FlashAttention-2 backward is exact block by block).
    Shard by shard, unlike the forward: each shard's dK, dV must be complete before it moves on,
    so batching shards here would hold their gradients back for ``g`` hops."""
    world, rank = _world(group), dist.get_rank(group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    travel = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=torch.float32, device=k.device),
              torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    for step in range(world):
        src = (rank - step) % world
        bk, bv, dk, dv = travel
        for i, j, diag in _ring_blocks(rank, src, world, causal):
            qi, ki, vi = _chunk(q, i), _chunk(bk, j), _chunk(bv, j)
            oi, doi = _chunk(o, i), _chunk(do, i)
            lsei = lse if i is None else lse.chunk(2, dim=2)[i]
            a = check_inputs(qi, ki, vi, causal=diag, scale=scale, layout="bnhd", allow_float64=False)
            route = route_of(qi, ki, vi, a, grad=True, in_function=True)
            g = run_bwd(doi.contiguous(), qi, ki, vi, oi.contiguous(), lsei.contiguous(), a, route.bwd)
            _chunk(dq, i).add_(g[0])
            _chunk(dk, j).add_(g[1])
            _chunk(dv, j).add_(g[2])
        if world > 1:  # on, and after the last step home: the block of rank r + 1 to rank r + 1
            travel, reqs = _ring_step(travel if step < world - 1 else travel[2:], group)
            for req in reqs:
                req.wait()
            travel = travel if step < world - 1 else [None, None, *travel]
    return dq.to(q.dtype), travel[2].to(k.dtype), travel[3].to(v.dtype)


def _storage(x: torch.Tensor):
    """The storage under ``x``, through torch.func's wrappers (under ``torch.func.jvp`` the saved
    tensors a ``jvp`` rule sees are wrapped)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x.untyped_storage()


class _Ring(torch.autograd.Function):
    """Ring attention as one autograd node: ``forward`` runs the ring (or, with ``defer``, only
    allocates: ``jvp``, which PyTorch calls right after it, runs the ring once with the tangents
    and fills ``o`` in place), ``backward`` the gradient ring."""

    @staticmethod
    def forward(q, k, v, group, causal, scale, defer, blocks):
        if defer:
            b, n, h, _ = q.shape
            return q.new_empty(b, n, h, v.shape[-1]), q.new_empty(b, h, n, dtype=torch.float32)
        o, _, lse, _ = _ring_forward(q, k, v, None, None, None, group, causal, scale, blocks)
        return o, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.group, ctx.causal, ctx.scale, ctx.defer, ctx.blocks = inputs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(q, k, v, *output)
        ctx.save_for_forward(q, k, v, *output)

    @staticmethod
    def jvp(ctx, tq, tk, tv, *_):
        q, k, v, o, lse = ctx.saved_tensors
        o_, to, lse_, _ = _ring_forward(q, k, v, tq, tk, tv, ctx.group, ctx.causal, ctx.scale, ctx.blocks)
        if to is not None:  # a gradient reaching the tangent must not vanish: it raises
            to = _TangentWithoutGrad.apply(to, q, k, v, tq, tk, tv)
        if ctx.defer:  # fill forward's outputs through their storage, as a kernel writes them:
            # autograd saved them (for backward) before this, and must not see a change
            _storage(o).copy_(_storage(o_.contiguous()))
            _storage(lse).copy_(_storage(lse_.contiguous()))
        return (torch.zeros_like(o) if to is None else to), None

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return (None,) * 8
        q, k, v, o, lse = ctx.saved_tensors
        return (*_ring_backward(do, q, k, v, o, lse, ctx.group, ctx.causal, ctx.scale), *(None,) * 5)


class _TangentWithoutGrad(torch.autograd.Function):
    """Ring attention's tangent, attached to its inputs so that a gradient reaching it raises."""

    @staticmethod
    def forward(to, *inputs):
        return to.view_as(to)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("flashjvp.distributed.ring_attention: gradients through the tangent are not "
                                  "supported; use ulysses_attention for second-order training objectives")


def _has_tangent(x):
    return fwAD.unpack_dual(x).tangent is not None


def _ring_options(q, k, causal, scale, layout):
    """``(causal, scale)`` of a ring call, checked: causal ring attention runs on zig-zag shards of
    one sequence (Nq == Nk, where top-left and bottom-right coincide) of even length."""
    c = _norm_causal(causal)
    seq = 1 if layout == "bnhd" else 2
    if c is not None and q.shape[seq] != k.shape[seq]:
        raise ValueError(f"causal: causal ring attention needs Nq == Nk (zig-zag shards of one sequence), "
                         f"got shards of {q.shape[seq]} queries and {k.shape[seq]} keys")
    if c is not None and q.shape[seq] % 2:
        raise ValueError(f"q: causal ring attention needs an even shard length (two zig-zag chunks), "
                         f"got {q.shape[seq]}")
    return c is not None, _norm_scale(scale, q.shape[-1])


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, layout="bhnd", kv_blocks_per_launch=None):
    """Attention over a sequence sharded across the ranks of ``group``, by ring attention.

    Args:
        q, k, v: this rank's shards, (B, Hq, Nq/P, Dqk), (B, Hkv, Nk/P, Dqk), (B, Hkv, Nk/P, Dv)
            for ``layout="bhnd"`` (the default; or (B, N/P, H, D) for ``"bnhd"``). Without
            ``causal`` any assignment of contiguous
            shards to ranks works; with ``causal`` (top-left, over global positions, Nq == Nk)
            the shards must be zig-zag ones (:func:`zigzag_shard`), which balances the work.
            Every rank's shards have the same length; GQA as in :func:`flashjvp.attention`.
        group: the process group (default: the world).
        kv_blocks_per_launch: ``g``, the number of received kv shards each forward launch covers:
            the ring still moves one shard per hop, but a rank holds the shards it receives and
            every ``g`` of them runs one launch per query chunk over the concatenation of their
            visible keys, then one merge; the launch overlaps the hop in flight when it starts.
            Small shards (many ranks) are launch-bound one by one. ``None`` (the default) picks ``g`` from the
            shard length, enough shards for about 4096 keys per launch, at most the group size;
            ``1`` is one launch per shard; values above the group size act as the group size.
            Memory: the buffer holds ``g`` shards of k, v (and their tangents) and, at each
            launch, their concatenation. The causal diagonal block stays its own causal launch.
            The backward runs shard by shard whatever ``g`` (dK, dV travel with their keys).

    Returns:
        this rank's shard of the output, (B, Hq, Nq/P, Dv) (or bnhd), in the input's order.

    Differentiable (dK, dV passed around the ring) and forward-differentiable: under
    ``torch.func.jvp`` / ``forward_ad`` one ring carries the keys, values and their tangents and
    each rank runs the fused forward+JVP kernel per shard. Gradients through the tangent are not
    supported on this path (use :func:`ulysses_attention`).
    """
    _check_blocks_per_launch(kv_blocks_per_launch)
    _check(q, k, v, (None, None, None), group, layout, heads=False)
    causal, scale = _ring_options(q, k, causal, scale, layout)
    q, k, v = (_to_bnhd(x, layout) for x in (q, k, v))
    defer = _has_tangent(q) or _has_tangent(k) or _has_tangent(v)
    o, _ = _Ring.apply(q, k, v, group, causal, scale, defer, kv_blocks_per_launch)
    return _to_bnhd(o, layout)


def ring_attention_jvp(q, k, v, tq=None, tk=None, tv=None, *, group=None, causal=False, scale=None,
                       layout="bhnd", return_lse=False, kv_blocks_per_launch=None):
    """:func:`ring_attention` and its tangent for explicit tangents (``None`` is zero), in one
    ring: ``(o, to)`` or, with ``return_lse``, ``(o, to, lse, mu)`` with lse, mu (B, Hq, Nq/P).
    ``kv_blocks_per_launch`` as in :func:`ring_attention`.
    Not differentiable: inputs that require grad are refused (differentiate :func:`ring_attention`
    under ``torch.func.jvp``, or use :func:`ulysses_attention_jvp`)."""
    _check_blocks_per_launch(kv_blocks_per_launch)
    _check(q, k, v, (tq, tk, tv), group, layout, heads=False)
    causal, scale = _ring_options(q, k, causal, scale, layout)
    needs = [n for n, x in zip(("q", "k", "v", "tq", "tk", "tv"), (q, k, v, tq, tk, tv))
             if x is not None and x.requires_grad]
    if needs and torch.is_grad_enabled():
        raise ValueError(f"{needs[0]}: ring_attention_jvp's outputs are not differentiable, expected inputs that "
                         f"do not require grad (or torch.no_grad()), got requires_grad=True; differentiate "
                         f"ring_attention under torch.func.jvp, or use ulysses_attention_jvp")
    q, k, v, tq, tk, tv = (_to_bnhd(x, layout) for x in (q, k, v, tq, tk, tv))
    with torch.no_grad():
        o, to, lse, mu = _ring_forward(q, k, v, tq, tk, tv, group, causal, scale, kv_blocks_per_launch)
    if to is None:
        to, mu = torch.zeros_like(o), torch.zeros_like(lse)
    o, to = _to_bnhd(o, layout), _to_bnhd(to, layout)
    return (o, to, lse, mu) if return_lse else (o, to)
