"""The plain forward and backward through PyTorch's cuDNN attention (``_cudnn.py``).

On the GPU (marked ``gpu``; skipped where cuDNN attention is not usable): cuDNN's forward and
backward against the float64 reference; the backward fed with the ``(o, lse)`` of flashjvp's
fused forward+JVP kernel (the MeanFlow pattern), and the LSE conversion shown to be a view of the
very bytes cuDNN's forward writes; the ``FLASHJVP_CUDNN`` switch through the public
``flashjvp.attention`` (which path ran is read from ``LaunchLog``); unsupported calls never
reaching cuDNN; a cuDNN failure falling back to Triton once and for all.

On the GPU too: the model of PyTorch's own backend choice (``_route.torch_choice``) against
``torch._fused_sdp_choice`` over a table of calls and switches.

On the CPU: the switch's parsing, the refusal memory (with the rule's support stubbed), and the
layout plumbing of both calls on meta tensors (PyTorch's meta functions of the cuDNN operators give
their output shapes and strides). The routing rule itself is tested in test_route.py.
"""

import inspect
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend

import flashjvp
from flashjvp import _backends, _cudnn, _route
from flashjvp._cudnn import (
    contiguous_strides,
    cudnn_bwd,
    cudnn_fwd,
    matching_layout_strides,
    stats_rank,
    with_strides,
)
from flashjvp._launch import LaunchLog
from flashjvp._policy import cudnn_mode
from flashjvp._validate import check_inputs
from helpers import DTYPE_IDS, ON_GPU, assert_close, f64, grad_refs, jvp_refs, make_qkv

HALF = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)]
LAYOUTS = ["bhnd", "bnhd"]
# memory kinds cuDNN takes without copies (helpers.make_tensor): "sliced" and "strided" it refuses
KINDS = ("contiguous", "swapped")


def _cudnn_ready() -> bool:
    if not ON_GPU:
        return False
    dev = _route.device_of(torch.device("cuda"))
    return dev.capability[0] in _route.CUDNN_ARCHS and dev.cudnn_version >= 90000 and dev.cudnn_ops


def supported(q, k, v, a, *, backward: bool = False) -> bool:
    """Whether the rule's cuDNN support takes this live call (``_route.cudnn_supports``)."""
    return _route.cudnn_supports(*_route.describe(q, k, v, a, tangents=False, grad=True), backward=backward)


def routed(q, k, v, a) -> _route.Route:
    """The route of a call whose backward flashjvp runs (the autograd.Function and operator paths)."""
    return _backends.route_of(q, k, v, a, grad=True, in_function=True)


def needs_cudnn(fn):
    """A GPU test that needs PyTorch's cuDNN attention as flashjvp uses it."""
    skip = pytest.mark.skipif(not _cudnn_ready(), reason="PyTorch's cuDNN attention is not usable here (needs "
                              "cuDNN >= 9, the expected operator schemas and an sm90 GPU)")
    return pytest.mark.gpu(skip(fn))


def fwd_refs(q, k, v, **kw):
    """(o, lse) of attention_ref in float64 and in the input dtype."""
    truth = flashjvp.attention_ref(*f64((q, k, v)), return_lse=True, **kw)
    lowp = flashjvp.attention_ref(q, k, v, return_lse=True, **kw)
    return truth, lowp


def check_grads(grads, q, k, v, do, dtype, **kw):
    truth, lowp = grad_refs(q, k, v, do, **kw)
    for name, g, x, ref, ref_lp in zip(("dq", "dk", "dv"), grads, (q, k, v), truth, lowp):
        assert g.stride() == torch.empty_like(x).stride(), f"{name}: strides {g.stride()}"
        assert_close(name, g, ref, ref_lp, dtype)


# --------------------------------------------------------------------------- GPU: the calls

# (B, Hq, Hkv, Nq, Nk, D, causal)
CASES = [
    pytest.param((2, 3, 3, 37, 37, 64, False), id="n37-d64"),
    pytest.param((2, 3, 3, 37, 37, 64, True), id="n37-d64-causal"),
    pytest.param((1, 4, 4, 999, 999, 128, False), id="n999-d128"),
    pytest.param((1, 4, 4, 999, 999, 128, True), id="n999-d128-causal"),
    pytest.param((1, 2, 2, 1000, 1000, 64, "top_left"), id="n1000-d64-tl"),
    pytest.param((1, 2, 2, 1000, 1000, 128, "bottom_right"), id="n1000-d128-br"),
    pytest.param((1, 2, 2, 257, 1000, 64, False), id="ca257x1000-d64"),
    pytest.param((2, 2, 2, 1000, 37, 128, False), id="ca1000x37-d128"),
    pytest.param((1, 2, 2, 300, 1000, 64, "top_left"), id="ca300x1000-d64-tl"),
    pytest.param((1, 2, 2, 1000, 300, 128, "top_left"), id="ca1000x300-d128-tl"),
    pytest.param((1, 8, 2, 999, 999, 128, True), id="gqa4-n999-d128-causal"),
    pytest.param((2, 4, 1, 515, 1000, 64, False), id="mqa-515x1000-d64"),
    pytest.param((1, 2, 2, 999, 999, 32, True), id="n999-d32-causal"),
    pytest.param((4, 16, 16, 256, 256, 72, False), id="dit-n256-d72"),
    pytest.param((2, 4, 4, 257, 512, 72, False), id="ca257x512-d72"),
    pytest.param((1, 2, 2, 999, 999, 96, True), id="n999-d96-causal"),
    pytest.param((2, 3, 3, 37, 37, 40, False), id="n37-d40"),
    pytest.param((1, 2, 2, 300, 300, 256, True), id="n300-d256-causal"),
    pytest.param((1, 4, 4, 1000, 1000, 192, False), id="n1000-d192"),
]


