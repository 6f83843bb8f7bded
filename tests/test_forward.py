"""Fused forward + JVP kernel against the float64 math reference."""

import pytest
import torch

import flashjvp
from flashjvp._launch import PLANS, LaunchLog
from helpers import (
    DTYPE_IDS,
    DTYPES,
    MEMORY_KINDS,
    assert_close,
    check_jvp,
    force_fwd_tile,
    grad_refs,
    jvp_refs,
    make_qkv,
    spy_autotuner,
)

# (B, Hq, Hkv, Nq, Nk, Dqk, Dv)
SHAPES = [
    pytest.param((1, 1, 1, 1, 1, 16, 16), id="n1"),
    pytest.param((2, 2, 2, 37, 37, 40, 40), id="n37-d40"),
    pytest.param((1, 3, 1, 37, 19, 72, 24), id="gqa3-37x19-d72x24"),
    pytest.param((1, 2, 2, 19, 53, 96, 72), id="cross19x53-d96x72"),
    pytest.param((1, 2, 1, 5, 7, 1, 3), id="mqa-d1x3"),
    pytest.param((1, 1, 1, 17, 9, 256, 200), id="d256x200"),
    pytest.param((1, 4, 2, 21, 19, 36, 20), id="gqa2-21x19-d36x20"),  # q heads 0,1 -> kv 0; 2,3 -> kv 1
]
CAUSAL = [pytest.param(c, id=f"causal={c}") for c in (False, "top_left", "bottom_right")]
DT = [pytest.param(d, id=DTYPE_IDS[d]) for d in DTYPES]


def _layout_and_kinds(shape, causal):
    """Alternate the API layout and rotate each tensor's memory layout across the matrix."""
    i = (sum(shape) + len(str(causal))) % len(MEMORY_KINDS)
    layout = ("bhnd", "bnhd")[i % 2]
    return layout, MEMORY_KINDS[i:] + MEMORY_KINDS[:i]


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_jvp_matches_reference(shape, causal, dtype):
    layout, kinds = _layout_and_kinds(shape, causal)
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, dtype, kinds)
    scale = 0.3 if shape[5] == 1 else None
    o, to, lse, mu = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, layout=layout,
                                            scale=scale, return_lse=True)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=causal, layout=layout, scale=scale)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert got.dtype == (dtype if name in ("o", "to") else torch.float32)
        assert_close(name, got, ref, ref_lp, dtype)


@pytest.mark.parametrize("dtype", DT)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_attention_forward_matches_reference(shape, causal, dtype):
    layout, kinds = _layout_and_kinds(shape, causal)
    q, k, v = make_qkv(*shape, "bnhd" if layout == "bhnd" else "bhnd", dtype, kinds, tangents=False)
    layout = "bnhd" if layout == "bhnd" else "bhnd"
    o = flashjvp.attention(q, k, v, causal=causal, layout=layout)
    truth = flashjvp.attention_ref(q.double(), k.double(), v.double(), causal=causal, layout=layout)
    assert_close("o", o, truth, flashjvp.attention_ref(q, k, v, causal=causal, layout=layout), dtype)


@pytest.mark.parametrize("d", [36, 20])
def test_strides_a_multiple_of_4_not_8(d):
    """Contiguous tensors whose strides are multiples of 4 elements but not of 8: the kernels must
    run with 16-byte vector loads off (ALIGN=1), forward, tangent and backward."""
    from flashjvp._launch import vector_align
    q, k, v, tq, tk, tv = make_qkv(1, 4, 2, 21, 19, d, d, "bhnd", torch.float32, ("contiguous",))
    assert vector_align([x.stride() for x in (q, k, v)], d, d) == 1
    o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention(*leaves)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = grad_refs(q, k, v, do)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, torch.float32)


def test_calls_differing_only_in_scale_or_causal():
    """Calls of the same sizes that differ in scale or causality (their checked arguments are cached
    by size) each get their own: compared with PyTorch's SDPA, which shares nothing with flashjvp."""
    q, k, v = make_qkv(1, 2, 2, 21, 21, 16, 16, "bhnd", torch.float32, ("contiguous",), tangents=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for kw in (dict(scale=0.9), {}, dict(causal=True), {}, dict(scale=0.9, causal=True)):
        want = sdpa(q.double(), k.double(), v.double(), scale=kw.get("scale"), is_causal=kw.get("causal", False))
        torch.testing.assert_close(flashjvp.attention(q, k, v, **kw).double(), want, rtol=1e-4, atol=1e-4,
                                   msg=str(kw))


def test_long_self_attention_n999():
    q, k, v, tq, tk, tv = make_qkv(1, 1, 1, 999, 999, 16, 16, "bhnd", torch.float32)
    o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=True)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=True)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "causal"])
