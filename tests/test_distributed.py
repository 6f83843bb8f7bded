"""flashjvp.distributed on CPU processes (gloo; kernels in Triton's interpreter): every rank's
shard of the output, its tangent and its gradients against the float64 single-process reference
on the whole sequence."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashjvp
from flashjvp._launch import LaunchLog
from flashjvp.distributed import ulysses_attention, ulysses_attention_jvp
from helpers import assert_close

# (B, Hq, Hkv, N, D, causal): N divisible by 2 x 4 ranks (zig-zag chunks)
CASE = (2, 4, 4, 24, 16, False)
GQA_CASE = (1, 8, 4, 32, 16, True)


def _full(case, seed):
    b, hq, hkv, n, d, _ = case
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, n, hq, d), (b, n, hkv, d), (b, n, hkv, d)] * 2  # bnhd: q, k, v, tq, tk, tv
    return [torch.randn(s, generator=g) for s in shapes]


def _shard(x, rank, world):
    n = x.shape[1] // world
    return x[:, rank * n:(rank + 1) * n]


def _refs(fn, xs, dtype, through_tangent=False):
    """(o, to, gradients of <o, w> (+ <to, w^2> with ``through_tangent``) w.r.t. q, k, v, w)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in xs[:3]]
    o, to = fn(leaves, [t.to(dtype) for t in xs[3:]])
    w = torch.arange(o.numel(), dtype=dtype).reshape(o.shape).sin()
    ((o * w).sum() + ((to * w * w).sum() if through_tangent else 0)).backward()
    return o.detach(), to.detach(), [x.grad for x in leaves], w


def _check_case(case, rank, world):
    causal = case[5]
    xs = _full(case, seed=sum(case[:5]))
    kw = dict(causal=causal, layout="bnhd")

    def reference(prim, tans):
        return torch.func.jvp(lambda *a: flashjvp.attention_ref(*a, **kw), tuple(prim), tuple(tans))

    truth = _refs(reference, xs, torch.float64, through_tangent=True)
    lowp = _refs(reference, xs, torch.float32, through_tangent=True)

    def ulysses(prim, tans):
        shards = [_shard(x, rank, world) for x in prim]
        return torch.func.jvp(lambda *a: ulysses_attention(*a, causal=causal, layout="bnhd"), tuple(shards),
                              tuple(_shard(t, rank, world) for t in tans))

    leaves = [x.detach().clone().requires_grad_() for x in xs[:3]]
    o, to = ulysses(leaves, xs[3:])
    w = _shard(truth[3].float(), rank, world)
    ((o * w).sum() + (to * w * w).sum()).backward()  # through the tangent too (second order)
    for name, got, t, lp in (("o", o, truth[0], lowp[0]), ("to", to, truth[1], lowp[1])):
        assert_close(f"rank {rank} {name}", got, _shard(t, rank, world), _shard(lp, rank, world), torch.float32)
    # every rank's gradient reaches the whole sequence: sum them over the ranks
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth[2], lowp[2]):
        grad = x.grad.clone()
        dist.all_reduce(grad)
        assert_close(f"rank {rank} {name}", grad, t, lp, torch.float32)
    o2, to2 = ulysses_attention_jvp(*[_shard(x, rank, world) for x in xs], causal=causal, layout="bnhd")
    assert_close(f"rank {rank} o (explicit)", o2, _shard(truth[0], rank, world), _shard(lowp[0], rank, world),
                 torch.float32)
    assert_close(f"rank {rank} to (explicit)", to2, _shard(truth[1], rank, world), _shard(lowp[1], rank, world),
                 torch.float32)


def _worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        _check_case(CASE, rank, world)
        _check_case(GQA_CASE, rank, world)
        _check_ring(CASE, rank, world)
        _check_ring(GQA_CASE, rank, world)
        _check_ring_batching(CASE, rank, world)
        _check_ring_batching(GQA_CASE, rank, world)
        q = torch.randn(1, 4 + rank, 4, 16)  # shards of different lengths
        with pytest.raises(ValueError, match="same length"):
            ulysses_attention(q, q, q, layout="bnhd")
        with pytest.raises(ValueError, match="divisible by the group size"):
            ulysses_attention(*(torch.randn(1, 4, 3, 16),) * 3, layout="bnhd")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_single_process(world):
    if not flashjvp.interface._use_kernels(torch.empty(0)):
        pytest.skip("the CPU ranks run the kernels through TRITON_INTERPRET=1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous")), nprocs=world)