@needs_cudnn
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_cudnn_forward_backward(case, layout, dtype):
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, d, layout, dtype, kinds=KINDS, tangents=False)
    a = check_inputs(q, k, v, causal=causal, layout=layout)
    assert supported(q, k, v, a) and supported(q, k, v, a, backward=True)
    o, lse = cudnn_fwd(q, k, v, a)
    assert o.stride() == contiguous_strides(o.shape)  # attn_fwd's contract (the fake tensors')
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32 and lse.is_contiguous()
    truth, lowp = fwd_refs(q, k, v, causal=causal, layout=layout)
    assert_close("o", o, truth[0], lowp[0], dtype)
    assert_close("lse", lse, truth[1], lowp[1], dtype)
    do = torch.randn_like(o)
    check_grads(cudnn_bwd(do, q, k, v, o, lse, a), q, k, v, do, dtype, causal=causal, layout=layout)



@needs_cudnn
@pytest.mark.parametrize("dtype", HALF)
def test_cudnn_packed_qkv(dtype):
    """bnhd views of one packed (B, N, 3, H, D) tensor (``qkv.unbind(2)``), and a dO whose
    strides differ from o's (copied to o's layout for cuDNN)."""
    qkv = torch.randn(2, 777, 3, 4, 64, device="cuda").to(dtype)
    q, k, v = qkv.unbind(2)
    a = check_inputs(q, k, v, causal=True, layout="bnhd")
    assert supported(q, k, v, a, backward=True)
    o, lse = cudnn_fwd(q, k, v, a)
    assert o.stride() == contiguous_strides(o.shape)
    truth, lowp = fwd_refs(q, k, v, causal=True, layout="bnhd")
    assert_close("o", o, truth[0], lowp[0], dtype)
    do = torch.randn(2, 4, 777, 64, device="cuda").to(dtype).transpose(1, 2)  # bhnd storage
    check_grads(cudnn_bwd(do, q, k, v, o, lse, a), q, k, v, do, dtype, causal=True, layout="bnhd")



# --------------------------------------------------------------------------- GPU: the MeanFlow pattern

MEANFLOW_CASES = [
    pytest.param((2, 4, 4, 1000, 1000, 64, True), id="n1000-d64-causal"),
    pytest.param((1, 4, 4, 999, 999, 128, False), id="n999-d128"),
    pytest.param((1, 8, 2, 1024, 1024, 128, True), id="gqa4-n1024-d128-causal"),
    pytest.param((1, 2, 2, 257, 1000, 64, False), id="ca257x1000-d64"),
]


@needs_cudnn
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", MEANFLOW_CASES)
def test_cudnn_backward_from_fused_jvp_forward(case, layout, dtype):
    """cuDNN's backward from the o and lse of flashjvp's fused forward+JVP (Triton) kernel."""
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v, tq, tk, tv = make_qkv(b, hq, hkv, nq, nk, d, d, layout, dtype, kinds=KINDS)
    o, to, lse, mu = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, layout=layout, return_lse=True)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=causal, layout=layout)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert_close(name, got, ref, ref_lp, dtype)
    a = check_inputs(q, k, v, causal=causal, layout=layout)
    do = torch.randn_like(o)
    check_grads(cudnn_bwd(do, q, k, v, o, lse, a), q, k, v, do, dtype, causal=causal, layout=layout)



