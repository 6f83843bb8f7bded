"""Full-size checks on the GPU (skipped on the CPU): the reference kernel's own test matrix in
fp16/bf16/fp32, long sequences, a side stream."""

import pytest
import torch

import flashjvp
from flashjvp import _policy
from flashjvp._launch import LaunchLog
from flashjvp._policy import FWD_JVP_D64_TILES
from helpers import DTYPE_IDS, assert_close, check_jvp, force_fwd_tile, grad_refs, jvp_refs, make_qkv

pytestmark = pytest.mark.gpu
DT = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]

# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, causal)
JVP_MATRIX = [
    pytest.param((1, 2, 2, 1024, 1024, 64, 64, False), id="sa1024"),
    pytest.param((1, 2, 2, 1024, 1024, 64, 64, True), id="sa1024-causal"),
    pytest.param((1, 2, 2, 999, 999, 64, 64, False), id="sa999"),
    pytest.param((1, 2, 2, 999, 999, 64, 64, True), id="sa999-causal"),
    pytest.param((1, 2, 2, 256, 1024, 64, 128, False), id="ca256x1024-d64x128"),
    pytest.param((1, 2, 2, 1000, 15, 128, 32, False), id="ca1000x15-d128x32"),
    pytest.param((1, 2, 2, 512, 512, 16, 32, False), id="ca512x512-d16x32"),
    pytest.param((1, 2, 2, 515, 999, 16, 32, False), id="ca515x999-d16x32"),
    pytest.param((1, 8, 2, 777, 1333, 72, 72, "bottom_right"), id="gqa4-777x1333-d72-br"),
    pytest.param((2, 4, 4, 1031, 517, 96, 40, "top_left"), id="1031x517-d96x40-tl"),
    pytest.param((1, 2, 1, 300, 300, 256, 256, True), id="d256-causal"),
]
BWD_MATRIX = [
    pytest.param((1, 2, 2, 1024, 1024, 64, 64, False), id="sa1024"),
    pytest.param((1, 2, 2, 1024, 1024, 64, 64, True), id="sa1024-causal"),
    pytest.param((1, 2, 2, 999, 999, 64, 64, False), id="sa999"),
    pytest.param((1, 2, 2, 999, 999, 64, 64, True), id="sa999-causal"),
    pytest.param((1, 2, 2, 256, 1024, 128, 128, False), id="ca256x1024"),
    pytest.param((1, 2, 2, 1024, 256, 128, 128, False), id="ca1024x256"),
    pytest.param((1, 2, 2, 1024, 512, 64, 64, "bottom_right"), id="ca1024x512-br"),
    pytest.param((1, 2, 2, 1000, 515, 64, 64, False), id="ca1000x515"),
    pytest.param((1, 8, 2, 777, 1333, 72, 40, "top_left"), id="gqa4-777x1333-d72x40-tl"),
    pytest.param((1, 2, 1, 300, 300, 256, 256, True), id="d256-causal"),
    pytest.param((1, 2, 2, 8192, 8192, 128, 128, True), id="n8192-causal"),
]


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("case", JVP_MATRIX)
def test_jvp_full_size(case, dtype):
    *shape, causal = case
    layout = "bnhd" if shape[3] % 2 else "bhnd"
    check_jvp(*make_qkv(*shape, layout, dtype), dtype, causal=causal, layout=layout)


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("case", BWD_MATRIX)
def test_backward_full_size(case, dtype):
    *shape, causal = case
    layout = "bnhd" if shape[3] % 2 else "bhnd"
    q, k, v = make_qkv(*shape, layout, dtype, tangents=False)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention(*leaves, causal=causal, layout=layout)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    truth, lowp = grad_refs(q, k, v, do, causal=causal, layout=layout)
    for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), grads, truth, lowp):
        assert_close(name, g, ref, ref_lp, dtype)


