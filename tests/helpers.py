"""Input builders and the dtype-relative comparison used by every kernel test."""

from __future__ import annotations

import torch

import flashjvp
from flashjvp._launch import LaunchLog

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
# bf16 tl.dot is wrong in Triton's CPU interpreter: bf16 numerics are tested on the GPU only.
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Absolute floor of the tolerance, relative to the reference's magnitude. float32: a gradient that
# is zero by cancellation (dK of the one key a row sees: P (dP - delta) with P = 1) keeps the
# rounding of dP - delta, whose two sums run in another order on the GPU than in PyTorch, summed
# over every row that sees the key.
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 5e-5}
# The kernel's error may be this many times PyTorch's own error in the same dtype.
FACTOR = 3.0
MEMORY_KINDS = ("contiguous", "swapped", "sliced", "strided")


def shape_of(b, h, n, d, layout):
    return (b, h, n, d) if layout == "bhnd" else (b, n, h, d)


def make_tensor(shape, kind: str, dtype, device=DEVICE) -> torch.Tensor:
    """Random normal tensor of logical ``shape`` stored in the memory layout ``kind``:
    contiguous; ``swapped`` (dims 1 and 2 swapped in memory); ``sliced`` (a window of a larger
    tensor, offset start); ``strided`` (last dim has stride 2)."""
    b, a1, a2, d = shape
    randn = lambda *size: torch.randn(*size, device=device).to(dtype)
    if kind == "contiguous":
        return randn(*shape)
    if kind == "swapped":
        return randn(b, a2, a1, d).transpose(1, 2)
    if kind == "sliced":
        return randn(b, a1 + 2, a2 + 3, d + 5)[:, 1 : a1 + 1, 2 : a2 + 2, 3 : d + 3]
    if kind == "strided":
        return randn(b, a1, a2, 2 * d)[..., ::2]
    raise ValueError(f"unknown memory kind {kind!r}")


def make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype, kinds=None, tangents=True, device=DEVICE):
    """q, k, v (and tq, tk, tv) each in its own memory layout (``kinds``, cycled)."""
    kinds = kinds or MEMORY_KINDS
    shapes = [shape_of(b, hq, nq, dqk, layout), shape_of(b, hkv, nk, dqk, layout), shape_of(b, hkv, nk, dv, layout)]
    prim = [make_tensor(s, kinds[i % len(kinds)], dtype, device) for i, s in enumerate(shapes)]
    if not tangents:
        return prim
    tan = [make_tensor(s, kinds[(i + 2) % len(kinds)], dtype, device) for i, s in enumerate(shapes)]
    return prim + tan


def f64(xs):
    return [None if x is None else x.detach().double() for x in xs]