@needs_cudnn
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lse_conversion_is_exact(monkeypatch, layout):
    """cuDNN's own forward LSE and what cudnn_bwd hands its backward: the same bytes with the same
    shape and strides. flashjvp's (B, H, Nq) LSE becomes cuDNN's (B, H, Nq, 1) as a view."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "0")  # flashjvp's own forward below
    q, k, v = make_qkv(2, 4, 2, 999, 1000, 64, 64, layout, torch.bfloat16, kinds=KINDS, tangents=False)
    a = check_inputs(q, k, v, causal=True, layout=layout)
    view = (lambda x: x) if layout == "bhnd" else (lambda x: x.transpose(1, 2))
    raw = torch.ops.aten._scaled_dot_product_cudnn_attention(view(q), view(k), view(v), None, True, 0.0, True,
                                                            False, scale=a.scale)
    o, lse = cudnn_fwd(q, k, v, a)
    assert stats_rank() == raw[1].dim() and raw[1].shape[:3] == (2, 4, 999) and raw[1].dtype == torch.float32
    assert torch.equal(view(o), raw[0]) and torch.equal(lse, raw[1].reshape(2, 4, 999))
    stats = lse.view(raw[1].shape)  # what cudnn_bwd passes: (2, 4, 999, 1)
    assert stats.data_ptr() == lse.data_ptr() and stats.stride() == raw[1].stride() and torch.equal(stats, raw[1])
    # flashjvp's own LSE has the same layout and agrees with cuDNN's to float32 rounding
    _, _, lse_t, _ = flashjvp.attention_jvp(q, k, v, None, None, None, causal=True, layout=layout, return_lse=True)
    assert lse_t.shape == lse.shape and lse_t.stride() == lse.stride() and lse_t.dtype == lse.dtype
    torch.testing.assert_close(lse_t, lse, rtol=1e-5, atol=1e-4)


@needs_cudnn
@pytest.mark.parametrize("dtype", HALF)
def test_meanflow_pattern_through_attention(monkeypatch, dtype):
    """torch.func.jvp through flashjvp.attention (fused forward+JVP kernel), then gradients through
    its o: with FLASHJVP_CUDNN=1 the backward runs on cuDNN from the fused kernel's o and lse."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "1")
    q, k, v, tq, tk, tv = make_qkv(1, 4, 4, 1024, 1024, 64, 64, "bnhd", dtype, kinds=KINDS)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with LaunchLog() as log:
        o, to = torch.func.jvp(lambda q_, k_, v_: flashjvp.attention(q_, k_, v_, causal=True, layout="bnhd"),
                               tuple(leaves), (tq, tk, tv))
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) >= 1 and log.count("cudnn_sdpa_fwd") == 0
    assert log.count("cudnn_sdpa_bwd") == 1 and log.count("_attn_bwd_dq_kernel") == 0
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=True, layout="bnhd")
    assert_close("o", o, truth[0], lowp[0], dtype)
    assert_close("to", to, truth[1], lowp[1], dtype)
    check_grads(grads, q, k, v, do, dtype, causal=True, layout="bnhd")



# --------------------------------------------------------------------------- GPU: the switch


@needs_cudnn
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["0", "1", "auto", "never", "always"])
@pytest.mark.parametrize("case", [pytest.param((1, 4, 4, 1024, 1024, 64, True), id="n1024-d64-causal"),
                                  pytest.param((2, 2, 2, 37, 37, 128, False), id="n37-d128")])
def test_switch_through_attention(monkeypatch, case, mode, layout, dtype):
    """flashjvp.attention, forward without grad and forward + backward with grad, under each
    FLASHJVP_CUDNN value: the expected path runs and the results agree with the reference."""
    monkeypatch.setenv("FLASHJVP_CUDNN", mode)
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, d, layout, dtype, kinds=KINDS, tangents=False)
    forced = {"0": False, "never": False, "1": True, "always": True}
    qb, kb, vb = (x if layout == "bhnd" else x.transpose(1, 2) for x in (q, k, v))
    # auto: the backend PyTorch's SDPA picks (its flash operator directly, or cuDNN)
    picked = torch._fused_sdp_choice(qb, kb, vb, None, 0.0, causal)
    want_flash = mode == "auto" and picked == SDPBackend.FLASH_ATTENTION
    want_fwd = forced.get(mode, mode == "auto" and picked == SDPBackend.CUDNN_ATTENTION)
    want_bwd = want_fwd
    truth, lowp = fwd_refs(q, k, v, causal=causal, layout=layout)
    with LaunchLog() as log, torch.no_grad():
        o = flashjvp.attention(q, k, v, causal=causal, layout=layout)
    assert log.count("cudnn_sdpa_fwd", LSE=False) == int(want_fwd)  # no backward follows: inference kernel
    assert log.count("torch_flash_fwd") == int(want_flash)
    assert (log.count("_attn_fwd_kernel") == 0) == (want_fwd or want_flash)
    assert_close("o", o, truth[0], lowp[0], dtype)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with LaunchLog() as log:
        o = flashjvp.attention(*leaves, causal=causal, layout=layout)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
    assert log.count("cudnn_sdpa_fwd", LSE=True) == int(want_fwd)
    assert (log.count("_attn_bwd_dq_kernel") == 0) == (want_bwd or want_flash)
    if (want_fwd and want_bwd) or want_flash:  # the plain plan: PyTorch's operator, its backward recorded natively
        assert type(o.grad_fn).__name__ in ("ScaledDotProductCudnnAttentionBackward0", "CloneBackward0",
                                            "ScaledDotProductFlashAttentionBackward0", "TransposeBackward0"), o.grad_fn
    else:
        assert log.count("cudnn_sdpa_bwd") == int(want_bwd)
    assert_close("o", o, truth[0], lowp[0], dtype)
    check_grads(grads, q, k, v, do, dtype, causal=causal, layout=layout)