def test_growing_logits_rescale_the_state(causal):
    """Logits rising along the keys (about 32 nats from first to last): the running max grows in
    every key block, and the accumulators must be rescaled each time."""
    b, h, n_q, n_k, d = 1, 2, 24, 128, 16
    gain = torch.linspace(-2.0, 6.0, n_k).view(1, 1, n_k, 1)  # ~5.8 log2 units more per 16-key block
    q = torch.ones(b, h, n_q, d) + 0.1 * torch.randn(b, h, n_q, d)
    k = gain * torch.ones(b, h, n_k, d) + 0.1 * torch.randn(b, h, n_k, d)
    v, tq, tk, tv = (torch.randn(b, h, n, d) for n in (n_k, n_q, n_k, n_k))
    check_jvp(q, k, v, tq, tk, tv, torch.float32, causal=causal)


SUBSETS = [(), ("tq",), ("tk",), ("tv",), ("tq", "tk"), ("tk", "tv"), ("tq", "tv")]


@pytest.mark.parametrize("given", SUBSETS, ids=lambda g: "+".join(g) or "none")
def test_missing_tangents_are_zero(given):
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 21, 33, 24, 40, "bnhd", torch.float32)
    tangents = {"tq": tq, "tk": tk, "tv": tv}
    kw = {n: (t if n in given else None) for n, t in tangents.items()}
    o, to, lse, mu = check_jvp(q, k, v, kw["tq"], kw["tk"], kw["tv"], torch.float32,
                               causal="bottom_right", layout="bnhd")
    if not given:
        assert torch.count_nonzero(to) == 0 and torch.count_nonzero(mu) == 0


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_rows_without_visible_keys_are_zero(causal):
    """bottom-right causal with Nq > Nk: the first Nq - Nk rows see no key."""
    nq, nk = 23, 7
    q, k, v, tq, tk, tv = make_qkv(2, 2, 2, nq, nk, 16, 16, "bhnd", torch.float32)
    o, to, lse, mu = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, return_lse=True)
    assert not any(torch.isnan(x).any() for x in (o, to, lse, mu))
    if causal == "bottom_right":
        empty = slice(0, nq - nk)
        assert torch.count_nonzero(o[:, :, empty]) == 0 and torch.count_nonzero(to[:, :, empty]) == 0
        assert torch.count_nonzero(mu[:, :, empty]) == 0
        assert torch.isneginf(lse[:, :, empty]).all()
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=causal)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert_close(name, got, ref, ref_lp, torch.float32)


def test_reference_chunked_matches_unchunked():
    q, k, v = make_qkv(1, 2, 2, 40, 30, 8, 8, "bhnd", torch.float64, tangents=False)
    full = flashjvp.attention_ref(q, k, v, causal="bottom_right")
    chunked = flashjvp.attention_ref(q, k, v, causal="bottom_right", block_q=7)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-12)


def test_tuned_launch_reuses_the_picked_config(monkeypatch):
    """After the first launch for an autotune key, a launch with another length of the same
    bucket goes straight to the picked config (Triton's Autotuner is not consulted again), with
    correct results; a new bucket goes through the Autotuner again."""
    seen = spy_autotuner(monkeypatch, "N_Q_BUCKET")
    for n in (37, 50, 100):  # buckets 64, 64, 128
        q, k, v, tq, tk, tv = make_qkv(1, 2, 2, n, n, 24, 24, "bhnd", torch.float32)
        o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv)
        truth, lowp = jvp_refs(q, k, v, tq, tk, tv)
        assert_close("o", o, truth[0], lowp[0], torch.float32)
        assert_close("to", to, truth[1], lowp[1], torch.float32)
    assert seen == [64, 128]


