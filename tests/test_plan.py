"""The eager host path: plans cached per call signature (``_plan.py``; the Triton launch plans of
``_fwd``/``_bwd``), the direct path inside one ``torch.func.jvp``, and CUDA graph capture.

Every repeated call is checked against the float64 reference (a plan must compute what the checked
path computes, for every signature it is reused for), on NaN-poisoned outputs."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import flashjvp
from flashjvp import _bwd, _fwd, _plan
from flashjvp._launch import PLANS, LaunchLog
from helpers import DEVICE, ON_GPU, assert_close, f64, grad_refs, jvp_refs, make_qkv

gpu = pytest.mark.gpu


def _plain_plans() -> list:
    """The eager plain plans in the one plan cache (its other entries: routes, launch plans)."""
    return [key for key in PLANS if key[0] == "plain"]

# (B, Hq, Hkv, Nq, Nk, D, causal)
PLAIN_CASES = [
    pytest.param((4, 16, 16, 256, 256, 72, False), id="dit-n256-d72"),
    pytest.param((2, 4, 4, 257, 512, 72, False), id="xattn-257x512-d72"),
    pytest.param((2, 3, 3, 37, 37, 64, True), id="n37-d64-causal"),
    pytest.param((1, 8, 2, 200, 200, 128, True), id="gqa4-n200-d128-causal"),
    pytest.param((2, 2, 2, 33, 33, 36, False), id="n33-d36"),  # no cuDNN: the Triton plan
]


def _refs(q, k, v, do, causal, layout):
    o64 = flashjvp.attention_ref(*f64((q, k, v)), causal=causal, layout=layout)
    o_lp = flashjvp.attention_ref(q, k, v, causal=causal, layout=layout)
    return (o64, o_lp), grad_refs(q, k, v, do, causal=causal, layout=layout)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("mode", ["0", "1"])
@pytest.mark.parametrize("case", PLAIN_CASES)
def test_plain_plans_repeat_correctly(monkeypatch, case, mode, layout, dtype):
    """attention and (bhnd) sdpa, without and with grad, three calls each on fresh inputs of one
    signature (the first makes the plan, the others reuse it), then on inputs of other strides
    (a new plan): every output and gradient against the float64 reference."""
    monkeypatch.setenv("FLASHJVP_CUDNN", mode)
    b, hq, hkv, nq, nk, d, causal = case
    fns = [lambda q, k, v: flashjvp.attention(q, k, v, causal=causal, layout=layout)]
    if layout == "bhnd":
        fns.append(lambda q, k, v: flashjvp.sdpa(q, k, v, is_causal=bool(causal), enable_gqa=hq != hkv))
    for fn in fns:
        for kinds in [("contiguous",)] * 3 + [("swapped", "sliced", "contiguous")] * 2:
            q, k, v = make_qkv(b, hq, hkv, nq, nk, d, d, layout, dtype, kinds=kinds, tangents=False)
            with torch.no_grad():
                o = fn(q, k, v)
            do = torch.randn_like(o)
            (o64, o_lp), (g64, g_lp) = _refs(q, k, v, do, causal, layout)
            assert_close("o (no grad)", o, o64, o_lp, dtype)
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o = fn(*leaves)
            assert_close("o", o, o64, o_lp, dtype)
            for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), torch.autograd.grad(o, leaves, do), g64, g_lp):
                assert_close(name, g, ref, ref_lp, dtype)
    assert len(_plain_plans()) >= 4  # (grad, no grad) x (two stride patterns) per function


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_triton_launch_plans_repeat_correctly(monkeypatch, layout, dtype):
    """attention_jvp and the Triton backward: a repeated signature launches through its plan
    (no JIT launch), on fresh inputs, with results that match the reference; inputs with other
    strides or an unaligned pointer take the JIT launch again."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "0")
    jit = []
    for module in (_fwd, _bwd):
        real = module.plan_tuned
        monkeypatch.setattr(module, "plan_tuned", lambda *a, _real=real, **kw: (jit.append(a[0]), _real(*a, **kw))[1])
    shape = (2, 4, 2, 77, 130, 72, 72, layout, dtype)
    for i, kinds in enumerate([("contiguous",)] * 3 + [("swapped", "strided", "contiguous")] * 2):
        q, k, v, tq, tk, tv = make_qkv(*shape, kinds=kinds)
        out = flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=True, layout=layout, return_lse=True)
        truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal=True, layout=layout)
        for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
            assert_close(f"{name} (call {i})", got, ref, ref_lp, dtype)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = flashjvp.attention(*leaves, causal=True, layout=layout)
        do = torch.randn_like(o)
        g64, g_lp = grad_refs(q, k, v, do, causal=True, layout=layout)
        for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), torch.autograd.grad(o, leaves, do), g64, g_lp):
            assert_close(f"{name} (call {i})", g, ref, ref_lp, dtype)
    # per stride pattern: the first call JIT-launches forward+JVP, the plain forward and the two
    # backward kernels once; the repeats launch through plans
    assert len(jit) == 2 * 4, [getattr(k, "base_fn", k).__name__ for k in jit]