@needs_cudnn
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(32, 16, 256, 72), (8, 16, 1024, 64), (2, 8, 999, 128), (4, 6, 333, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_auto_runs_pytorchs_own_backend(monkeypatch, shape, causal):
    """FLASHJVP_CUDNN=auto: a plain flashjvp.sdpa call with grad records the same backward node as
    F.scaled_dot_product_attention on the same tensors (the backend PyTorch picks, kernel for
    kernel: a plain call is never slower than SDPA for a worse backend), with SDPA's output
    strides and values."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "auto")
    b, h, n, d = shape
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # a DiT's packed projection: (B, H, N, D) views
    ours = flashjvp.sdpa(q, k, v, is_causal=causal)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert type(ours.grad_fn).__name__ == type(theirs.grad_fn).__name__
    assert ours.stride() == theirs.stride()
    truth, lowp = fwd_refs(q, k, v, causal=causal, layout="bhnd")
    assert_close("o", ours, truth[0], lowp[0], torch.bfloat16)


@needs_cudnn
@pytest.mark.parametrize("mode", ["0", "1"])
def test_switch_compiled(monkeypatch, mode):
    """torch.compile(fullgraph=True) forward and backward under both forced paths: the
    flashjvp::fwd / ::bwd operators run the switch's kernels (Triton for 0, cuDNN for 1) where cuDNN
    takes the call, and Triton where it cannot (a bottom-right alignment with Nq != Nk); their
    fake tensors promise the strides either gives (Inductor checks them at run time)."""
    monkeypatch.setenv("FLASHJVP_CUDNN", mode)
    dtype = torch.bfloat16
    qkv = torch.randn(2, 1024, 3, 4, 64, device="cuda").to(dtype)
    q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(2))

    @torch.compile(fullgraph=True)
    def f(q, k, v, causal):
        return flashjvp.attention(q, k, v, causal=causal, layout="bnhd") * 2

    with LaunchLog() as log:
        o = f(q, k, v, True)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), do)
    kernels = ["cudnn_sdpa_fwd", "cudnn_sdpa_bwd"] if mode == "1" else \
        ["_attn_fwd_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_dkdv_kernel"]
    assert [launch.kernel for launch in log.launches] == kernels
    truth, lowp = fwd_refs(q, k, v, causal=True, layout="bnhd")
    assert_close("o", o / 2, truth[0], lowp[0], dtype)
    check_grads([g / 2 for g in grads], q, k, v, do, dtype, causal=True, layout="bnhd")
    q2 = q[:, :1000].detach().requires_grad_()  # Nq != Nk, bottom-right: SDPA has no such mask
    with LaunchLog() as log:
        o = f(q2, k, v, "bottom_right")
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q2, k, v), do)
    assert log.count("cudnn_sdpa_fwd") == 0 and log.count("_attn_fwd_kernel") == 1  # cuDNN lacks the mask too
    truth, lowp = fwd_refs(q2, k, v, causal="bottom_right", layout="bnhd")
    assert_close("o", o / 2, truth[0], lowp[0], dtype)
    check_grads([g / 2 for g in grads], q2, k, v, do, dtype, causal="bottom_right", layout="bnhd")



# --------------------------------------------------------------------------- GPU: never cuDNN


def _unsupported_cases():
    """(name, q, k, v, AttnArgs, runnable through flashjvp.attention) that cuDNN must never get."""
    bf = torch.bfloat16
    qkv = lambda *shape, **kw: make_qkv(*shape, tangents=False, **kw)  # noqa: E731
    out = []
    q, k, v = qkv(2, 2, 2, 512, 512, 64, 64, "bhnd", bf, kinds=KINDS)
    lens = torch.tensor([100, 512], device="cuda")
    out.append(("kv_lens", q, k, v, check_inputs(q, k, v, kv_lens=lens), dict(kv_lens=lens)))
    out.append(("window", q, k, v, check_inputs(q, k, v, window=(64, 64)), None))
    if "attn_mask" in inspect.signature(check_inputs).parameters:
        mask = torch.rand(2, 1, 512, 512, device="cuda") > 0.2
        out.append(("attn_mask", q, k, v, check_inputs(q, k, v, attn_mask=mask), None))
    out.append(("bottom_right Nq != Nk", *(x := qkv(1, 2, 2, 300, 512, 64, 64, "bhnd", bf, kinds=KINDS)),
                check_inputs(*x, causal="bottom_right"), dict(causal="bottom_right")))
    out.append(("D=36", *(x := qkv(1, 2, 2, 512, 512, 36, 36, "bhnd", bf, kinds=KINDS)), check_inputs(*x), {}))
    out.append(("D=264", *(x := qkv(1, 2, 2, 512, 512, 264, 264, "bhnd", bf, kinds=KINDS)), check_inputs(*x), None))
    out.append(("Dqk != Dv", *(x := qkv(1, 2, 2, 512, 512, 64, 128, "bhnd", bf, kinds=KINDS)), check_inputs(*x), {}))
    out.append(("fp32", *(x := qkv(1, 2, 2, 512, 512, 64, 64, "bhnd", torch.float32, kinds=KINDS)),
                check_inputs(*x), {}))
    out.append(("Nk=1", *(x := qkv(1, 2, 2, 512, 1, 64, 64, "bhnd", bf, kinds=KINDS)), check_inputs(*x), {}))
    out.append(("strided head dim", *(x := qkv(1, 2, 2, 512, 512, 64, 64, "bhnd", bf, kinds=("strided",))),
                check_inputs(*x), {}))
    out.append(("misaligned", *(x := qkv(1, 2, 2, 512, 512, 64, 64, "bnhd", bf, kinds=("sliced",))),
                check_inputs(*x, layout="bnhd"), dict(layout="bnhd")))
    return out


@needs_cudnn
def test_unsupported_never_reach_cudnn(monkeypatch):
    monkeypatch.setenv("FLASHJVP_CUDNN", "1")
    for name, q, k, v, a, kw in _unsupported_cases():
        assert not supported(q, k, v, a), name
        assert not supported(q, k, v, a, backward=True), name
        route = routed(q, k, v, a)
        assert route.fwd != "cudnn" and route.bwd != "cudnn", name
        if kw is None:  # not a call flashjvp.attention takes
            continue
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        with LaunchLog() as log:
            o = flashjvp.attention(*leaves, **kw)
            do = torch.randn_like(o)
            grads = torch.autograd.grad(o, leaves, do)
        assert log.count("cudnn_sdpa_fwd") == log.count("cudnn_sdpa_bwd") == 0, name
        truth, lowp = fwd_refs(q, k, v, **kw)
        assert_close(f"{name}: o", o, truth[0], lowp[0], q.dtype)
        check_grads(grads, q, k, v, do, q.dtype, **kw)



@needs_cudnn
def test_deterministic_mode_keeps_backward_on_triton():
    q, k, v = make_qkv(1, 2, 2, 1024, 1024, 64, 64, "bhnd", torch.bfloat16, kinds=KINDS, tangents=False)
    a = check_inputs(q, k, v)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert supported(q, k, v, a) and not supported(q, k, v, a, backward=True)
        assert routed(q, k, v, a).bwd == "triton"
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    assert supported(q, k, v, a, backward=True)



@needs_cudnn
def test_cudnn_failure_falls_back_once(monkeypatch):
    """cuDNN raising: one warning, the Triton result, and the shape class never tried again."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "1")
    monkeypatch.setattr(_cudnn, "_REFUSED", {})
    calls = []

    def fail(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("cuDNN Frontend error: no valid engine (simulated)")

    monkeypatch.setattr(_cudnn, "_ops", lambda: (fail, fail))
    q, k, v = make_qkv(1, 2, 2, 1024, 1024, 64, 64, "bhnd", torch.bfloat16, kinds=KINDS, tangents=False)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with pytest.warns(RuntimeWarning, match="cuDNN attention forward failed"):
        o = flashjvp.attention(*leaves, causal=True)
    do = torch.randn_like(o)
    with warnings.catch_warnings():  # the backward may warn on the autograd engine's thread
        warnings.simplefilter("ignore")
        grads = torch.autograd.grad(o, leaves, do)
    assert len(calls) == 2 and len(_cudnn._REFUSED) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = flashjvp.attention(*leaves, causal=True)
        grads = torch.autograd.grad(o, leaves, do)
    assert len(calls) == 2 and not [w for w in caught if "cuDNN" in str(w.message)]  # not tried again
    truth, lowp = fwd_refs(q, k, v, causal=True)
    assert_close("o", o, truth[0], lowp[0], torch.bfloat16)
    check_grads(grads, q, k, v, do, torch.bfloat16, causal=True)


# --------------------------------------------------------------------------- GPU: PyTorch's own choice

_SDPB = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash",
         SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.MATH: "math"}
# (B, H, Nq, Nk, D, dtype, causal, grad)
BF = torch.bfloat16
CHOICE_CASES = [(32, 16, 256, 256, 72, BF, False, True), (8, 16, 1024, 1024, 72, BF, False, False),
                (2, 8, 4096, 4096, 128, torch.float16, True, True), (2, 4, 300, 512, 64, BF, True, True),
                (2, 4, 512, 300, 64, BF, True, False), (1, 4, 999, 999, 256, BF, True, True),
                (1, 4, 999, 999, 192, BF, False, True), (2, 4, 64, 1, 64, BF, False, False),
                (2, 4, 77, 77, 36, BF, False, True), (2, 4, 77, 77, 40, torch.float16, True, True),
                (2, 4, 77, 77, 64, torch.float32, False, True), (2, 4, 77, 77, 96, torch.float32, True, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("switch", ["default", "no-cudnn", "no-flash", "math-only", "flash-first", "deterministic"])
def test_torch_choice_model_matches_pytorch(switch):
    """_route.torch_choice, the pure model of SDPA's backend choice that routing uses, against
    torch._fused_sdp_choice on the same calls of this GPU and PyTorch, under SDPA's switches."""
    from torch.nn.attention import sdpa_kernel

    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    ctx = {"default": lambda: sdpa_kernel(every),
           "no-cudnn": lambda: sdpa_kernel(every[1:]),
           "no-flash": lambda: sdpa_kernel([every[0], *every[2:]]),
           "math-only": lambda: sdpa_kernel([SDPBackend.MATH]),
           "flash-first": lambda: sdpa_kernel([every[1], every[0], every[2], every[3]], set_priority=True),
           "deterministic": lambda: sdpa_kernel(every)}[switch]
    x = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    torch._fused_sdp_choice(x, x, x)  # PyTorch sets its priority order on the first call
    was = torch.are_deterministic_algorithms_enabled()
    try:
        if switch == "deterministic":
            torch.use_deterministic_algorithms(True)
        with ctx():
            for b, h, nq, nk, d, dtype, causal, grad in CHOICE_CASES:
                q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype, requires_grad=grad)
                k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=dtype, requires_grad=grad) for _ in range(2))
                a = check_inputs(q, k, v, causal=causal)
                call, dev, sw = _route.describe(q, k, v, a, tangents=False, grad=grad)
                theirs = _SDPB[SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal))]
                assert _route.torch_choice(call, dev, sw) == theirs, (switch, call, dev, sw)
    finally:
        torch.use_deterministic_algorithms(was)