def test_uninitialised_raises():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ulysses_attention(q, q, q)


def _check_ring(case, rank, world):
    """Ring attention (zig-zag shards when causal) against the float64 whole-sequence reference:
    output, its tangent under torch.func.jvp, gradients, and the explicit-tangent form."""
    from flashjvp.distributed import ring_attention, ring_attention_jvp, zigzag_shard

    causal = case[5]
    shard = (lambda x: zigzag_shard(x, rank, world, layout="bnhd")) if causal else (lambda x: _shard(x, rank, world))
    xs = _full(case, seed=sum(case[:5]) + 1)
    kw = dict(causal=causal, layout="bnhd")

    def reference(prim, tans):
        return torch.func.jvp(lambda *a: flashjvp.attention_ref(*a, **kw), tuple(prim), tuple(tans))

    truth, lowp = _refs(reference, xs, torch.float64), _refs(reference, xs, torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in xs[:3]]
    with LaunchLog() as log:
        o, to = torch.func.jvp(lambda *a: ring_attention(*a, causal=causal, layout="bnhd"),
                               tuple(shard(x) for x in leaves), tuple(shard(t) for t in xs[3:]))
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) == len(log.launches), "fused forward+JVP per shard"
    (o * shard(truth[3].float())).sum().backward()
    for name, got, t, lp in (("o", o, truth[0], lowp[0]), ("to", to, truth[1], lowp[1])):
        assert_close(f"ring rank {rank} {name}", got, shard(t), shard(lp), torch.float32)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth[2], lowp[2]):
        grad = x.grad.clone()
        dist.all_reduce(grad)
        assert_close(f"ring rank {rank} {name}", grad, t, lp, torch.float32)
    o, to = torch.func.jvp(lambda *a: ring_attention(*a, causal=causal, layout="bnhd"), tuple(shard(x) for x in leaves),
                           tuple(shard(t) for t in xs[3:]))
    with pytest.raises(NotImplementedError, match="gradients through the tangent"):
        to.sum().backward()
    o2, to2 = ring_attention_jvp(*[shard(x) for x in xs], causal=causal, layout="bnhd")
    assert_close(f"ring rank {rank} o (explicit)", o2, shard(truth[0]), shard(lowp[0]), torch.float32)
    assert_close(f"ring rank {rank} to (explicit)", to2, shard(truth[1]), shard(lowp[1]), torch.float32)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_round_trip(world):
    """zigzag_unshard puts every rank's two chunks back where zigzag_shard took them from."""
    from flashjvp.distributed import zigzag_shard, zigzag_unshard

    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    assert torch.equal(zigzag_unshard([zigzag_shard(x, rank, world, dim=1) for rank in range(world)], dim=1), x)


def _ring_truth(case, seed, rank, world):
    """(xs, shard, (o, to) float64 and float32 references of this rank's shard)."""
    from flashjvp.distributed import zigzag_shard

    causal = case[5]
    shard = (lambda x: zigzag_shard(x, rank, world, layout="bnhd")) if causal else (lambda x: _shard(x, rank, world))
    xs = _full(case, seed=seed)

    def reference(dtype):
        prim, tans = tuple(x.to(dtype) for x in xs[:3]), tuple(t.to(dtype) for t in xs[3:])
        o, to = torch.func.jvp(lambda *a: flashjvp.attention_ref(*a, causal=causal, layout="bnhd"), prim, tans)
        return shard(o), shard(to)

    return xs, shard, reference(torch.float64), reference(torch.float32)


def _check_ring_batching(case, rank, world):
    """ring_attention_jvp with kv_blocks_per_launch 1, 2, world and automatic against the float64
    reference, and the launches each makes: per query chunk one per g shards (plus the causal
    diagonal's own)."""
    from flashjvp.distributed import ring_attention_jvp

    causal = case[5]
    xs, shard, truth, lowp = _ring_truth(case, sum(case[:5]) + 2, rank, world)
    for g in (1, 2, world, None):
        with LaunchLog() as log:
            o, to = ring_attention_jvp(*[shard(x) for x in xs], causal=causal, layout="bnhd", kv_blocks_per_launch=g)
        for name, got, t, lp in (("o", o, truth[0], lowp[0]), ("to", to, truth[1], lowp[1])):
            assert_close(f"ring rank {rank} g={g} {name}", got, t, lp, torch.float32)
        if g == world and not causal:
            assert len(log.launches) == 1, f"g = world: one launch over every shard, got {len(log.launches)}"
        if g == world and causal:  # two diagonal blocks, then at most one launch per query chunk
            assert len(log.launches) <= 4, f"g = world, causal: at most 4 launches, got {len(log.launches)}"
        if g == 1 and not causal:
            assert len(log.launches) == world, f"g = 1: one launch per shard, got {len(log.launches)}"


