"""Tail splitting (_split.py): the last wave's row blocks run as key shards, then are merged.

On the CPU the interpreter's 16-row tiles and a pretend SM count (``_policy.sm_count`` patched)
make small shapes split; each test checks that a split really ran (LaunchLog: the merge kernel
launched)."""

import pytest
import torch

import flashjvp
from flashjvp import _fwd, _policy
from flashjvp._launch import LaunchLog
from helpers import DEVICE, assert_close, check_jvp, force_fwd_tile, jvp_refs, make_qkv

ON_GPU = DEVICE == "cuda"


@pytest.mark.parametrize(
    ("n_blocks", "slots", "n_k", "plan"),
    [
        pytest.param(3072, 132, 32768, (3036, 3), id="n32768-d128"),  # 36 blocks in the last wave
        pytest.param(4096, 132, 4096, (4092, 8), id="d64-n4096"),  # shards capped by n_k / 512
        pytest.param(1536, 132, 4096, (1536, 1), id="tail-over-half"),  # 84 of 132: no gain
        pytest.param(264, 132, 32768, (264, 1), id="whole-waves"),
        pytest.param(133, 132, 800, (133, 1), id="too-few-keys"),
        pytest.param(133, 132, 1024, (132, 2), id="one-block-tail"),
        pytest.param(5, 132, 32768, (0, 26), id="under-one-wave"),
    ],
)
def test_split_plan(n_blocks, slots, n_k, plan):
    assert _policy.split_plan(n_blocks, slots, n_k) == plan
    n_full, shards = plan
    assert _policy.split_grid(n_blocks, slots, n_k, block_m=128, capacity=slots * 128) == (
        n_full + (n_blocks - n_full) * shards)
    assert _policy.split_grid(n_blocks, slots, n_k, block_m=128, capacity=0) == n_blocks  # no scratch


@pytest.fixture
def split_on(monkeypatch):
    """Split as a GPU with ``slots`` SMs would; shards of at least 16 keys on the CPU."""

    def set_slots(slots):
        monkeypatch.setattr(_policy, "sm_count", lambda device: slots)
        monkeypatch.setattr(_policy, "SPLIT_MIN_BUCKET", 0)
        if not ON_GPU:
            monkeypatch.setattr(_policy, "SPLIT_MIN_KEYS", 16)

    return set_slots


# (B, Hq, Hkv, Nq, Nk, Dqk, Dv), slots: with the interpreter's 16-row tiles each splits its tail
SPLIT_CASES = [
    pytest.param((1, 2, 1, 37, 999, 40, 40), 5, id="gqa-37x999-d40"),  # 6 blocks: 1 in 5 shards
    pytest.param((2, 1, 1, 50, 64, 16, 16), 6, id="b2-50x64"),  # 8 blocks: 2 in 3 shards
    pytest.param((1, 3, 3, 19, 53, 72, 24), 4, id="19x53-d72x24"),  # 6 blocks: 2 in 2 shards
    pytest.param((1, 1, 1, 70, 80, 16, 16), 4, id="empty-shard"),  # 5 key blocks in 4 shards: one gets none
    pytest.param((1, 2, 1, 37, 999, 40, 40), 20, id="under-one-wave"),  # 6 blocks, all in 3 shards
]
TANGENTS = [pytest.param(t, id=f"t{t}") for t in ("qkv", "q", "v", "")]


@pytest.mark.skipif(ON_GPU, reason="16-row tiles: interpreter only (GPU: test_gpu.py)")
@pytest.mark.parametrize("tangents", TANGENTS)
@pytest.mark.parametrize(("shape", "slots"), SPLIT_CASES)
def test_split_matches_reference(shape, slots, tangents, split_on):
    split_on(slots)
    layout = "bnhd" if shape[3] % 2 else "bhnd"
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, torch.float32, kinds=("swapped", "sliced", "contiguous", "strided"))
    tq, tk, tv = (t if name in tangents else None for name, t in zip("qkv", (tq, tk, tv)))
    with LaunchLog() as log:
        if tangents:
            check_jvp(q, k, v, tq, tk, tv, torch.float32, layout=layout)
        else:
            o = flashjvp.attention(q, k, v, layout=layout)
    if not tangents:
        truth = flashjvp.attention_ref(q.double(), k.double(), v.double(), layout=layout)
        assert_close("o", o, truth, flashjvp.attention_ref(q, k, v, layout=layout), torch.float32)
    assert log.count("_attn_fwd_kernel", SPLIT=True) == 1
    assert log.count("_attn_merge_kernel") == 1, "the launch did not split its tail"