# --------------------------------------------------------------------------- CPU: switch and policy


def test_cudnn_mode(monkeypatch):
    monkeypatch.delenv("FLASHJVP_CUDNN", raising=False)
    assert cudnn_mode() == "auto"
    for value, mode in (("auto", "auto"), ("0", "never"), ("never", "never"), ("1", "always"),
                        ("ALWAYS", "always"), (" 0 ", "never")):
        monkeypatch.setenv("FLASHJVP_CUDNN", value)
        assert cudnn_mode() == mode, value
    monkeypatch.setenv("FLASHJVP_CUDNN", "yes")
    with pytest.raises(ValueError, match="FLASHJVP_CUDNN"):
        cudnn_mode()


def _cpu_args(n=1024, d=64, dtype=torch.bfloat16, **kw):
    q, k, v = (torch.randn(1, 2, n, d, dtype=dtype) for _ in range(3))
    return q, k, v, check_inputs(q, k, v, **kw)


@pytest.mark.parametrize("mode", ["auto", "0", "1"])
def test_cpu_tensors_never_use_cudnn(monkeypatch, mode):
    monkeypatch.setenv("FLASHJVP_CUDNN", mode)
    q, k, v, a = _cpu_args()
    assert not supported(q, k, v, a) and not supported(q, k, v, a, backward=True)
    route = routed(q, k, v, a)
    assert "cudnn" not in (route.fwd, route.bwd)


