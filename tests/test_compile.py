"""torch.compile: the custom operators' contracts (opcheck, fake shapes) and the five ways users
combine flashjvp with torch.compile, each checked against the float64 reference (tangents too:
a compiled path that dropped the custom jvp rule would give a wrong tangent, not an error).

On the CPU the kernels run in Triton's interpreter inside the operators and the graph around
them is compiled by AOTAutograd (``aot_eager``); on a GPU by Inductor."""

import dataclasses
import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashjvp
from flashjvp._launch import LaunchLog
from flashjvp._ops import attn_bwd_jvp_op, attn_bwd_op, attn_fwd_jvp_op, attn_fwd_op, options
from flashjvp._validate import check_inputs, check_varlen
from helpers import DEVICE, ON_GPU, assert_close, f64, grad_refs, jvp_refs, make_qkv

BACKEND = "inductor" if ON_GPU else "aot_eager"
DT = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float32]
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout, causal)
CASES = [
    pytest.param((2, 2, 2, 37, 37, 32, 32, "bhnd", True), id="self-causal"),
    pytest.param((1, 4, 2, 19, 45, 40, 24, "bnhd", False), id="gqa-cross-bnhd"),
]
if ON_GPU:
    CASES += [pytest.param((2, 8, 2, 999, 999, 128, 128, "bnhd", "bottom_right"), id="gqa-999-d128-bnhd"),
              pytest.param((1, 4, 4, 1024, 1024, 64, 64, "bhnd", False), id="1024-d64")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(case, dtype):
    b, hq, hkv, nq, nk, dqk, dv, layout, causal = case
    xs = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype)
    return xs, dict(causal=causal, layout=layout)


def _compile(fn, fullgraph=False, dynamic=None):
    return torch.compile(fn, backend=BACKEND, fullgraph=fullgraph, dynamic=dynamic)