@pytest.mark.parametrize("case", [CASE, GQA_CASE], ids=["plain", "gqa-causal"])
@pytest.mark.parametrize("g", [1, 3, None])
def test_rank_compute_without_group(case, g):
    """The compute of one rank's ring steps, fed a list of shards and no process group (as
    benchmarks.sequence_parallel_model calls it), against the float64 reference."""
    from flashjvp.distributed import _rank_compute, zigzag_shard

    world, rank, causal = 4, 1, case[5]
    xs, shard, truth, lowp = _ring_truth(case, sum(case[:5]) + 3, rank, world)
    cut = (lambda x, r: zigzag_shard(x, r, world, layout="bnhd")) if causal else (lambda x, r: _shard(x, r, world))
    srcs = [(rank - step) % world for step in range(world)]  # the ring's arrival order
    shards = [(src, tuple(cut(x, src) for x in (xs[1], xs[2], xs[4], xs[5]))) for src in srcs]
    o, to, _, _ = _rank_compute(shard(xs[0]), shard(xs[3]), shards, rank, world, causal, case[4] ** -0.5, g)
    for name, got, t, lp in (("o", o, truth[0], lowp[0]), ("to", to, truth[1], lowp[1])):
        assert_close(f"rank compute g={g} {name}", got, t, lp, torch.float32)


@pytest.mark.parametrize("value, error, match", [
    (0, ValueError, r"^kv_blocks_per_launch: expected an int >= 1 or None \(automatic\), got 0$"),
    (-2, ValueError, r"^kv_blocks_per_launch: expected an int >= 1 or None \(automatic\), got -2$"),
    (2.0, TypeError, r"^kv_blocks_per_launch: expected an int >= 1 or None \(automatic\), got float$"),
    (True, TypeError, r"^kv_blocks_per_launch: expected an int >= 1 or None \(automatic\), got bool$"),
])
def test_kv_blocks_per_launch_refused(value, error, match):
    """A bad kv_blocks_per_launch raises before any exchange (no process group needed)."""
    from flashjvp.distributed import ring_attention, ring_attention_jvp

    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(error, match=match):
        ring_attention(q, q, q, kv_blocks_per_launch=value)
    with pytest.raises(error, match=match):
        ring_attention_jvp(q, q, q, q, kv_blocks_per_launch=value)


def test_ring_batching_benchmark_on_cpu(capsys):
    """benchmarks.sequence_parallel_model's --ring-batching rows at tiny sizes with the CPU timer:
    the automatic kv_blocks_per_launch launches fewer kernels than one per shard; without CUDA the
    command refuses with a message."""
    import argparse

    from benchmarks import sequence_parallel_model as spm
    from benchmarks.harness import measure_cpu

    args = argparse.Namespace(seq_lens=[32], ranks=[4], batch=1, heads=2, dim=16, tflops=580.0, quick=True,
                              time_limit=0)
    rows = spm.ring_batching_rows(args, device="cpu", dtype=torch.float32, timer=measure_cpu)
    assert [(r["causal"], r["setting"]) for r in rows] == [(False, "1"), (False, "auto"), (True, "1"), (True, "auto")]
    assert all("skip" not in r for r in rows), rows
    assert rows[0]["launches"] == 4 and rows[1]["launches"] == 1 and rows[3]["launches"] < rows[2]["launches"]
    assert "| 32 | 4 | False | 8 | auto (4) | 1 |" in spm.ring_batching_markdown(rows, {"gpu": "cpu", "command": ""},
                                                                                   args)
    if not torch.cuda.is_available():
        assert spm.main(["--ring-batching"]) == 1
        assert "CUDA GPU" in capsys.readouterr().err