def test_refusal_is_remembered(monkeypatch):
    """A failing cuDNN call: the Triton result, one warning, the shape class routed to Triton from
    then on; an out-of-memory error is not a refusal. (The rule's support is stubbed: CPU tensors.)"""
    monkeypatch.setenv("FLASHJVP_CUDNN", "1")
    monkeypatch.setattr(_cudnn, "_REFUSED", {})
    monkeypatch.setattr(_route, "device_of", lambda device: _route.Device())  # described as an H100
    monkeypatch.setattr(_route, "cudnn_supports", lambda call, dev, sw, *, backward: (
        ("bwd" if backward else "fwd") not in sw.refused))
    q, k, v, a = _cpu_args(64, 16, dtype=torch.float32)
    assert routed(q, k, v, a).fwd == "cudnn"

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("simulated")

    monkeypatch.setattr(_cudnn, "_ops", lambda: (oom, oom))
    o, _, lse, _ = _backends.run_fwd(q, k, v, a, "cudnn")
    assert not _cudnn._REFUSED and routed(q, k, v, a).fwd == "cudnn"

    def fail(*args, **kwargs):
        raise RuntimeError("no engine (simulated)")

    monkeypatch.setattr(_cudnn, "_ops", lambda: (fail, fail))
    with pytest.warns(RuntimeWarning, match="forward failed"):
        o, _, lse, _ = _backends.run_fwd(q, k, v, a, "cudnn")  # Triton (the interpreter) instead
    truth, lowp = fwd_refs(q, k, v)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert list(_cudnn._REFUSED) == [_cudnn.refusal_key(q, a, False)]
    route = routed(q, k, v, a)
    assert route.fwd == "triton" and route.bwd == "cudnn"
    # another length bucket of the same heads and dims is tried
    q2, k2, v2, a2 = _cpu_args(4096, 16, dtype=torch.float32)
    assert routed(q2, k2, v2, a2).fwd == "cudnn"