@gpu
def test_unaligned_pointer_takes_the_jit_launch(monkeypatch):
    """A plan is made for 16-byte aligned pointers (what Triton specializes on): a tensor at an odd
    offset must not reuse it."""
    monkeypatch.setenv("FLASHJVP_CUDNN", "0")
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 64, 64, 64, 64, "bhnd", torch.float16, kinds=("contiguous",))
    flashjvp.attention_jvp(q, k, v, tq, tk, tv)
    flat = torch.randn(q.numel() + 1, device="cuda").half()
    q_odd = flat[1:].view_as(q)  # 2-byte aligned
    assert q_odd.data_ptr() % 16
    with LaunchLog():
        out = flashjvp.attention_jvp(q_odd, k, v, tq, tk, tv, return_lse=True)
    truth, lowp = jvp_refs(q_odd, k, v, tq, tk, tv)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, ref, ref_lp, torch.float16)


@gpu
@pytest.mark.parametrize("mode", ["0", "1"])
def test_cuda_graph_capture_and_replay(monkeypatch, mode):
    """Eager flashjvp calls captured into a CUDA graph (plain forward+backward through either path,
    forward+JVP through a launch plan) and replayed on new inputs copied into the static ones:
    the replayed outputs match the reference for the new inputs."""
    monkeypatch.setenv("FLASHJVP_CUDNN", mode)
    dtype = torch.bfloat16
    static = [x.detach() for x in make_qkv(2, 4, 4, 256, 256, 64, 64, "bnhd", dtype, kinds=("contiguous",))]
    leaves = [x.clone().requires_grad_() for x in static[:3]]
    do = torch.randn_like(static[0])

    def step():
        o = flashjvp.attention(*leaves, layout="bnhd")
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
        o2, to = flashjvp.attention_jvp(*static, layout="bnhd")
        return o, dq, dk, dv, o2, to

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, tune, make the plans
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        fresh = make_qkv(2, 4, 4, 256, 256, 64, 64, "bnhd", dtype, kinds=("contiguous",))
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            for dst, src in zip(leaves, fresh[:3]):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        o, dq, dk, dv, o2, to = outs
        (o64, o_lp), (g64, g_lp) = _refs(*fresh[:3], do, False, "bnhd")
        assert_close("o", o, o64, o_lp, dtype)
        for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g_lp):
            assert_close(name, g, ref, ref_lp, dtype)
        truth, lowp = jvp_refs(*fresh, layout="bnhd")
        assert_close("o (jvp)", o2, truth[0], lowp[0], dtype)
        assert_close("to", to, truth[1], lowp[1], dtype)


@gpu
def test_reduce_overhead_compiles_without_cudagraph_skips(monkeypatch):
    """torch.compile(mode="reduce-overhead") of a plain training step through flashjvp.sdpa: no
    graph break, no cudagraph skip, and replayed results that match the reference."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("FLASHJVP_CUDNN", "auto")
    torch._dynamo.reset()
    counters.clear()
    dtype = torch.bfloat16

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, v, do):
        o = flashjvp.sdpa(q, k, v)
        return o, (o * do).sum()

    for _ in range(4):
        q, k, v = (x.requires_grad_() for x in make_qkv(8, 16, 16, 256, 256, 72, 72, "bhnd", dtype,
                                                         kinds=("contiguous",), tangents=False))
        do = torch.randn_like(q)
        torch.compiler.cudagraph_mark_step_begin()
        o, loss = step(q, k, v, do)
        loss.backward()
        grads = [x.grad for x in (q, k, v)]
        (o64, o_lp), (g64, g_lp) = _refs(q, k, v, do, False, "bhnd")
        assert_close("o", o, o64, o_lp, dtype)
        for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), grads, g64, g_lp):
            assert_close(name, g, ref, ref_lp, dtype)
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


@gpu
def test_reduce_overhead_meanflow_step():
    """torch.compile(mode="reduce-overhead") of a MeanFlow step (``torch.func.jvp`` of attention,
    loss through the primal): one graph with the fused operator in it, no cudagraph skip, and
    replayed values and gradients that match the float64 reference."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dtype = torch.bfloat16

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q, k, v, tq, tk, tv):
        o, to = torch.func.jvp(flashjvp.attention, (q, k, v), (tq, tk, tv))
        return o, to, (o.float() * to.detach().float()).sum()

    for _ in range(4):
        xs = make_qkv(4, 8, 8, 256, 256, 72, 72, "bhnd", dtype, kinds=("contiguous",))
        leaves = [x.requires_grad_() for x in xs[:3]]
        torch.compiler.cudagraph_mark_step_begin()
        o, to, loss = step(*leaves, *xs[3:])
        loss.backward()
        truth, lowp = jvp_refs(*xs)
        assert_close("o", o, truth[0], lowp[0], dtype)
        assert_close("to", to, truth[1], lowp[1], dtype)
        g64, g_lp = grad_refs(*xs[:3], to.detach())
        for name, x, ref, ref_lp in zip(("dq", "dk", "dv"), leaves, g64, g_lp):
            assert_close(name, x.grad, ref, ref_lp, dtype)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