# The TMA path (FLASHJVP_TMA=1): q, k, v and the tangents stored (B, H, N, D) (contiguous bhnd, or
# bnhd with dims 1 and 2 swapped in memory); and stored (B, N, H, D). auto takes either order.
# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, causal), given tangents
TMA_MATRIX = [
    pytest.param((2, 4, 4, 1024, 1024, 128, 128, False), "qkv", id="sa1024"),
    pytest.param((1, 4, 4, 999, 999, 128, 128, True), "qkv", id="sa999-causal"),
    pytest.param((1, 8, 2, 777, 1333, 128, 128, "bottom_right"), "qkv", id="gqa4-777x1333-br"),
    pytest.param((1, 4, 2, 1000, 77, 128, 128, "top_left"), "qkv", id="gqa2-1000x77-tl"),
    pytest.param((1, 4, 4, 2049, 515, 128, 128, False), "q", id="ca2049x515-tq-only"),
    pytest.param((1, 2, 1, 300, 300, 256, 256, True), "qkv", id="d256-causal"),
]


def _tma_case(case, given, layout, dtype, kind=None):
    *shape, causal = case
    kind = kind or ("contiguous" if layout == "bhnd" else "swapped")  # default: (B, H, N, D) storage
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, dtype, kinds=(kind,))
    tk, tv = (tk, tv) if given == "qkv" else (None, None)
    with LaunchLog() as log:
        check_jvp(q, k, v, tq, tk, tv, dtype, causal=causal, layout=layout)
    assert log.count("_attn_fwd_kernel", TMA=True) == 1, f"the TMA path did not run: {log.launches}"


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize(("case", "given"), TMA_MATRIX)
def test_tma_path_full_size(case, given, dtype, monkeypatch):
    monkeypatch.setenv("FLASHJVP_TMA", "1")
    _tma_case(case, given, "bhnd", dtype)


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize(("case", "given"), TMA_MATRIX)
def test_tma_path_sequence_major_full_size(case, given, dtype, monkeypatch):
    """FLASHJVP_TMA=1 on tensors stored (B, N, H, D) (flash-attn's layout, contiguous): the
    descriptors' head stride is below their sequence stride (``auto`` takes them too)."""
    monkeypatch.setenv("FLASHJVP_TMA", "1")
    _tma_case(case, given, "bnhd", dtype, kind="contiguous")


@pytest.mark.parametrize("dtype", DT[:2])
@pytest.mark.parametrize("tile", [pytest.param(t, id="{}x{}-w{}-s{}".format(*t))
                                  for t in [(128, 32, 8, 3), (128, 64, 8, 2)]])
def test_tma_tiles_full_size(tile, dtype, monkeypatch):
    """Forced tiles on the TMA path (the autotuner otherwise picks one per shape): 32- and 64-key
    boxes of the host-made descriptors, a key count that is no multiple of either."""
    force_fwd_tile(monkeypatch, tma="1", tile=tile)
    _tma_case((1, 8, 2, 777, 1333, 128, 128, "bottom_right"), "qkv", "bnhd", dtype)


@pytest.mark.parametrize("dtype", DT[:2])
@pytest.mark.parametrize("case", [  # (B, Hq, Hkv, Nq, Nk, causal); the head dim comes with the tile
    pytest.param((1, 8, 2, 777, 1333, "bottom_right"), id="gqa4-777x1333-br"),
    pytest.param((2, 4, 4, 1000, 1000, "top_left"), id="sa1000-causal"),
    pytest.param((1, 4, 4, 515, 999, False), id="ca515x999"),
])
@pytest.mark.parametrize(("tile", "d"), [pytest.param(t, 64, id="{}x{}-w{}-s{}".format(*t)) for t in FWD_JVP_D64_TILES]
                         + [pytest.param((128, 64, 8, 2), 128, id="d128-128x64-w8-s2")])