def test_strides_rule():
    ok = _cudnn.strides_ok
    x = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)
    assert ok(x) and ok(x.transpose(1, 2))
    assert ok(torch.randn(2, 5, 3, 4, 64, dtype=torch.bfloat16).unbind(2)[1])  # packed qkv
    assert not ok(torch.randn(2, 8, 4, 128, dtype=torch.bfloat16)[..., ::2])  # head dim stride 2
    assert not ok(torch.randn(2, 8, 4, 72, dtype=torch.bfloat16)[..., 3:67])  # pointer off 16 bytes
    assert not ok(torch.randn(2, 8, 4, 68, dtype=torch.bfloat16)[..., :64])  # row stride 68
    assert not ok(torch.randn(2, 1, 4, 64, dtype=torch.bfloat16).expand(2, 8, 4, 64))  # broadcast heads


def test_stride_helpers():
    q = torch.randn(2, 5, 3, 4, 64).unbind(2)[0].transpose(1, 2)  # packed bnhd, as a (B, H, N, D) view
    assert matching_layout_strides(q, (2, 4, 5, 32)) == (5 * 4 * 32, 32, 4 * 32, 1)
    assert matching_layout_strides(torch.empty(2, 4, 5, 64), (2, 4, 5, 32)) == contiguous_strides((2, 4, 5, 32))
    x = torch.randn(2, 1, 5, 8)
    assert with_strides(x, x.stride()) is x
    y = with_strides(x, (40, 999, 8, 1))  # a size-1 dim's stride: a view
    assert y.stride() == (40, 999, 8, 1) and y.data_ptr() == x.data_ptr() and torch.equal(y, x)
    z = with_strides(x.transpose(2, 3), contiguous_strides((2, 1, 8, 5)))  # a copy
    assert z.is_contiguous() and torch.equal(z, x.transpose(2, 3))
    # torch.empty_like's strides (what autograd and the fake backward give the gradients), for a q
    # cut from a packed qkv projection as attention sees it, (B, H, N, D) and (B, N, H, D), too
    qkv = torch.randn(2, 5, 3, 4, 64).permute(2, 0, 3, 1, 4)  # DiT's qkv.view(b, n, 3, h, d).permute
    for y in (q, q.transpose(1, 2), x.transpose(2, 3), qkv[0], qkv[1].transpose(1, 2), torch.randn(2, 4, 5, 64)):
        assert _cudnn.empty_like_strides(y) == torch.empty_like(y).stride(), y.stride()
    off = torch.randn(2 * 4 * 5 * 8 + 1)[1:].view(2, 4, 5, 8)  # 4 bytes past a 16-byte boundary
    assert off.data_ptr() % 16
    aligned = with_strides(off, off.stride(), align=True)  # cuDNN wants 16-byte aligned o and dO
    assert aligned.data_ptr() % 16 == 0 and aligned.stride() == off.stride() and torch.equal(aligned, off)
    assert with_strides(off, off.stride()) is off


# --------------------------------------------------------------------------- CPU: layouts on meta tensors

META_LAYOUTS = [("bhnd", "contiguous"), ("bhnd", "swapped"), ("bnhd", "contiguous"), ("bnhd", "swapped"),
                ("bnhd", "packed")]


@pytest.mark.skipif(_cudnn.cudnn_ops() is None, reason="this PyTorch lacks the expected cuDNN SDPA schemas")
@pytest.mark.parametrize("layout,kind", META_LAYOUTS)
@pytest.mark.parametrize("hkv", [4, 2])
def test_layout_plumbing_on_meta(layout, kind, hkv):
    """cudnn_fwd and cudnn_bwd through the operators' meta functions: o contiguous in the call's
    layout, lse (B, H, Nq) contiguous float32, gradients with torch.empty_like's strides."""
    from flashjvp._launch import out_buffer

    b, hq, nq, nk, d = 2, 4, 37, 50, 64
    meta = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    if kind == "packed":
        nk = nq
        hkv = hq
        q, k, v = meta(b, nq, 3, hq, d).unbind(2)
    else:
        def make(h, n):
            shape = (b, h, n, d) if layout == "bhnd" else (b, n, h, d)
            return meta(*shape) if kind == "contiguous" else meta(shape[0], shape[2], shape[1], d).transpose(1, 2)
        q, k, v = make(hq, nq), make(hkv, nk), make(hkv, nk)
    a = check_inputs(q, k, v, causal=True, layout=layout)
    o, lse = cudnn_fwd(q, k, v, a)
    want = out_buffer(a, q)  # what attn_fwd's Triton path returns
    assert o.shape == want.shape and o.stride() == want.stride()
    assert lse.shape == (b, hq, nq) and lse.is_contiguous() and lse.dtype == torch.float32
    do = meta(o.shape[0], o.shape[2], o.shape[1], d).transpose(1, 2)  # strides unlike o's
    grads = cudnn_bwd(do, q, k, v, o, lse, a)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.stride() == torch.empty_like(x).stride()


# --------------------------------------------------------------------------- CPU: a math stand-in for cuDNN