def _check_jvp(o, to, xs, kw, dtype):
    truth, lowp = jvp_refs(*xs, **kw)
    assert_close("o", o, truth[0], lowp[0], dtype)
    assert_close("to", to, truth[1], lowp[1], dtype)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_compiled_forward_fullgraph(case, dtype):
    xs, kw = _inputs(case, dtype)
    f = _compile(lambda q, k, v: flashjvp.attention(q, k, v, **kw), fullgraph=True)
    with LaunchLog() as log:
        o = f(*xs[:3])
    assert log.count("_attn_fwd_kernel") == 1
    truth, lowp = jvp_refs(*xs, **kw)
    assert_close("o", o, truth[0], lowp[0], dtype)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_compiled_training_step_fullgraph(case, dtype):
    xs, kw = _inputs(case, dtype)
    leaves = [x.detach().clone().requires_grad_() for x in xs[:3]]
    do = torch.randn_like(flashjvp.attention_ref(*xs[:3], **kw))
    f = _compile(lambda q, k, v: (flashjvp.attention(q, k, v, **kw) * do).sum(), fullgraph=True)
    with LaunchLog() as log:
        f(*leaves).backward()
    assert log.count("_attn_fwd_kernel") == 1 and log.count("_attn_bwd_dq_kernel") == 1
    truth, lowp = grad_refs(*xs[:3], do, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


def test_compiled_dynamic_shapes():
    """A training step compiled with ``dynamic=True`` (symbolic sequence lengths in the operators'
    fake implementations, which then cannot take their cached arguments) serves several lengths
    with one graph, each gradient matching float64."""
    counters.clear()
    step = _compile(lambda q, k, v, do: (flashjvp.attention(q, k, v, causal=True) * do).sum(), fullgraph=True,
                    dynamic=True)
    for n in (17, 40, 23):
        xs = make_qkv(1, 2, 2, n, n, 16, 16, "bhnd", torch.float32, tangents=False)
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        do = torch.randn(1, 2, n, 16, device=DEVICE)
        step(*leaves, do).backward()
        truth, lowp = grad_refs(*xs, do, causal=True)
        for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
            assert_close(f"{name} N{n}", x.grad, t, lp, torch.float32)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_jvp_of_compiled_function(case, dtype):
    """``torch.func.jvp(torch.compile(f))``: the fused kernel runs once, the tangent is right."""
    xs, kw = _inputs(case, dtype)
    f = _compile(lambda q, k, v: flashjvp.attention(q, k, v, **kw))
    with LaunchLog() as log:
        o, to = torch.func.jvp(f, tuple(xs[:3]), tuple(xs[3:]))
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) == 1
    _check_jvp(o, to, xs, kw, dtype)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_compiled_function_calling_jvp(case, dtype):
    """``torch.compile(lambda: torch.func.jvp(f, ...), fullgraph=True)``: the fused fwd_jvp operator
    runs inside the graph (attention writes its forward-mode rule out with unpack_dual/make_dual)."""
    xs, kw = _inputs(case, dtype)

    def f(q, k, v):
        return flashjvp.attention(q, k, v, **kw)

    g = _compile(lambda *a: torch.func.jvp(f, a[:3], a[3:]), fullgraph=True)
    with LaunchLog() as log:
        o, to = g(*xs)
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) == 1
    _check_jvp(o, to, xs, kw, dtype)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_compiled_attention_jvp(case, dtype):
    """Explicit tangents without autograd: the fwd_jvp operator in the graph, fullgraph."""
    xs, kw = _inputs(case, dtype)
    g = _compile(lambda *a: flashjvp.attention_jvp(*a, return_lse=True, **kw), fullgraph=True)
    with LaunchLog() as log:
        o, to, lse, mu = g(*xs)
    assert log.count("_attn_fwd_kernel") == 1
    truth, lowp = jvp_refs(*xs, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert_close(name, got, t, lp, dtype)


@pytest.mark.parametrize("dtype", DT, ids=lambda d: DT_IDS[d])
def test_compiled_attention_jvp_second_order_fullgraph(dtype):
    """Gradients through ``o`` and ``to`` of a compiled ``attention_jvp`` (the fwd_jvp and
    bwd_jvp operators), against float64 double differentiation of the math reference."""
    case = CASES[1].values[0]
    xs, kw = _inputs(case, dtype)
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    w = [torch.randn_like(flashjvp.attention_ref(*xs[:3], **kw)) for _ in range(2)]

    def loss(attention_jvp, *a):
        o, to = attention_jvp(*a, **kw)
        return (o * w[0].to(o.dtype)).sum() + (to * w[1].to(o.dtype)).sum()

    _compile(lambda *a: loss(flashjvp.attention_jvp, *a), fullgraph=True)(*leaves).backward()
    truth, lowp = [], []
    for prec, grads in ((torch.float64, truth), (dtype, lowp)):
        ref = [x.detach().to(prec).requires_grad_() for x in xs]
        loss(flashjvp.attention_jvp_ref, *ref).backward()
        grads.extend(x.grad for x in ref)
    for name, x, t, lp in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


def test_forward_ad_inside_and_around_compile():
    """Dual tensors (``torch.autograd.forward_ad``) made outside or inside the compiled function."""
    xs, kw = _inputs((1, 2, 1, 23, 30, 16, 16, "bnhd", "bottom_right"), torch.float32)

    def inner(*a):
        with fwAD.dual_level():
            o = flashjvp.attention(*[fwAD.make_dual(x, t) for x, t in zip(a[:3], a[3:])], **kw)
            return fwAD.unpack_dual(o)

    o, to = _compile(inner)(*xs)
    _check_jvp(o, to, xs, kw, torch.float32)
    f = _compile(lambda q, k, v: flashjvp.attention(q, k, v, **kw))
    with fwAD.dual_level():
        o, to = fwAD.unpack_dual(f(*[fwAD.make_dual(x, t) for x, t in zip(xs[:3], xs[3:])]))
    _check_jvp(o, to, xs, kw, torch.float32)


def test_meanflow_step_compiled():
    """``torch.func.jvp`` inside a compiled training step (one graph), then backward through the
    primal: the plain backward kernels, as in eager mode (the tangent gets no cotangent)."""
    xs, kw = _inputs((2, 2, 2, 17, 17, 16, 16, "bhnd", False), torch.float32)
    leaves = [x.detach().clone().requires_grad_() for x in xs[:3]]

    def step(q, k, v, tq, tk, tv):
        o, to = torch.func.jvp(lambda *a: flashjvp.attention(*a, **kw), (q, k, v), (tq, tk, tv))
        return (o * to.detach()).sum()

    with LaunchLog() as log:
        _compile(step, fullgraph=True)(*leaves, *xs[3:]).backward()
    kernels = [r.kernel for r in log.launches]  # float32: never cuDNN's
    assert kernels.count("_attn_bwd_dq_kernel") == kernels.count("_attn_bwd_dkdv_kernel") == 1, kernels
    assert "_attn_bwd_jvp_dq_kernel" not in kernels and "_attn_bwd_jvp_dkdv_kernel" not in kernels, kernels
    ref = [x.clone().requires_grad_() for x in f64(xs[:3])]
    o, to = torch.func.jvp(lambda *a: flashjvp.attention_ref(*a, **kw), tuple(ref), tuple(f64(xs[3:])))
    (o * to.detach()).sum().backward()
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref):
        torch.testing.assert_close(x.grad.double(), r.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("tangents", ["qkv", "q"])
def test_scm_step_compiled_fullgraph(tangents):
    """sCM: ``torch.func.jvp`` of a small network around attention in one compiled graph, the loss
    through the tangent too (the bwd_jvp operator), against float64 double differentiation;
    with ``"q"`` keys and values carry no tangent (cross-attention to a fixed context)."""
    xs, kw = _inputs((1, 2, 2, 21, 21, 16, 16, "bnhd", True), torch.float32)
    w = torch.randn(16, 16, device=DEVICE) / 4

    def step(attention, q, k, v, tq, tk, tv, w):
        # w enters the jvp with an explicit zero tangent: closed over, AOTAutograd gives it a
        # ZeroTensor tangent, which Inductor's backward then writes into (pytorch/pytorch#177261).
        def net(q, k, v, w):
            return attention(q @ w, k, v, **kw) @ w
        tw = torch.zeros_like(w)
        if tangents == "q":
            o, to = torch.func.jvp(lambda q, w: net(q, k, v, w), (q, w), (tq, tw))
        else:
            o, to = torch.func.jvp(net, (q, k, v, w), (tq, tk, tv, tw))
        return o.square().sum() + (to * 0.5).square().sum()

    leaves = [x.detach().clone().requires_grad_() for x in (*xs[:3], w)]
    with LaunchLog() as log:
        _compile(lambda *a: step(flashjvp.attention, *a[:3], *xs[3:], a[3]), fullgraph=True)(*leaves).backward()
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) == 1
    ref = [x.detach().double().requires_grad_() for x in (*xs[:3], w)]
    step(flashjvp.attention_ref, *ref[:3], *f64(xs[3:]), ref[3]).backward()
    for name, x, r in zip(("dq", "dk", "dv", "dw"), leaves, ref):
        torch.testing.assert_close(x.grad.double(), r.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_compiled_nested_transforms():
    """Transforms the fused operator cannot serve, traced by Dynamo: a jvp of a jvp (second order
    forward) and ``jacfwd`` (vmap of jvp) take the math reference, and their values are right."""
    q, k, v, tq, _, _ = make_qkv(1, 2, 2, 7, 9, 8, 8, "bhnd", torch.float32)
    tq2 = torch.randn_like(tq)

    def inner(attention, q, k, v, tq):
        return torch.func.jvp(lambda q: attention(q, k, v), (q,), (tq,))[1]

    got = _compile(lambda q: torch.func.jvp(lambda q: inner(flashjvp.attention, q, k, v, tq), (q,), (tq2,)))(q)
    ref = torch.func.jvp(lambda q: inner(flashjvp.attention_ref, q, *f64((k, v, tq))), (q.double(),), (tq2.double(),))
    for name, g, r in zip(("to", "second"), got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=name)
    q3 = q[:, :, :3]
    jac = _compile(lambda q: torch.func.jacfwd(lambda q: flashjvp.attention(q, k, v))(q))(q3)
    jac_ref = torch.func.jacfwd(lambda q: flashjvp.attention_ref(q, *f64((k, v))))(q3.double())
    torch.testing.assert_close(jac.double(), jac_ref, rtol=1e-4, atol=1e-5)


def test_patch_sdpa_compiled_jvp_fullgraph():
    """A module calling ``F.scaled_dot_product_attention`` (qkv projection, attention, output
    projection: DiT's attention sublayer), under ``patch_sdpa()``: ``torch.func.jvp`` of it
    compiles into one graph that runs the fused kernel; value and tangent match float64."""
    qkv, proj = torch.nn.Linear(32, 96, device=DEVICE), torch.nn.Linear(32, 32, device=DEVICE)

    def block(x):
        q, k, v = qkv(x).view(2, 19, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 19, 32))

    x, t = torch.randn(2, 19, 32, device=DEVICE), torch.randn(2, 19, 32, device=DEVICE)
    with flashjvp.patch_sdpa(), LaunchLog() as log:
        out, tan = _compile(lambda x, t: torch.func.jvp(block, (x,), (t,)), fullgraph=True)(x, t)
    assert log.count("_attn_fwd_kernel", HAS_TQ=True) == 1
    qkv.double(), proj.double()
    with sdpa_kernel(SDPBackend.MATH):  # PyTorch's only backend with forward-mode AD
        ref = torch.func.jvp(block, (x.double(),), (t.double(),))
    torch.testing.assert_close(out.double(), ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tan.double(), ref[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cudnn", ["0", "auto"], ids=["triton", "dispatch"])
def test_patch_sdpa_compiled_block_training_step(cudnn, monkeypatch):
    """DiT's attention sublayer compiled whole (forward, loss, backward) under ``patch_sdpa()``:
    q, k and v are strided views of one packed projection, so the gradients the backward operator
    returns must have the strides its fake implementation promised, whichever kernel (Triton or,
    with ``auto`` on the GPU, cuDNN) serves the call. Gradients match float64 math SDPA."""
    monkeypatch.setenv("FLASHJVP_CUDNN", cudnn)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    torch.manual_seed(0)
    qkv, proj = (torch.nn.Linear(72, 3 * 72, device=DEVICE), torch.nn.Linear(72, 72, device=DEVICE))

    def loss(x, target):
        q, k, v = qkv(x).view(2, 40, 3, 2, 36).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 40, 72)
        return (proj(o).float() - target).square().mean()

    x, target = torch.randn(2, 40, 72, device=DEVICE), torch.randn(2, 40, 72, device=DEVICE)
    params = [*qkv.parameters(), *proj.parameters()]
    for m in (qkv, proj):
        m.to(dtype)
    with flashjvp.patch_sdpa():
        _compile(loss, fullgraph=True)(x.to(dtype), target).backward()
    got = [p.grad.double() for p in params]
    for p in params:
        p.grad = None
    for m in (qkv, proj):
        m.double()
    with sdpa_kernel(SDPBackend.MATH):
        loss(x.double(), target.double()).backward()
    for name, g, p in zip(("qkv.weight", "qkv.bias", "proj.weight", "proj.bias"), got, params):
        torch.testing.assert_close(g, p.grad, rtol=0.05 if ON_GPU else 1e-4,
                                   atol=0.02 * p.grad.abs().max().item() if ON_GPU else 1e-6, msg=name)


def test_sdpa_compiled_fullgraph():
    q, k, v = make_qkv(2, 4, 4, 33, 33, 16, 16, "bhnd", torch.float32, tangents=False)
    f = _compile(lambda q, k, v: flashjvp.sdpa(q, k, v, is_causal=True), fullgraph=True)
    expected = torch.nn.functional.scaled_dot_product_attention(*f64((q, k, v)), is_causal=True)
    torch.testing.assert_close(f(q, k, v).double(), expected, rtol=1e-4, atol=1e-5)
    # views of one packed projection: out comes in the query's (B, N, H, D) order, as SDPA's
    q, k, v = torch.randn(2, 33, 3, 4, 16, device=DEVICE).permute(2, 0, 3, 1, 4)
    out = f(q, k, v)
    assert out.transpose(1, 2).is_contiguous(), out.stride()
    expected = torch.nn.functional.scaled_dot_product_attention(*f64((q, k, v)), is_causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_patch_sdpa_compiled_module():
    """A module calling ``F.scaled_dot_product_attention``, compiled inside ``patch_sdpa()``:
    flashjvp's kernel runs, forward and backward match eager."""
    attn = torch.nn.MultiheadAttention(32, 4, batch_first=True, device=DEVICE)
    x = torch.randn(2, 19, 32, device=DEVICE)
    eager = attn(x, x, x, need_weights=False)[0]
    with flashjvp.patch_sdpa(), LaunchLog() as log:
        out = _compile(lambda x: attn(x, x, x, need_weights=False)[0])(x)
    assert log.count("_attn_fwd_kernel") >= 1
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_opcheck(layout):
    """The operators' schemas, fake implementations, autograd registration and strides agree
    with their real implementations (``torch.library.opcheck``)."""
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 9, 13, 16, 16, layout, torch.float32)
    check = functools.partial(check_inputs, q, k, v, scale=0.25, layout=layout, allow_float64=False)
    opts = options(check(causal="top_left"))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attn_fwd_op, (*leaves, *opts))
    torch.library.opcheck(attn_fwd_jvp_op, (q, k, v, tq, None, tv, *opts))
    torch.library.opcheck(attn_fwd_jvp_op, (q, k, v, None, None, None, *opts))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq.requires_grad_(), None, tv, *opts))
    o, lse = attn_fwd_op(q, k, v, *opts)
    torch.library.opcheck(attn_bwd_op, (torch.randn_like(o), q, k, v, o, lse, *opts))
    o, to, lse, mu = attn_fwd_jvp_op(q, k, v, tq.detach(), None, tv, *opts)
    cot = [torch.randn_like(x) for x in (o, o, lse, lse)]
    torch.library.opcheck(attn_bwd_jvp_op, (q, k, v, tq.detach(), None, tv, o, to, lse, mu, *cot, *opts))
    padded = options(check(causal="top_left", kv_lens=torch.tensor([7], device=DEVICE), window=(3, 2)))  # 7 of 13 keys
    torch.library.opcheck(attn_fwd_op, (*leaves, *padded))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq, None, tv, *padded))
    masked = options(check(causal="top_left", attn_mask=torch.rand(1, 1, 9, 13, device=DEVICE) > 0.3))
    torch.library.opcheck(attn_fwd_op, (*leaves, *masked))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq, None, tv, *masked))
    # outputs in q's order of dimensions (sdpa's convention) for a q stored with dims 1 and 2 swapped
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 9, 13, 16, 16, layout, torch.float32, kinds=("swapped", "sliced"))
    like_q = options(dataclasses.replace(check_inputs(q, k, v, layout=layout, allow_float64=False), out_like_q=True))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attn_fwd_op, (*leaves, *like_q))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq, None, tv, *like_q))
    o, to, *_ = attn_fwd_jvp_op(q, k, v, tq, None, tv, *like_q)
    assert o.stride() == to.stride() == torch.empty_like(q).stride() != q.new_empty(q.shape).stride()