@pytest.mark.parametrize("needs", ["requires_grad", "no_grad"])
def test_forward_with_and_without_autograd(needs):
    """Without a graph to record the launcher runs without the autograd Function: same values,
    and no grad_fn; with requires_grad the output joins the graph."""
    q, k, v = make_qkv(1, 2, 1, 29, 41, 40, 40, "bnhd", torch.float32, tangents=False)
    if needs == "requires_grad":
        q.requires_grad_()
    o = flashjvp.attention(q, k, v, causal="bottom_right", layout="bnhd")
    assert (o.grad_fn is not None) == (needs == "requires_grad")
    truth = flashjvp.attention_ref(q.detach().double(), k.double(), v.double(), causal="bottom_right",
                                   layout="bnhd")
    lowp = flashjvp.attention_ref(q.detach(), k, v, causal="bottom_right", layout="bnhd")
    assert_close("o", o.detach(), truth, lowp, torch.float32)


# (B, Hq, Hkv, Nq, Nk, Dqk, Dv), layout, given tangents
# (shape, layout, memory kind of every tensor, tangents given): (B, H, N, D) storage (contiguous
# bhnd, or bnhd with dims 1 and 2 swapped in memory), and (B, N, H, D) storage (contiguous bnhd)
TMA_CASES = [
    pytest.param((1, 3, 1, 37, 19, 72, 72), "bnhd", "swapped", ("tq", "tk", "tv"), id="gqa3-37x19-d72-bnhd"),
    pytest.param((1, 4, 2, 29, 45, 32, 32), "bnhd", "contiguous", ("tq", "tk", "tv"), id="gqa2-29x45-seq-major"),
    pytest.param((2, 2, 2, 5, 70, 40, 40), "bhnd", "contiguous", ("tq", "tv"), id="5x70-d40-no-tk"),
    pytest.param((1, 2, 2, 33, 33, 16, 16), "bhnd", "contiguous", (), id="33-d16-no-tangents"),
]


@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "causal"])
@pytest.mark.parametrize(("shape", "layout", "kind", "given"), TMA_CASES)
def test_tma_path_matches_reference(shape, layout, kind, given, causal, monkeypatch):
    """FLASHJVP_TMA=1: K, V, tK, tV are read through host-made 4-D tensor descriptors, q and tq
    through ones built in the kernel (out-of-bounds rows and head-dim columns zero-filled by the
    copy itself), the outputs stored through pointers. Runs in the interpreter."""
    seen = force_fwd_tile(monkeypatch, tma="1")
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, torch.float32, (kind,))
    kw = {n: t for n, t in (("tq", tq), ("tk", tk), ("tv", tv)) if n in given}
    check_jvp(q, k, v, kw.get("tq"), kw.get("tk"), kw.get("tv"), torch.float32, causal=causal, layout=layout)
    assert seen == [True]


def test_tma_path_self_attention_on_one_tensor(monkeypatch):
    """q, k and v the same tensor (and the tangents another one): q is read through a descriptor
    built in the kernel (32-row query blocks here), k and v through host-made ones, one per slot
    (16-key blocks)."""
    seen = force_fwd_tile(monkeypatch, tma="1", tile=(32, 16, 4, 1))
    x, tx = make_qkv(2, 2, 2, 50, 50, 32, 32, "bhnd", torch.float32, ("contiguous",))[::3]
    check_jvp(x, x, x, tx, tx, tx, torch.float32)
    assert seen == [True]


@pytest.mark.parametrize(("layout", "kinds"), [("bnhd", ("contiguous",)), ("bhnd", ("contiguous", "swapped"))],
                         ids=["bnhd-contiguous", "mixed"])
def test_tma_path_sequence_major_storage(layout, kinds, monkeypatch):
    """Tensors stored (B, N, H, D) (contiguous bnhd, or swapped bhnd next to contiguous ones):
    the TMA path reads them through descriptors whose head stride is below the sequence stride,
    with the reference's results."""
    from flashjvp._policy import tma_usable

    seen = force_fwd_tile(monkeypatch, tma="1")
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 21, 30, 32, 32, layout, torch.float32, kinds)
    check_jvp(q, k, v, tq, tk, tv, torch.float32, layout=layout)
    assert seen == [True]
    assert tma_usable((q, k, v, tq, tk, tv))


@pytest.mark.parametrize(("d", "kind"), [(37, "contiguous"), (40, "strided")], ids=["d37", "strided"])
def test_tma_falls_back_when_descriptors_cannot_address(d, kind, monkeypatch):
    """A head dim of 37 (rows not 16-byte aligned) or a head dim with stride 2 cannot be
    described for TMA: the pointer path runs instead, with the same results."""
    seen = force_fwd_tile(monkeypatch, tma="1")
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 21, 21, d, d, "bhnd", torch.float32, (kind,))
    o, to = flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    assert seen == [False]
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


