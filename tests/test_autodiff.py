"""flashjvp.attention inside PyTorch's AD systems: torch.func.jvp, forward_ad, jacfwd/vmap,
and the training patterns of sCM/rCM and MeanFlow, on small models with parameters."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn

import flashjvp
from helpers import DEVICE, Launches, assert_close, jvp_refs, make_qkv


class Block(nn.Module):
    """Pre-norm transformer block; attention on ``unbind`` views of a (B, N, 3, H, D) projection."""

    def __init__(self, attn, dim=32, heads=2, causal=False):
        super().__init__()
        self.attn, self.heads, self.causal = attn, heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, c // self.heads).unbind(2)
        o = self.attn(q, k, v, causal=self.causal, layout="bnhd").reshape(b, n, c)
        x = x + self.proj(o)
        return x + self.mlp(self.norm2(x))


def _twin_models(causal=False):
    torch.manual_seed(1)
    fast = Block(flashjvp.attention, causal=causal).to(DEVICE)
    ref = Block(flashjvp.attention_ref, causal=causal).to(DEVICE)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _count_launches(fn):
    with Launches() as n:
        out = fn()
    return out, n.fwd


def test_func_jvp_is_one_fused_launch():
    q, k, v, tq, tk, tv = make_qkv(2, 2, 1, 19, 23, 16, 24, "bnhd", torch.float32)
    f = lambda q, k, v: flashjvp.attention(q, k, v, causal="bottom_right", layout="bnhd")
    (o, to), n = _count_launches(lambda: torch.func.jvp(f, (q, k, v), (tq, tk, tv)))
    assert n == 1
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal="bottom_right", layout="bnhd")
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


@pytest.mark.parametrize("with_tangent", ["q", "k", "v", "kv"])
def test_forward_ad_dual_tensors_partial_tangents(with_tangent):
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 17, 17, 16, 16, "bhnd", torch.float32)
    given = {"q": tq, "k": tk, "v": tv}
    kw = {f"t{n}": (given[n] if n in with_tangent else None) for n in "qkv"}
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, given[n]) if n in with_tangent else x for n, x in zip("qkv", (q, k, v))]
        out, n = _count_launches(lambda: flashjvp.attention(*duals, causal=True))
        o, to = fwAD.unpack_dual(out)
    assert n == 1
    truth, lowp = jvp_refs(q, k, v, **kw, causal=True)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)


def test_jacfwd_small():
    q, k, v = make_qkv(1, 1, 1, 4, 5, 3, 2, "bhnd", torch.float32, tangents=False)
    jac = torch.func.jacfwd(lambda q: flashjvp.attention(q, k, v, causal=True))(q)
    ref = torch.func.jacfwd(lambda q: flashjvp.attention_ref(q.double(), k.double(), v.double(), causal=True))(
        q.double())
    torch.testing.assert_close(jac.double(), ref, rtol=1e-4, atol=1e-5)


def test_nested_jvp_second_derivative():
    """A JVP of a JVP (a second directional derivative) runs the math path: the fused kernel gives
    only first-order tangents."""
    q, k, v, t1, _, _ = make_qkv(1, 2, 1, 6, 7, 8, 8, "bhnd", torch.float32)
    t2 = torch.randn_like(t1)

    def second(fn, q, k, v, t1, t2):
        inner = lambda q_: torch.func.jvp(lambda x: fn(x, k, v, causal=True), (q_,), (t1,))[1]  # noqa: E731
        return torch.func.jvp(inner, (q,), (t2,))[1]

    (got, n) = _count_launches(lambda: second(flashjvp.attention, q, k, v, t1, t2))
    assert n == 0
    want = second(flashjvp.attention_ref, *(x.double() for x in (q, k, v, t1, t2)))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_vmap_matches_per_example_kernel_calls():
    """Under vmap flashjvp runs its math path (no launch); each example's slice must match the
    kernel run on that slice alone (one launch per example) and the float64 reference."""
    q, k, v = make_qkv(3, 2, 1, 6, 7, 8, 4, "bhnd", torch.float32, tangents=False)  # batch: vmapped
    f = lambda q, v: flashjvp.attention(q, k[:1], v, causal="bottom_right")  # noqa: E731
    with Launches() as n:
        batched = torch.func.vmap(f)(q[:, None], v[:, None])
    assert n.fwd == 0
    with Launches() as n:
        looped = torch.stack([f(q[i : i + 1], v[i : i + 1]) for i in range(3)])
    assert n.fwd == 3
    truth = torch.stack([flashjvp.attention_ref(q[i : i + 1].double(), k[:1].double(), v[i : i + 1].double(),
                                                causal="bottom_right") for i in range(3)])
    assert batched.shape == looped.shape == truth.shape
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.double(), truth, rtol=1e-5, atol=1e-5)


def test_transformer_block_under_func_jvp_matches_math():
    fast, ref = _twin_models(causal=True)
    x, tx = torch.randn(2, 13, 32, device=DEVICE), torch.randn(2, 13, 32, device=DEVICE)
    (out, tout), n = _count_launches(lambda: torch.func.jvp(fast, (x,), (tx,)))
    assert n == 1
    ref64 = ref.double()
    out_ref, tout_ref = torch.func.jvp(ref64, (x.double(),), (tx.double(),))
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tout.double(), tout_ref, rtol=1e-4, atol=1e-4)


def _param_grads(model):
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _assert_grads_match(fast, ref):
    for (name, _), a, b in zip(fast.named_parameters(), _param_grads(fast), _param_grads(ref)):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_scm_pattern_nograd_jvp_then_forward_backward():
    """sCM/rCM: tangents from attention_jvp under no_grad, then a separate forward + backward."""
    fast, ref = _twin_models()
    x, tx = torch.randn(2, 11, 32, device=DEVICE), torch.randn(2, 11, 32, device=DEVICE)
    with torch.no_grad():
        _, tout = torch.func.jvp(fast, (x,), (tx,))
        _, tout_ref = torch.func.jvp(ref, (x,), (tx,))
    torch.testing.assert_close(tout, tout_ref, rtol=1e-4, atol=1e-4)
    for model, t in ((fast, tout), (ref, tout_ref)):
        ((model(x) - t) ** 2).mean().backward()
    _assert_grads_match(fast, ref)


def test_meanflow_pattern_one_pass_jvp_and_backward():
    fast, ref = _twin_models(causal="bottom_right")
    x, tx = torch.randn(2, 11, 32, device=DEVICE), torch.randn(2, 11, 32, device=DEVICE)
    for model in (fast, ref):
        out, tout = torch.func.jvp(model, (x,), (tx,))
        ((out - (x - 0.5 * tout).detach()) ** 2).mean().backward()
    _assert_grads_match(fast, ref)


def test_meanflow_pattern_without_detach_is_second_order():
    """The loss differentiated through the tangent too (no detach): flashjvp's second-order
    backward gives the math model's parameter gradients."""
    fast, ref = _twin_models()
    x, tx = torch.randn(1, 5, 32, device=DEVICE), torch.randn(1, 5, 32, device=DEVICE)
    for model in (fast, ref):
        with Launches() as n:
            out, tout = torch.func.jvp(model, (x,), (tx,))
            ((out - tout) ** 2).mean().backward()
        if model is fast:
            assert n.fwd == 1 and n.count("_attn_bwd_jvp_dq_kernel") == 1
    _assert_grads_match(fast, ref)