@pytest.mark.skipif(ON_GPU, reason="16-row tiles: interpreter only")
def test_split_under_torch_func_jvp(split_on):
    """The autograd path (o and lse allocated by forward, filled by jvp) merges into them too."""
    split_on(5)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 37, 999, 40, 40, "bhnd", torch.float32)
    with LaunchLog() as log:
        o, to = torch.func.jvp(flashjvp.attention, (q, k, v), (tq, tk, tv))
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)
    assert log.count("_attn_fwd_kernel") == 1
    assert log.count("_attn_merge_kernel") == 1


@pytest.mark.skipif(ON_GPU, reason="16-row tiles: interpreter only")
@pytest.mark.parametrize(("causal", "env"), [("top_left", "1"), (False, "0")], ids=["causal", "switched-off"])
def test_no_split(causal, env, split_on, monkeypatch):
    """Causal launches and FLASHJVP_TAIL_SPLIT=0 run every row block whole."""
    split_on(5)
    monkeypatch.setenv("FLASHJVP_TAIL_SPLIT", env)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 37, 999, 40, 40, "bhnd", torch.float32)
    with LaunchLog() as log:
        check_jvp(q, k, v, tq, tk, tv, torch.float32, causal=causal)
    assert log.count("_attn_fwd_kernel", SPLIT=False) == 1
    assert log.count("_attn_merge_kernel") == 0


@pytest.mark.parametrize(
    ("causal", "bucket", "env", "slots"),
    [
        pytest.param(False, 16384, "1", 132, id="long-keys"),
        # below SPLIT_MIN_BUCKET each program is short: the last wave is ragged, not idle
        pytest.param(False, 4096, "1", 0, id="4096-keys"),
        pytest.param(True, 16384, "1", 0, id="causal"),
        pytest.param(False, 16384, "0", 0, id="switched-off"),
    ],
)
def test_split_slots_policy(causal, bucket, env, slots, monkeypatch):
    monkeypatch.setattr(_policy, "sm_count", lambda device: 132)
    monkeypatch.setenv("FLASHJVP_TAIL_SPLIT", env)
    q = torch.empty(1, 1, 1, 16)
    assert _policy.split_slots(q, causal=causal, n_k_bucket=bucket) == slots


def test_no_split_off_the_gpu(monkeypatch):
    """Unpatched, a CPU tensor has no SMs to fill: the split policy gives 0 slots."""
    monkeypatch.delenv("FLASHJVP_TAIL_SPLIT", raising=False)
    assert _policy.sm_count(torch.device("cpu")) == 0
    assert _policy.split_slots(torch.empty(1, 1, 1, 16), causal=False, n_k_bucket=16384) == 0


@pytest.mark.skipif(ON_GPU, reason="16-row tiles: interpreter only")
@pytest.mark.parametrize(("known", "splits"), [([16, 32], True), ([16], False)], ids=["sized-for-it", "too-small"])
def test_forced_tile_splits_only_into_room(known, splits, split_on, monkeypatch):
    """A forced 32-row tile: with the scratch sized for it, its tail splits (4 blocks: the last
    in 3 shards on 3 SMs); sized for 16-row tiles only (48 rows, it needs 96), the launch runs
    whole instead of writing past the scratch."""
    split_on(3)
    monkeypatch.setattr(_fwd, "BLOCK_MS", known)
    force_fwd_tile(monkeypatch, tma="0", tile=(32, 16, 4, 1))
    q, k, v, tq, tk, tv = make_qkv(1, 1, 1, 97, 200, 16, 16, "bhnd", torch.float32)
    with LaunchLog() as log:
        check_jvp(q, k, v, tq, tk, tv, torch.float32)
    assert [r.config["BLOCK_M"] for r in log.launches if r.kernel == "_attn_fwd_kernel"] == [32]
    assert log.count("_attn_merge_kernel") == splits