class _OnHopper:
    """Stands in for a CUDA tensor on a Hopper GPU (``use_tma``'s ``auto`` rule reads only the
    dtype size, the device, the strides and the address), backed by a CPU tensor."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, x):
        self.x = x

    def element_size(self):
        return self.x.element_size()

    def stride(self, *dim):
        return self.x.stride(*dim)

    def data_ptr(self):
        return self.x.data_ptr()


# (dtype, head dim, keys, tangents given, auto takes TMA)
AUTO_CASES = [
    pytest.param(torch.bfloat16, 128, 1024, "qkv", True, id="bf16-d128-jvp"),
    pytest.param(torch.float16, 128, 4096, "kv", True, id="fp16-d128-kv"),
    pytest.param(torch.bfloat16, 128, 1024, "q", False, id="tq-only"),
    pytest.param(torch.bfloat16, 128, 1024, "", False, id="forward"),
    pytest.param(torch.bfloat16, 128, 512, "qkv", False, id="512-keys"),
    pytest.param(torch.bfloat16, 64, 1024, "qkv", False, id="d64"),
    pytest.param(torch.bfloat16, 256, 1024, "qkv", False, id="d256"),
    pytest.param(torch.float32, 128, 1024, "qkv", False, id="fp32"),
]


@pytest.mark.parametrize(("dtype", "d", "n_k", "given", "auto"), AUTO_CASES)
def test_tma_auto_policy(dtype, d, n_k, given, auto, monkeypatch):
    """FLASHJVP_TMA unset behaves as ``auto``: TMA for 16-bit forward+JVP with a key or value
    tangent at head dim 128 over >= 1024 keys on Hopper, pointers otherwise; ``1`` takes TMA
    whenever the descriptors can address the tensors, ``0`` never."""
    from flashjvp import _policy

    monkeypatch.setattr(_policy, "_is_hopper", lambda index: True)
    q = torch.zeros(1, 2, 64, d, dtype=dtype)
    tensors = [_OnHopper(q), _OnHopper(q), None]
    kw = dict(kv_tangents="k" in given or "v" in given, head_dims=(d, d), n_k=n_k)
    monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    unset = _policy.use_tma(tensors, **kw)
    monkeypatch.setenv("FLASHJVP_TMA", "auto")
    assert _policy.use_tma(tensors, **kw) is unset is auto
    monkeypatch.setenv("FLASHJVP_TMA", "1")
    assert _policy.use_tma(tensors, **kw) is True
    assert _policy.use_tma([_OnHopper(q), _OnHopper(q[..., ::2])], **kw) is False  # head-dim stride 2
    monkeypatch.setenv("FLASHJVP_TMA", "0")
    assert _policy.use_tma(tensors, **kw) is False
    monkeypatch.delenv("FLASHJVP_TMA")
    assert _policy.use_tma([q, q, None], **kw) is False  # CPU tensors: never under auto


@pytest.mark.parametrize(("env", "tma"), [(None, False), ("auto", False), ("0", False), ("1", True)],
                         ids=["unset", "auto", "0", "1"])
def test_tma_mode_of_a_launch(env, tma, monkeypatch):
    """The TMA flag the forward kernel is launched with (LaunchLog), per FLASHJVP_TMA: unset and
    ``auto`` keep CPU tensors (the interpreter) on the pointer path, ``1`` takes the descriptors."""
    if env is None:
        monkeypatch.delenv("FLASHJVP_TMA", raising=False)
    else:
        monkeypatch.setenv("FLASHJVP_TMA", env)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 9, 9, 16, 16, "bhnd", torch.float32, ("contiguous",))
    with LaunchLog() as log:
        check_jvp(q, k, v, tq, tk, tv, torch.float32)
    assert log.count("_attn_fwd_kernel") == 1
    assert log.count("_attn_fwd_kernel", TMA=tma) == 1, log.launches


@pytest.mark.parametrize("env", ["ws", "2", "yes"])
def test_unknown_tma_mode_is_refused(env, monkeypatch):
    """Values of FLASHJVP_TMA other than auto, 0 and 1 (the removed warp-specialized ``ws`` mode
    among them) raise a ValueError naming the variable, before any launch."""
    monkeypatch.setenv("FLASHJVP_TMA", env)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 9, 9, 16, 16, "bhnd", torch.float32, ("contiguous",))
    with LaunchLog() as log, pytest.raises(ValueError, match=f"FLASHJVP_TMA.*{env!r}"):
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    assert log.launches == []


@pytest.mark.parametrize(("dtype", "d", "tma", "tangents", "expected"), [
    (torch.bfloat16, 64, False, True, "d64-list"),
    (torch.float16, 64, False, True, "d64-list"),
    (torch.float32, 64, False, True, "general"),
    (torch.bfloat16, 64, False, False, "general"),
    (torch.bfloat16, 128, False, True, "general"),
    (torch.bfloat16, 64, True, True, "general"),
], ids=["bf16-d64-jvp", "fp16-d64-jvp", "fp32-d64-jvp", "bf16-d64-fwd", "bf16-d128-jvp", "bf16-d64-jvp-tma"])
def test_d64_jvp_tiles(dtype, d, tma, tangents, expected, monkeypatch):
    """16-bit forward+JVP at head dim 64 (pointer path) autotunes over its own short list, which
    alone admits 128x128 tiles with tangents; every other case keeps BLOCK_N <= 64 with tangents."""
    import triton

    from flashjvp._policy import FWD_JVP_D64_TILES, FWD_TILES, prune_fwd_configs, tile_of

    monkeypatch.setenv("FLASHJVP_AUTOTUNE", "1")
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
               for bm, bn, w, st in FWD_TILES]  # the GPU list (the interpreter's has one tile)
    args = dict(BLOCK_DQK=d, BLOCK_DV=d, HAS_TQ=tangents, HAS_TK=tangents, HAS_TV=tangents, TMA=tma)
    kept = prune_fwd_configs(configs, {"Q": torch.zeros(1, dtype=dtype)}, **args)
    tiles = [tile_of(c) for c in kept]
    if expected == "d64-list":
        assert tiles == FWD_JVP_D64_TILES, f"kept {tiles}"
    else:
        assert tiles and tiles != FWD_JVP_D64_TILES, f"kept {tiles}"
        if tangents:
            assert all(bn <= 64 for _, bn, _, _ in tiles), f"kept {tiles}"


def test_launch_log_records_the_launched_tile(monkeypatch):
    """LaunchLog records each launch with the config plan_tuned ran (what the benchmark writes
    into its rows) and the launch's flags; a second call with the same autotune key launches the
    config picked the first time without asking the Autotuner again, and on the GPU a repeated
    call signature launches through its cached plan (no JIT launch), logged alike."""
    from flashjvp import _fwd
    from flashjvp._policy import FWD_TILES, INTERPRETER_TILE, interpreting

    seen = spy_autotuner(monkeypatch, "N_Q_BUCKET")
    returned = []
    real = _fwd.plan_tuned
    monkeypatch.setattr(_fwd, "plan_tuned", lambda *a, **kw: returned.append(real(*a, **kw)) or returned[-1])
    PLANS.clear()
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 9, 9, 16, 16, "bhnd", torch.float32, ("contiguous",))
    with LaunchLog() as log:
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
        flashjvp.attention_jvp(q, k, v, None, tk, None)  # another key: HAS_TQ, HAS_TV differ
        flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    assert seen == [64, 64], "the third call asked the Autotuner again"
    assert [r.kernel for r in log.launches] == ["_attn_fwd_kernel"] * 3
    first, other, again = log.launches
    assert len(returned) == (3 if interpreting() else 2), "the repeated call did not use its plan"
    assert [r.config for r in log.launches][:len(returned)] == [c for c, _ in returned]
    cfg = first.config
    assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(cfg), cfg
    assert "WS" not in cfg
    tile = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"])
    assert (tile == INTERPRETER_TILE) if interpreting() else (tile in FWD_TILES), tile
    assert again.config == cfg
    assert (first.flags["HAS_TQ"], first.flags["HAS_TK"], first.flags["HAS_TV"]) == (True, True, True)
    assert (other.flags["HAS_TQ"], other.flags["HAS_TK"], other.flags["HAS_TV"]) == (False, True, False)
    assert {name: again.flags.get(name) for name in first.flags} == first.flags
    assert first.flags["TMA"] is False and first.flags["SPLIT"] is False
