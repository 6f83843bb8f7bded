"""Key padding (``kv_lens``): every batch element sees only its first ``kv_lens[b]`` keys, in the
forward, the fused tangent, the backward and the second-order backward, against the float64
reference with the same padding (a dense mask built from the lengths)."""

import pytest
import torch

import flashjvp
from flashjvp import _policy
from flashjvp._launch import LaunchLog
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    assert_close,
    check_second_order,
    grad_refs,
    jvp_refs,
    make_qkv,
)

# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout), kv_lens: zero, partial, whole and past the end
CASES = [
    pytest.param((3, 2, 2, 37, 45, 32, 32, "bhnd"), [0, 17, 45], id="self-b3"),
    pytest.param((2, 4, 2, 19, 33, 40, 24, "bnhd"), [33, 1], id="gqa-d40x24-bnhd"),
    pytest.param((2, 2, 1, 50, 16, 16, 16, "bhnd"), [16, 99], id="mqa-clamped"),
]
if ON_GPU:
    CASES += [pytest.param((2, 8, 2, 999, 1024, 128, 128, "bnhd"), [512, 1000], id="gqa-1024-d128"),
              pytest.param((4, 4, 4, 256, 512, 64, 64, "bhnd"), [0, 100, 256, 512], id="xattn-512-d64")]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="top-left"),
          pytest.param("bottom_right", id="bottom-right")]


def _inputs(case, lens, dtype):
    b, hq, hkv, nq, nk, dqk, dv, layout = case
    xs = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype)
    return xs, dict(layout=layout, kv_lens=torch.tensor(lens, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize(("case", "lens"), CASES)
def test_forward_and_jvp(case, lens, causal, dtype):
    xs, kw = _inputs(case, lens, dtype)
    out = flashjvp.attention_jvp(*xs, causal=causal, return_lse=True, **kw)
    truth, lowp = jvp_refs(*xs, causal=causal, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, dtype)
    o = flashjvp.attention(*xs[:3], causal=causal, **kw)
    assert_close("o (forward only)", o, truth[0], lowp[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize(("case", "lens"), CASES)
def test_backward(case, lens, causal, dtype):
    xs, kw = _inputs(case, lens, dtype)
    leaves = [x.detach().requires_grad_() for x in xs[:3]]
    o = flashjvp.attention(*leaves, causal=causal, **kw)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = grad_refs(*xs[:3], do, causal=causal, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


def test_strided_kv_lens():
    """kv_lens as a strided int32 view (every other element of a longer tensor): the kernels read
    one length per batch element, so they must get the lengths, not the neighbours in memory."""
    xs = make_qkv(2, 2, 2, 37, 45, 16, 16, "bhnd", torch.float32)
    lens = torch.tensor([17, 99, 30, 99], dtype=torch.int32, device=DEVICE)[::2]
    assert not lens.is_contiguous()
    truth, lowp = jvp_refs(*xs, kv_lens=torch.tensor([17, 30], device=DEVICE))
    out = flashjvp.attention_jvp(*xs, kv_lens=lens, return_lse=True)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, torch.float32)
    leaves = [x.detach().requires_grad_() for x in xs[:3]]
    o = flashjvp.attention(*leaves, kv_lens=lens)
    do = torch.randn_like(o)
    o.backward(do)
    truth, lowp = grad_refs(*xs[:3], do, kv_lens=torch.tensor([17, 30], device=DEVICE))
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, torch.float32)


@pytest.mark.parametrize("causal", CAUSAL)
def test_second_order(causal):
    xs, kw = _inputs((2, 2, 1, 21, 30, 16, 16, "bhnd"), [11, 0], torch.float32)
    check_second_order(xs, causal=causal, **kw)


@pytest.mark.skipif(ON_GPU, reason="16-row tiles: interpreter only")
def test_tail_split(monkeypatch):
    """Key shards of a padded batch element: some shards see no valid key."""
    monkeypatch.setattr(_policy, "sm_count", lambda device: 5)
    monkeypatch.setattr(_policy, "SPLIT_MIN_BUCKET", 0)
    monkeypatch.setattr(_policy, "SPLIT_MIN_KEYS", 16)
    xs, kw = _inputs((2, 2, 1, 37, 200, 16, 16, "bhnd"), [30, 200], torch.float32)
    with LaunchLog() as log:
        out = flashjvp.attention_jvp(*xs, return_lse=True, **kw)
    assert log.count("_attn_merge_kernel") == 1, "no split ran"
    truth, lowp = jvp_refs(*xs, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, torch.float32)


def test_compiled_fullgraph():
    xs, kw = _inputs((2, 2, 2, 17, 24, 16, 16, "bhnd"), [5, 24], torch.float32)
    torch._dynamo.reset()
    backend = "inductor" if ON_GPU else "aot_eager"
    f = torch.compile(lambda *a: flashjvp.attention_jvp(*a, causal=True, **kw), backend=backend, fullgraph=True)
    o, to = f(*xs)
    truth, lowp = jvp_refs(*xs, causal=True, **kw)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)
    torch._dynamo.reset()


@pytest.mark.parametrize(("lens", "exc", "msg"), [
    pytest.param([1.0, 2.0], TypeError, "integer dtype", id="float"),
    pytest.param([1, 2, 3], ValueError, r"shape \(2,\)", id="shape"),
    pytest.param("list", TypeError, "torch.Tensor", id="not-a-tensor"),
])
def test_bad_kv_lens(lens, exc, msg):
    q = torch.randn(2, 1, 4, 16, device=DEVICE)
    bad = [1, 2] if lens == "list" else torch.tensor(lens, device=DEVICE)
    with pytest.raises(exc, match=msg):
        flashjvp.attention(q, q, q, kv_lens=bad)