def test_pointer_tiles_full_size(tile, d, case, dtype, monkeypatch):
    """Every tile of the head-dim-64 forward+JVP list (the tests otherwise run its first), and
    the pointer path's 128x64 8-warp 2-stage tile at head dim 128 (its fastest for long queries
    over few keys)."""
    force_fwd_tile(monkeypatch, tma="0", tile=tile)
    *shape, causal = case
    check_jvp(*make_qkv(*shape, d, d, "bnhd", dtype), dtype, causal=causal, layout="bnhd")


@pytest.mark.parametrize("env", [None, "auto"], ids=["unset", "auto"])
@pytest.mark.parametrize(("d", "n_k", "tangents", "dtype", "expected"),
                         [(128, 1024, "qkv", torch.bfloat16, True), (64, 1024, "qkv", torch.bfloat16, False),
                          (256, 1024, "qkv", torch.bfloat16, False),
                          (128, 1024, "", torch.bfloat16, False), (128, 512, "qkv", torch.bfloat16, False),
                          (128, 1024, "qkv", torch.float32, False), (128, 1024, "q", torch.bfloat16, False)],
                         ids=["d128-jvp", "d64-jvp", "d256-jvp", "d128-fwd", "d128-jvp-512-keys", "d128-jvp-fp32",
                              "d128-tq-only"])
def test_tma_auto_policy(d, n_k, tangents, dtype, expected, env, monkeypatch):
    """FLASHJVP_TMA unset or ``auto`` takes the TMA path only where it measured faster: 16-bit
    forward+JVP with key/value tangents at head dim 128 over >= 1024 keys."""
    if env is None:
        monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    else:
        monkeypatch.setenv("FLASHJVP_TMA", env)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 256, n_k, d, d, "bhnd", dtype, kinds=("contiguous",))
    with LaunchLog() as log:
        if tangents:
            flashjvp.attention_jvp(q, k, v, tq, *((tk, tv) if tangents == "qkv" else (None, None)))
        else:
            flashjvp.attention(q, k, v)
    assert log.count("_attn_fwd_kernel") == 1
    assert log.count("_attn_fwd_kernel", TMA=expected) == 1, log.launches