# --------------------------------------------------------------------------- CPU


def test_no_plan_where_a_tangent_can_exist():
    """Under forward AD, a torch.func transform or Dynamo there is no plain plan; on the CPU the
    signature is remembered as served by the checked path."""
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    args = lambda: flashjvp._validate.check_inputs(q, k, v)  # noqa: E731
    with fwAD.dual_level():
        assert _plan.plain_plan(q, k, v, False, None, "bhnd", args) is None
    seen = []

    def probe(x):
        seen.append(_plan.plain_plan(q, k, v, False, None, "bhnd", args))
        return x

    torch.func.vmap(probe)(q)
    torch.func.jvp(probe, (q,), (q,))
    assert seen == [None, None]
    if not ON_GPU:
        assert _plan.plain_plan(q, k, v, False, None, "bhnd", args) is None
        assert len(_plain_plans()) == 1


def test_plain_plan_raises_the_checked_errors():
    """A signature the checks refuse raises their error on every call (no plan is made for it)."""
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    for _ in range(2):
        with pytest.raises(ValueError, match="causal"):
            flashjvp.attention(q, k, v, causal="diagonal")
        with pytest.raises(ValueError, match="layout"):
            flashjvp.attention(q, k, v, layout="nbhd")
    assert len(_plain_plans()) == 0


@pytest.mark.parametrize("tangents", ["q", "kv", "qkv"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_single_jvp_level_direct_path(tangents, layout):
    """attention inside one torch.func.jvp runs the fused kernel on the unwrapped tensors: one
    launch, o and its tangent, and gradients through both (the sCM pattern) against the float64
    reference, with tangents for some inputs only and GQA."""
    dtype = torch.float32
    q, k, v, tq, tk, tv = make_qkv(2, 4, 2, 19, 27, 16, 24, layout, dtype)
    given = {"q": tq, "k": tk, "v": tv}
    names = list(tangents)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def f(*xs):
        full = dict(zip("qkv", leaves)) | dict(zip(names, xs))
        return flashjvp.attention(full["q"], full["k"], full["v"], causal="bottom_right", layout=layout)

    with LaunchLog() as log:
        o, to = torch.func.jvp(f, tuple(leaves["qkv".index(n)] for n in names), tuple(given[n] for n in names))
    assert log.count("_attn_fwd_kernel") == 1
    tans = [given[n] if n in names else None for n in "qkv"]
    truth, lowp = jvp_refs(q, k, v, *tans, causal="bottom_right", layout=layout)
    assert_close("o", o, truth[0], lowp[0], dtype)
    assert_close("to", to, truth[1], lowp[1], dtype)
    w = torch.randn_like(o)
    loss = (o * w).sum() + (to ** 2).sum()
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rto = flashjvp.attention_jvp_ref(*ref_leaves, *f64(tans), causal="bottom_right", layout=layout)
    ref_grads = torch.autograd.grad((ro * w.double()).sum() + (rto ** 2).sum(), ref_leaves)
    lp_leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    lo, lto = flashjvp.attention_jvp_ref(*lp_leaves, *tans, causal="bottom_right", layout=layout)
    lp_grads = torch.autograd.grad((lo * w).sum() + (lto ** 2).sum(), lp_leaves)
    for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads):
        assert_close(name, g, ref, ref_lp, dtype)


@pytest.mark.parametrize("fn", ["sdpa", "attention", "attention_jvp"])
def test_checks_run_once_per_signature_inside_transforms(monkeypatch, fn):
    """Inside torch.func.jvp no plan serves a call, but its argument checks run once per signature
    (the MeanFlow step repeats a few shapes per layer); bad arguments still raise on every call."""
    import sys

    calls = []
    target, name = (sys.modules["flashjvp.sdpa"], "_plan_args") if fn == "sdpa" else \
        (sys.modules["flashjvp.interface"], "check_inputs")
    real = getattr(target, name)
    monkeypatch.setattr(target, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = (torch.randn(1, 2, 19, 16, device=DEVICE) for _ in range(3))
    call = flashjvp.sdpa if fn == "sdpa" else flashjvp.attention
    for _ in range(3):  # attention_jvp under vmap (its forward-mode derivative is not supported)
        if fn == "attention_jvp":
            out = torch.func.vmap(lambda q: flashjvp.attention_jvp(q, k, v, q)[1])(q[None])
        else:
            out, _ = torch.func.jvp(lambda q: call(q, k, v), (q,), (torch.randn_like(q),))
    assert len(calls) == 1, calls
    assert torch.isfinite(out).all()
    if fn != "sdpa":
        for _ in range(2):
            with pytest.raises(ValueError, match="causal"):
                torch.func.jvp(lambda q: flashjvp.attention(q, k, v, causal="diagonal"), (q,), (q,))