def assert_close(name, out, ref, ref_lowp, dtype, factor=FACTOR):
    """|out - ref| <= factor * |ref_lowp - ref|_max + FLOOR[dtype] * max(1, |ref|_max), elementwise,
    where ``ref`` is float64 and ``ref_lowp`` the same math done by PyTorch in ``dtype``.
    NaN fails (outputs start as NaN: an element the kernel never wrote is caught here)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out, ref, ref_lowp = out.detach().double(), ref.detach().double(), ref_lowp.detach().double()
    inf = torch.isinf(ref)
    if inf.any():
        assert torch.equal(torch.isinf(out), inf) and torch.equal(out[inf], ref[inf]), f"{name}: -inf pattern differs"
        out, ref, ref_lowp = out[~inf], ref[~inf], ref_lowp[~inf]
        if out.numel() == 0:
            return
    nan = torch.isnan(out)
    if nan.any():
        idx = tuple(int(i) for i in nan.nonzero()[0])
        raise AssertionError(f"{name}: {int(nan.sum())} NaN elements (unwritten or bad math), first at {idx}")
    err = (out - ref).abs()
    err_pt = (ref_lowp - ref).abs().max().item()
    tol = factor * err_pt + FLOOR[dtype] * max(1.0, ref.abs().max().item())
    worst = err.max().item()
    if worst > tol:
        flat = int(err.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        raise AssertionError(
            f"{name}: max error {worst:.3e} at index {idx} (got {out[idx].item():.6g}, expected "
            f"{ref[idx].item():.6g}) exceeds tolerance {tol:.3e} = {factor} x PyTorch's {dtype} error "
            f"{err_pt:.3e} + floor; {int((err > tol).sum())} of {err.numel()} elements out of tolerance")


def jvp_refs(q, k, v, tq, tk, tv, **kw):
    """(float64 truth, same math in the input dtype) of attention_jvp_ref with return_lse=True."""
    truth = flashjvp.attention_jvp_ref(*f64((q, k, v, tq, tk, tv)), return_lse=True, **kw)
    lowp = flashjvp.attention_jvp_ref(q, k, v, tq, tk, tv, return_lse=True, **kw)
    return truth, lowp


def check_jvp(q, k, v, tq, tk, tv, dtype, **kw):
    """One ``attention_jvp`` call (any tangent may be None) with ``return_lse=True``: o, to, lse
    and mu against the float64 reference (``jvp_refs``); returns the four outputs."""
    out = flashjvp.attention_jvp(q, k, v, tq, tk, tv, return_lse=True, **kw)
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, **kw)
    for name, got, ref, ref_lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, ref, ref_lp, dtype)
    return out


def grad_refs(q, k, v, do, **kw):
    """Gradients of <attention_ref(q, k, v), do> in float64 and in the input dtype."""
    out = []
    for xs in (f64((q, k, v, do)), [x.detach() for x in (q, k, v, do)]):
        leaves = [x.clone().requires_grad_() for x in xs[:3]]
        o = flashjvp.attention_ref(*leaves, **kw)
        out.append(torch.autograd.grad(o, leaves, xs[3]))
    return out


def check_second_order(xs, fn=None, ref=None, **kw):
    """Gradients of o.sum() + |to|^2 + lse.sum() + 3 mu.sum() with respect to the primals and
    tangents ``xs`` (q, k, v, tq, tk, tv) through ``fn`` in float32 (default
    ``flashjvp.attention_jvp``; any callable ``fn(q, k, v, tq, tk, tv, return_lse=True, **kw)``)
    against ``ref`` in float64 (default ``flashjvp.attention_jvp_ref``)."""
    fn = fn or flashjvp.attention_jvp
    ref = ref or flashjvp.attention_jvp_ref

    def grads(f, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in xs]
        o, to, lse, mu = f(*leaves, return_lse=True, **kw)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        (o.sum() + (to * to).sum() + lse.sum() + (mu * 3).sum()).backward()
        return [x.grad for x in leaves]

    got, truth, lowp = grads(fn, torch.float32), grads(ref, torch.float64), grads(ref, torch.float32)
    for name, g, t, lp in zip(("dq", "dk", "dv", "dtq", "dtk", "dtv"), got, truth, lowp):
        assert_close(name, g, t, lp, torch.float32)


class Launches(LaunchLog):
    """A :class:`flashjvp._launch.LaunchLog` that, on leaving the ``with`` block, also counts the
    forward kernel's launches (``fwd``) and the backward's (``bwd``: one dQ launch per backward)."""

    def __exit__(self, *exc):
        self.fwd = self.count("_attn_fwd_kernel")
        self.bwd = self.count("_attn_bwd_dq_kernel")
        return super().__exit__(*exc)


def forget_plans(monkeypatch) -> None:
    """Empty every launch-plan cache for the test (plans made before would bypass what a test
    patches: the Autotuner, a forced tile, the cuDNN policy)."""
    from flashjvp._launch import PLANS

    PLANS.clear()


def spy_autotuner(monkeypatch, arg: str) -> list:
    """Forget the configs launch_tuned has picked and the launch plans, and record ``arg`` of every
    call that reaches the forward kernel's Autotuner (launch_tuned's first call per key); returns
    the record."""
    from flashjvp import _fwd, _launch

    monkeypatch.setattr(_launch, "_TUNED", {})
    forget_plans(monkeypatch)
    kernel = _fwd._attn_fwd_kernel
    seen = []
    real_run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: (seen.append(kw[arg]), real_run(*a, **kw))[1])
    return seen


def force_fwd_tile(monkeypatch, *, tma: str, tile=None) -> list:
    """Run the forward kernel with one tile, ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``
    (default: a small 4-warp tile), under ``FLASHJVP_TMA=tma`` (``"0"``, ``"1"`` or ``"auto"``);
    returns the list the TMA flag of every launch that reaches the Autotuner is appended to."""
    import triton

    from flashjvp import _fwd
    from flashjvp._policy import interpreting

    monkeypatch.setenv("FLASHJVP_TMA", tma)
    bm, bn, warps, stages = tile or ((16, 16, 4, 2) if interpreting() else (64, 32, 4, 2))
    kernel = _fwd._attn_fwd_kernel
    monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn},
                                                          num_warps=warps, num_stages=stages)])
    monkeypatch.setattr(kernel, "cache", {})
    return spy_autotuner(monkeypatch, "TMA")


# ---- packed variable-length batches (attention_varlen) ----
PACKED_KINDS = ("contiguous", "swapped", "sliced")


def cu_seqlens(lens, device=DEVICE) -> torch.Tensor:
    """int32 (B + 1,) offsets of sequences of the given lengths, packed back to back."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def make_packed(total, h, d, kind: str, dtype, device=DEVICE) -> torch.Tensor:
    """Random normal (total, h, d) tensor stored in the memory layout ``kind`` (unit stride in d):
    contiguous; ``swapped`` (heads outermost in memory: strides (d, total * d, 1)); ``sliced`` (a
    window of a larger tensor, offset start, padded head and row strides)."""
    randn = lambda *size: torch.randn(*size, device=device).to(dtype)
    if kind == "contiguous":
        return randn(total, h, d)
    if kind == "swapped":
        return randn(h, total, d).transpose(0, 1)
    if kind == "sliced":
        return randn(total + 2, h + 3, d + 5)[1 : total + 1, 2 : h + 2, 3 : d + 3]
    raise ValueError(f"unknown packed memory kind {kind!r}")