def test_forward_ad_duals_then_backward_on_primal():
    fast, ref = _twin_models()
    x, tx = torch.randn(2, 9, 32, device=DEVICE), torch.randn(2, 9, 32, device=DEVICE)
    for model in (fast, ref):
        with fwAD.dual_level():
            primal, tangent = fwAD.unpack_dual(model(fwAD.make_dual(x, tx)))
        (primal.square().mean() + (primal * tangent.detach()).mean()).backward()
    _assert_grads_match(fast, ref)


def test_cpu_fallback_without_interpreter(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors go to the blocked math reference (no launch)."""
    import flashjvp.interface as iface

    monkeypatch.setattr(iface, "interpreting", lambda: False)
    monkeypatch.setattr(iface, "_CPU_BLOCK_Q", 4)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, 11, 7, 8, 8, "bnhd", torch.float32, device="cpu")
    (o, to, lse, mu), n = _count_launches(
        lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal="bottom_right", layout="bnhd",
                                       return_lse=True))
    assert n == 0
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, causal="bottom_right", layout="bnhd")
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert_close(name, got, ref, ref_lp, torch.float32)
    out = flashjvp.attention(q, k, v, layout="bnhd")
    assert_close("o", out, flashjvp.attention_ref(*(x.double() for x in (q, k, v)), layout="bnhd"),
                 flashjvp.attention_ref(q, k, v, layout="bnhd"), torch.float32)


_CPU_OPTIONS = {
    "kv-lens": dict(kv_lens=torch.tensor([3, 5])),
    "window": dict(window=(1, 1), causal="bottom_right"),
    "bool-mask": dict(attn_mask=torch.rand(2, 1, 11, 7, generator=torch.Generator().manual_seed(3)) > 0.4),
    "float-mask": dict(attn_mask=torch.randn(7, generator=torch.Generator().manual_seed(4))),
}


@pytest.mark.parametrize("option", list(_CPU_OPTIONS))
def test_cpu_fallback_passes_every_option(monkeypatch, option):
    """The CPU fallback without TRITON_INTERPRET hands key padding, windows and masks on to the
    reference it runs (a dropped option would give a plain attention result, no error)."""
    import flashjvp.interface as iface

    monkeypatch.setattr(iface, "interpreting", lambda: False)
    monkeypatch.setattr(iface, "_CPU_BLOCK_Q", 4)
    kw = _CPU_OPTIONS[option]
    q, k, v, tq, tk, tv = make_qkv(2, 2, 1, 11, 7, 8, 8, "bhnd", torch.float32, device="cpu")
    (o, to, lse, mu), n = _count_launches(lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv, return_lse=True, **kw))
    assert n == 0
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, **kw)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), (o, to, lse, mu), truth, lowp):
        assert_close(name, got, ref, ref_lp, torch.float32)
    assert_close("o (forward only)", flashjvp.attention(q, k, v, **kw), truth[0], lowp[0], torch.float32)


def test_cpu_fallback_varlen(monkeypatch):
    """The CPU fallback of the packed functions, with a longest query (5) shorter than the longest key (9)."""
    import flashjvp.interface as iface
    from flashjvp.ref import attention_varlen_jvp_ref

    monkeypatch.setattr(iface, "interpreting", lambda: False)
    q, tq = torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    k, v, tk, tv = (torch.randn(12, 2, 8) for _ in range(4))
    cu_q, cu_k = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 9, 12], dtype=torch.int32)
    got, n = _count_launches(lambda: flashjvp.attention_varlen_jvp(q, k, v, cu_q, cu_k, 5, 9, tq, tk, tv,
                                                                   causal=True, return_lse=True))
    assert n == 0
    want = attention_varlen_jvp_ref(q, k, v, cu_q, cu_k, 5, 9, tq, tk, tv, causal=True, return_lse=True)
    for name, a, b in zip(("o", "to", "lse", "mu"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
