"""autograd Functions wiring the Triton launchers into PyTorch's reverse and forward modes.

The fusion trick (``AttentionFunction``): under ``torch.func.jvp`` and ``forward_ad`` an
``autograd.Function`` runs ``forward`` (without the tangents) before ``jvp``. The public
``attention`` looks at its inputs first: when any carries a forward tangent (``unpack_dual``
sees it in both systems) it passes ``defer=True``; ``forward`` then only allocates ``o`` and
``lse``, and ``jvp``, which PyTorch calls right after ``forward`` inside the same ``apply``,
launches the fused kernel once, writing ``o`` and ``lse`` in place and returning ``to``.
Without tangents ``forward`` launches the plain kernel. If a tangent shows up that was not
seen up front, ``jvp`` recomputes everything (correct, one launch more).
"""

from __future__ import annotations

import inspect

import torch

from flashjvp._backends import run_bwd, run_fwd
from flashjvp._bwd_jvp import attn_bwd_jvp
from flashjvp._fwd import attn_fwd
from flashjvp._launch import out_buffer, stat_buffer
from flashjvp._route import Route
from flashjvp._validate import AttnArgs


class AttentionFunction(torch.autograd.Function):
    """``(o, lse) = attention(q, k, v)``; ``lse`` is non-differentiable and used by backward. Each
    direction runs on the backend ``route`` names (``_route.choose``)."""

    @staticmethod
    def forward(q, k, v, a: AttnArgs, defer: bool, route: Route):
        if defer:  # jvp() follows and fills both
            return out_buffer(a, q), stat_buffer(a, q.device)
        o, _, lse, _ = run_fwd(q, k, v, a, route.fwd)
        return o, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, a, defer, route = inputs
        o, lse = output
        ctx.a, ctx.defer, ctx.route = a, defer, route
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_forward(q, k, v, o, lse)
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(q, k, v, o, lse)

    @staticmethod
    def jvp(ctx, tq, tk, tv, *_):
        q, k, v, o, lse = ctx.saved_tensors
        # Launched through AttentionJVPFunction: it receives plain tensors under torch.func
        # (functorch unwraps custom Functions' inputs), and its backward differentiates ``to``.
        out = (o, lse) if ctx.defer else (None, None)
        _, to, _, _ = AttentionJVPFunction.apply(q, k, v, tq, tk, tv, ctx.a, True, ctx.route, *out)
        return (torch.zeros_like(o) if to is None else to), None

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:
            return None, None, None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = run_bwd(do, q, k, v, o, lse, ctx.a, ctx.route.bwd)
        return dq, dk, dv, None, None, None


class AttentionJVPFunction(torch.autograd.Function):
    """``(o, to, lse, mu) = attention_jvp(q, k, v, tq, tk, tv)`` in one launch; every output is
    differentiable with respect to q, k, v and the tangents (``_bwd_jvp.py``; ``mu`` is needed
    for that, so pass ``store_mu=True`` when a backward may follow). A backward through ``o``
    alone runs on the backend ``route.bwd`` names."""

    @staticmethod
    def forward(q, k, v, tq, tk, tv, a: AttnArgs, store_mu: bool, route: Route, o=None, lse=None):
        o_, to, lse_, mu = attn_fwd(q, k, v, tq, tk, tv, a, store_mu=store_mu, o=o, lse=lse)
        if o is not None:  # autograd wants views, not inputs returned as-is
            o_, lse_ = o_.view_as(o_), lse_.view_as(lse_)
        return o_, to, lse_, mu

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.a, ctx.route = inputs[6], inputs[8]
        ctx.set_materialize_grads(False)
        if any(ctx.needs_input_grad[:6]):
            ctx.save_for_backward(*inputs[:6], *output)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError("flashjvp: forward-mode AD through attention_jvp (second order) "
                                  "is not supported yet")

    @staticmethod
    def backward(ctx, do, dto, dlse, dmu):
        # o may be one of forward's buffers filled in place (AttentionFunction.jvp): its
        # gradient is AttentionFunction's to compute, so do is None there.
        q, k, v, tq, tk, tv, o, to, lse, mu = ctx.saved_tensors
        if dto is None and dlse is None and dmu is None:  # first order: the plain backward
            if do is None:
                return (None,) * 11
            return (*run_bwd(do, q, k, v, o, lse, ctx.a, ctx.route.bwd), *(None,) * 8)
        grads = attn_bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, ctx.a)
        return (*grads, *(None,) * 5)


# torch.autograd.Function.apply binds its arguments with inspect.signature(forward) on every call
# when setup_context is defined; building that signature cost more than the rest of a launch
# (tens of microseconds). A precomputed __signature__ is what inspect.signature returns first.
for _fn in (AttentionFunction, AttentionJVPFunction):
    _fn.forward.__signature__ = inspect.signature(_fn.forward)