def make_varlen(lens_q, lens_k, hq, hkv, dqk, dv, dtype, kinds=None, tangents=True, device=DEVICE):
    """A packed batch: ``(xs, cu_q, cu_k, max_q, max_k)`` with ``xs`` = [q, k, v] (+ [tq, tk, tv]),
    each in its own memory layout (``kinds``, cycled as in ``make_qkv``)."""
    kinds = kinds or PACKED_KINDS
    tq_, tk_ = sum(lens_q), sum(lens_k)
    shapes = [(tq_, hq, dqk), (tk_, hkv, dqk), (tk_, hkv, dv)]
    xs = [make_packed(*s, kinds[i % len(kinds)], dtype, device) for i, s in enumerate(shapes)]
    if tangents:
        xs += [make_packed(*s, kinds[(i + 2) % len(kinds)], dtype, device) for i, s in enumerate(shapes)]
    return xs, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), max(lens_q), max(lens_k)


def varlen_jvp_refs(q, k, v, cu_q, cu_k, max_q, max_k, tq, tk, tv, **kw):
    """(float64 truth, same math in the input dtype) of attention_varlen_jvp_ref with return_lse=True."""
    from flashjvp.ref import attention_varlen_jvp_ref

    lens = (cu_q, cu_k, max_q, max_k)
    truth = attention_varlen_jvp_ref(*f64((q, k, v)), *lens, *f64((tq, tk, tv)), return_lse=True, **kw)
    lowp = attention_varlen_jvp_ref(q, k, v, *lens, tq, tk, tv, return_lse=True, **kw)
    return truth, lowp


def varlen_grad_refs(q, k, v, cu_q, cu_k, max_q, max_k, do, **kw):
    """Gradients of <attention_varlen_ref(q, k, v, ...), do> in float64 and in the input dtype."""
    from flashjvp.ref import attention_varlen_ref

    out = []
    for xs in (f64((q, k, v, do)), [x.detach() for x in (q, k, v, do)]):
        leaves = [x.clone().requires_grad_() for x in xs[:3]]
        o = attention_varlen_ref(*leaves, cu_q, cu_k, max_q, max_k, **kw)
        out.append(torch.autograd.grad(o, leaves, xs[3]))
    return out