def _math_cudnn_ops():
    """CPU stand-ins with the cuDNN operators' conventions: (B, H, N, D) tensors, Hkv dividing Hq,
    top-left causal, a natural-log (B, H, Nq, 1) float32 LSE, o in q's dimension order; the backward
    recomputes P from the LSE it is given (as cuDNN does) and checks what it receives."""

    def scores(q, k, is_causal, scale):
        g = q.shape[1] // k.shape[1]
        s = q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2) * scale
        if is_causal:
            i = torch.arange(q.shape[2])[:, None]
            s = s.masked_fill(torch.arange(k.shape[2])[None, :] > i, float("-inf"))
        return s, g

    def fwd(q, k, v, attn_bias, compute_lse, dropout_p, is_causal, debug, *, scale):
        assert attn_bias is None and dropout_p == 0.0 and not debug
        s, g = scores(q, k, is_causal, scale)
        lse = torch.logsumexp(s, -1, keepdim=True)
        o = torch.exp(s - lse) @ v.double().repeat_interleave(g, 1)
        shape = (*q.shape[:3], v.shape[3])
        out = torch.empty_strided(shape, matching_layout_strides(q, shape), dtype=q.dtype).copy_(o)
        lse = lse.float() if compute_lse else torch.empty(0)  # PyTorch: an empty tensor without it
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def bwd(do, q, k, v, o, stats, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, *, scale):
        b, h, nq, _ = q.shape
        assert stats.shape == (b, h, nq, 1) and stats.stride() == contiguous_strides(stats.shape)
        assert stats.dtype == torch.float32 and o.stride() == do.stride() == matching_layout_strides(q, o.shape)
        assert (max_q, max_k, dropout_p, bias, cum_q, cum_k) == (nq, k.shape[2], 0.0, None, None, None)
        s, g = scores(q, k, is_causal, scale)
        p = torch.exp(s - stats.double())
        vg = v.double().repeat_interleave(g, 1)
        ds = p * (do.double() @ vg.transpose(-1, -2) - (do.double() * o.double()).sum(-1, keepdim=True))
        dq = ds @ k.double().repeat_interleave(g, 1) * scale
        fold = lambda x: x.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
        dk = fold(ds.transpose(-1, -2) @ q.double() * scale)
        dv = fold(p.transpose(-1, -2) @ do.double())
        return tuple(torch.empty_like(x).copy_(gx) for x, gx in ((q, dq), (k, dk), (v, dv)))

    return fwd, bwd


@pytest.mark.parametrize("layout,kinds", [("bhnd", ("contiguous",)), ("bnhd", ("contiguous",)),
                                          ("bhnd", KINDS), ("bnhd", KINDS)])
@pytest.mark.parametrize("case", [pytest.param((2, 4, 4, 37, 37, 16, True), id="n37-causal"),
                                  pytest.param((1, 4, 2, 19, 45, 32, False), id="gqa2-19x45"),
                                  pytest.param((1, 2, 1, 45, 19, 16, "top_left"), id="mqa-45x19-tl")])
def test_plumbing_with_math_stand_in(monkeypatch, case, layout, kinds):
    """cudnn_fwd and cudnn_bwd end to end on the CPU with the math stand-ins for the operators: the
    views, strides and the LSE conversion, and the MeanFlow pattern (the backward from the (o, lse)
    of flashjvp's fused forward+JVP kernel, here in Triton's interpreter) against the reference."""
    monkeypatch.setattr(_cudnn, "_ops", _math_cudnn_ops)
    b, hq, hkv, nq, nk, d, causal = case
    dtype = torch.float32
    q, k, v, tq, tk, tv = make_qkv(b, hq, hkv, nq, nk, d, d, layout, dtype, kinds=kinds, device="cpu")
    a = check_inputs(q, k, v, causal=causal, layout=layout)
    o, lse = cudnn_fwd(q, k, v, a)
    assert o.stride() == contiguous_strides(o.shape) and lse.shape == (b, hq, nq) and lse.is_contiguous()
    o_inference, none = cudnn_fwd(q, k, v, a, need_lse=False)  # no backward follows: no lse
    assert none is None and torch.equal(o_inference, o)
    truth, lowp = fwd_refs(q, k, v, causal=causal, layout=layout)
    assert_close("o", o, truth[0], lowp[0], dtype)
    assert_close("lse", lse, truth[1], lowp[1], dtype)
    do = torch.randn_like(o)
    check_grads(cudnn_bwd(do, q, k, v, o, lse, a), q, k, v, do, dtype, causal=causal, layout=layout)
    check_grads(cudnn_bwd(do.transpose(1, 2).contiguous().transpose(1, 2), q, k, v, o, lse, a), q, k, v, do,
                dtype, causal=causal, layout=layout)
    o_t, _, lse_t, _ = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, layout=layout, return_lse=True)
    check_grads(cudnn_bwd(do, q, k, v, o_t, lse_t, a), q, k, v, do, dtype, causal=causal, layout=layout)