def test_opcheck_varlen():
    """The operators on a packed batch: (1, total, H, D) views and the sequences' offsets."""
    q, k, v, tq, tk, tv = (x[:1] for x in make_qkv(1, 2, 1, 12, 15, 16, 16, "bnhd", torch.float32))
    cu_q = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 9, 15], dtype=torch.int32, device=DEVICE)
    opts = options(check_varlen(q[0], k[0], v[0], None, None, None, cu_q, cu_k, 7, 6, causal=True, scale=0.25,
                                allow_float64=False))
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attn_fwd_op, (*leaves, *opts))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq.requires_grad_(), tk, None, *opts))


def test_fake_shapes_without_running():
    """Under FakeTensorMode the operators give their outputs' shapes, dtypes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 7, 4, 40, dtype=torch.bfloat16, device=DEVICE)  # bnhd
        k = torch.empty(2, 9, 2, 40, dtype=torch.bfloat16, device=DEVICE)
        v = torch.empty(2, 9, 2, 24, dtype=torch.bfloat16, device=DEVICE)
        opts = options(check_inputs(q, k, v, scale=0.5, layout="bnhd", allow_float64=False))
        o, to, lse, mu = attn_fwd_jvp_op(q, k, v, q, None, None, *opts)
        dq, dk, dv = attn_bwd_op(o, q, k, v, o, lse, *opts)
    assert o.shape == to.shape == (2, 7, 4, 24) and o.is_contiguous() and o.dtype == torch.bfloat16
    assert lse.shape == mu.shape == (2, 4, 7) and lse.dtype == mu.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_compiled_masks_windows_and_packed_batches():
    """A window, an attention mask and a packed batch through ``torch.compile(fullgraph=True)``:
    the options travel through the operators to the kernels, forward and backward."""
    q, k, v, *_ = make_qkv(2, 2, 1, 19, 23, 16, 16, "bnhd", torch.float32)
    mask = torch.rand(2, 1, 19, 23, device=DEVICE) > 0.3
    kw = dict(layout="bnhd", window=(4, 2), attn_mask=mask, causal="bottom_right")
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    do = torch.randn_like(q)
    f = _compile(lambda q, k, v: (flashjvp.attention(q, k, v, **kw) * do).sum(), fullgraph=True)
    with LaunchLog() as log:
        f(*leaves).backward()
    assert log.count("_attn_fwd_kernel", HAS_MASK=True, LEFT=True) == 1
    truth, lowp = grad_refs(q, k, v, do, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, torch.float32)
    # packed: two sequences of the batch's rows, one call
    cu_q = torch.tensor([0, 7, 19], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 15, 23], dtype=torch.int32, device=DEVICE)
    packed = [x[0] for x in (q, k, v)]
    # a window without causal masking: its bottom-right alignment (the packed API's) travels too
    pw = dict(window=(3, 1))
    g = _compile(lambda q, k, v: flashjvp.attention_varlen(q, k, v, cu_q, cu_k, 12, 15, **pw), fullgraph=True)
    with LaunchLog() as log:
        o = g(*packed)
    assert log.count("_attn_fwd_kernel", VARLEN=True) == 1
    ref = flashjvp.attention_varlen_ref(*[x.double() for x in packed], cu_q, cu_k, 12, 15, **pw)
    lowp = flashjvp.attention_varlen_ref(*packed, cu_q, cu_k, 12, 15, **pw)
    assert_close("o (packed)", o, ref, lowp, torch.float32)