def test_tma_modes_of_real_launches(monkeypatch):
    """Unset, FLASHJVP_TMA routes like ``auto``: the shape auto takes runs on the TMA path, with
    tq alone the same shape runs on pointers; ``0`` turns TMA off, ``1`` forces it for tq alone;
    the removed warp-specialized mode ``ws`` is refused with a ValueError naming the variable."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 256, 1024, 128, 128, "bhnd", torch.bfloat16, kinds=("contiguous",))
    monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    with LaunchLog() as log:
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
        flashjvp.attention_jvp(q, k, v, tq)
    assert [r.flags["TMA"] for r in log.launches] == [True, False]
    monkeypatch.setenv("FLASHJVP_TMA", "0")
    with LaunchLog() as log:
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    assert [r.flags["TMA"] for r in log.launches] == [False]
    monkeypatch.setenv("FLASHJVP_TMA", "1")
    with LaunchLog() as log:
        check_jvp(q, k, v, tq, None, None, torch.bfloat16)
    assert [r.flags["TMA"] for r in log.launches] == [True]
    monkeypatch.setenv("FLASHJVP_TMA", "ws")
    with LaunchLog() as log, pytest.raises(ValueError, match="FLASHJVP_TMA"):
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    assert log.launches == []


@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_repeated_calls_fresh_buffers(d):
    """Eight forward+JVP calls alternating two input sets, every call on freshly allocated copies
    (all kept alive, so no address repeats) writing fresh outputs, each checked against float64:
    a kernel that reads or writes through a descriptor or pointer left from an earlier call, or
    leaves rows unwritten, fails here. With FLASHJVP_TMA=1 in the environment it exercises the
    TMA path (descriptors made on the host per call must never point at an earlier call's
    tensors)."""
    sets = [make_qkv(1, 8, 4, 777, 1333, d, d, "bhnd", torch.bfloat16, kinds=("contiguous",)) for _ in range(2)]
    kept = []
    for i in range(8):
        args = [x.clone() for x in sets[i % 2]]
        kept.append((args, check_jvp(*args, torch.bfloat16, causal="bottom_right" if i % 4 == 3 else False)))


@pytest.mark.parametrize("d", [64, 128], ids=["d64-pointer", "d128-tma"])
def test_default_path_soak(d, monkeypatch):
    """3000 forward+JVP calls on the default path (B2 H24 N4096, bf16, all tangents), outputs
    NaN-filled before every call (FLASHJVP_POISON=1), every result compared bit for bit with the
    first call's on the same inputs (the kernels are deterministic). A kernel that leaves a whole
    row block unwritten in about 1 of 3000 calls passes every single-call test of this file; this
    test catches that rate with probability ~63%. Counts stay on the GPU: one sync at the end."""
    monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    x = make_qkv(2, 24, 24, 4096, 4096, d, d, "bhnd", torch.bfloat16, kinds=("contiguous",))
    first = [t.clone() for t in flashjvp.attention_jvp(*x, return_lse=True)]
    assert all(not torch.isnan(t).any() for t in first)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    calls = 3000
    with LaunchLog() as log:
        for _ in range(calls):
            out = flashjvp.attention_jvp(*x, return_lse=True)
            for t, r in zip(out, first):
                bad += (t != r).sum()  # NaN != NaN: unwritten elements count too
    assert log.count("_attn_fwd_kernel") == calls
    assert log.count("_attn_fwd_kernel", TMA=True) == (calls if d == 128 else 0)
    assert bad.item() == 0, f"{bad.item()} output elements differed from the first call in {calls} calls"


# The pointer path (bnhd, D64) and the TMA path `auto` picks (contiguous bhnd, D128, 1024 keys),
# whose device-built q descriptors take scratch memory from the allocator on the current stream.
PATHS = [pytest.param((2, 4, 2, 333, 444, 64, "bnhd", None), False, id="pointer"),
         pytest.param((1, 4, 2, 777, 1024, 128, "bhnd", ("contiguous",)), True, id="tma")]


@pytest.mark.parametrize(("case", "tma"), PATHS)
def test_side_stream_and_device_context(case, tma, monkeypatch):
    monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    b, hq, hkv, nq, nk, d, layout, kinds = case
    q, k, v, tq, tk, tv = make_qkv(b, hq, hkv, nq, nk, d, d, layout, torch.bfloat16, kinds=kinds)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with LaunchLog() as log, torch.cuda.stream(stream):
        o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv, layout=layout)
    torch.cuda.current_stream().wait_stream(stream)
    assert log.count("_attn_fwd_kernel", TMA=tma) == 1, log.launches
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, layout=layout)
    assert_close("o", o, truth[0], lowp[0], torch.bfloat16)
    assert_close("to", to, truth[1], lowp[1], torch.bfloat16)


@pytest.mark.parametrize(("case", "tma"), PATHS)
def test_cuda_graph_replay(case, tma, monkeypatch):
    """Forward+JVP captured in a CUDA graph (after a warm-up call: tuning cannot run inside a
    capture), replayed on new inputs copied into the captured buffers, each replay checked."""
    monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    b, hq, hkv, nq, nk, d, layout, kinds = case
    static = make_qkv(b, hq, hkv, nq, nk, d, d, layout, torch.bfloat16, kinds=kinds)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashjvp.attention_jvp(*static, layout=layout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with LaunchLog() as log, torch.cuda.graph(graph):
        o, to = flashjvp.attention_jvp(*static, layout=layout)
    assert log.count("_attn_fwd_kernel", TMA=tma) == 1, log.launches
    for _ in range(2):
        fresh = make_qkv(b, hq, hkv, nq, nk, d, d, layout, torch.bfloat16, kinds=kinds)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        truth, lowp = jvp_refs(*fresh, layout=layout)
        assert_close("o", o, truth[0], lowp[0], torch.bfloat16)
        assert_close("to", to, truth[1], lowp[1], torch.bfloat16)


def _peak_extra(call):
    """``(result, bytes)`` of a second ``call()`` (the first warms up / autotunes): its peak
    allocation beyond what was live before it."""
    call()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize(("d", "tma"), [(64, "0"), (128, "0"), (128, "1")], ids=["d64", "d128", "d128-tma"])
def test_forward_allocates_only_outputs(d, tma, monkeypatch):
    """Beyond o and to: per-row statistics only (lse and mu), on the pointer and the TMA path
    (its descriptors are made on the host: no device scratch)."""
    monkeypatch.setenv("FLASHJVP_TMA", tma)
    x = make_qkv(2, 8, 8, 2048, 2048, d, d, "bhnd", torch.bfloat16, kinds=("contiguous",))
    (o, to), extra = _peak_extra(lambda: flashjvp.attention_jvp(*x))
    rows = 2 * 8 * 2048
    expected = 2 * o.numel() * o.element_size() + rows * 4 * 2  # o, to, lse (+ mu)
    assert extra <= expected + (1 << 20), f"forward+JVP allocated {extra} bytes, outputs need {expected}"


@pytest.mark.parametrize("dtype", DT[:2])
@pytest.mark.parametrize("tangents", ["qkv", "q", ""], ids=["all-tangents", "tq-only", "forward"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
def test_tail_split_full_size(d, tangents, dtype, monkeypatch):
    """Tail splitting (_split.py) as on a GPU with 20 SMs: B1 H3 Nq1000 gives 24 (or 48) row
    blocks of 128 (64) rows, whose last 4 (8) run as key shards over 2100 keys and are merged;
    outputs NaN-filled, against float64. D128 with key tangents takes the TMA path."""
    monkeypatch.setattr(_policy, "sm_count", lambda device: 20)
    monkeypatch.setattr(_policy, "SPLIT_MIN_BUCKET", 0)  # 2100 keys
    q, k, v, tq, tk, tv = make_qkv(1, 3, 3, 1000, 2100, d, d, "bhnd", dtype,
                                   kinds=("contiguous", "swapped", "sliced"))
    tq, tk, tv = (t if name in tangents else None for name, t in zip("qkv", (tq, tk, tv)))
    with LaunchLog() as log:
        if tangents:
            check_jvp(q, k, v, tq, tk, tv, dtype)
        else:
            o = flashjvp.attention(q, k, v)
    if not tangents:
        ref = flashjvp.attention_ref(q.double(), k.double(), v.double())
        assert_close("o", o, ref, flashjvp.attention_ref(q, k, v), dtype)
    assert log.count("_attn_fwd_kernel", SPLIT=True) == 1, log.launches
    assert log.count("_attn_merge_kernel") == 1, "the launch did not split its tail"


def test_tail_split_allocates_only_scratch(monkeypatch):
    """B1 H12 N32768 D128 forward+JVP (3072 row blocks, 36 in the last wave on 132 SMs: split in
    3 shards): beyond the outputs, the per-row statistics and the shards' float32 scratch
    (at most one 128-row block per SM), nothing."""
    monkeypatch.setattr(_policy, "sm_count", lambda device: 132)
    x = make_qkv(1, 12, 12, 32768, 32768, 128, 128, "bhnd", torch.bfloat16, kinds=("contiguous",))
    with LaunchLog() as log:
        (o, to), extra = _peak_extra(lambda: flashjvp.attention_jvp(*x))
    assert log.count("_attn_merge_kernel") == 2  # both calls split
    rows = 12 * 32768
    scratch = 132 * 128 * (2 * 128 + 2) * 4
    expected = 2 * o.numel() * o.element_size() + rows * 4 + scratch
    assert extra <= expected + (1 << 20), f"forward+JVP allocated {extra} bytes, outputs and scratch need {expected}"
