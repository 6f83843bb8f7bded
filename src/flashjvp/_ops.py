"""The torch.compile boundary: flashjvp's launches as PyTorch custom operators.

``torch.compile`` cannot trace into a Triton launcher written in Python (Dynamo refuses the
Autotuner and the launch), so under compilation the public functions call these operators,
which Dynamo and AOTAutograd treat as opaque nodes: the fake (meta) implementations give the
shapes, dtypes and strides of every output without running anything, the real ones call the same
launchers as eager mode.

Why custom operators with ``register_autograd`` for the compiled path, and the eager
``autograd.Function``s (``_autograd.py``) everywhere else:

* Forward-mode AD: a custom operator has no forward-mode rule (PyTorch offers none to register),
  and under ``torch.func.jvp`` such an operator silently yields a zero tangent. Only an
  ``autograd.Function`` with a ``jvp`` gives the fused forward+JVP launch. But Dynamo refuses a
  Function that defines ``jvp`` when inputs require grad ("Unsupported custom jvp"), and traced
  under ``torch.func.jvp`` it drops the ``jvp`` rule and returns a wrong tangent. So a compiled
  call never reaches either the operator or the Function with a forward-mode transform active:
  ``interface.py`` sends such calls (``forward_ad``'s dual level is open: ``torch.func.jvp``
  opens one too) out of the graph to the eager path, which runs the fused kernel.
* Reverse mode: the operator with ``register_autograd`` composes with ``fullgraph=True``; the
  backward is the ``bwd`` operator, so both directions run the Triton kernels in the graph.
* Host overhead: the dispatcher costs microseconds per call, as much as a short launch, so eager
  calls keep calling the launchers directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashjvp._bwd import attn_bwd
from flashjvp._bwd_jvp import attn_bwd_jvp
from flashjvp._fwd import attn_fwd
from flashjvp._launch import empty_out, lse_buffer
from flashjvp._validate import AttnArgs, check_inputs


def _args(q: Tensor, k: Tensor, v: Tensor, causal: str | None, scale: float, layout: str,
          kv_lens: Tensor | None) -> AttnArgs:
    return check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False, kv_lens=kv_lens)


def _o_like(q: Tensor, a: AttnArgs) -> Tensor:  # the launcher's own buffers, faked
    return empty_out(a.batch, a.h_q, a.n_q, a.d_v, a.layout, q)


def _lse_like(q: Tensor, a: AttnArgs) -> Tensor:
    return lse_buffer(a.batch, a.h_q, a.n_q, q.device)


@torch.library.custom_op("flashjvp::fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: str | None, scale: float,
                layout: str, kv_lens: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(o, lse)``: o in ``layout`` (contiguous), lse (B, Hq, Nq) float32."""
    o, _, lse, _ = attn_fwd(q, k, v, None, None, None, _args(q, k, v, causal, scale, layout, kv_lens))
    return o, lse


@attn_fwd_op.register_fake
def _(q, k, v, causal, scale, layout, kv_lens):
    a = _args(q, k, v, causal, scale, layout, kv_lens)
    return _o_like(q, a), _lse_like(q, a)


@torch.library.custom_op("flashjvp::fwd_jvp", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor | None, tk: Tensor | None,
                    tv: Tensor | None, causal: str | None, scale: float,
                    layout: str, kv_lens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(o, to, lse, mu)`` of one fused launch; ``to`` and ``mu`` are zeros without tangents."""
    a = _args(q, k, v, causal, scale, layout, kv_lens)
    o, to, lse, mu = attn_fwd(q, k, v, tq, tk, tv, a, store_mu=True)
    if to is None:
        to, mu = torch.zeros_like(o), torch.zeros_like(lse)
    return o, to, lse, mu


@attn_fwd_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, causal, scale, layout, kv_lens):
    a = _args(q, k, v, causal, scale, layout, kv_lens)
    return _o_like(q, a), _o_like(q, a), _lse_like(q, a), _lse_like(q, a)


@torch.library.custom_op("flashjvp::bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                causal: str | None, scale: float, layout: str,
                kv_lens: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, each with its input's shape and strides (``torch.empty_like``)."""
    return attn_bwd(do, q, k, v, o, lse, _args(q, k, v, causal, scale, layout, kv_lens))


@attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, layout, kv_lens):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("flashjvp::bwd_jvp", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor | None, tk: Tensor | None, tv: Tensor | None,
                    o: Tensor, to: Tensor, lse: Tensor, mu: Tensor, do: Tensor | None, dto: Tensor | None,
                    dlse: Tensor | None, dmu: Tensor | None, causal: str | None, scale: float,
                    layout: str, kv_lens: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dtq, dtk, dtv)`` of ``fwd_jvp``; a tangent's gradient is an empty tensor
    when the tangent is None (an operator cannot return None)."""
    grads = attn_bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu,
                         _args(q, k, v, causal, scale, layout, kv_lens))
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@attn_bwd_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, causal, scale, layout, kv_lens):
    a = _args(q, k, v, causal, scale, layout, kv_lens)
    if a.layout == "bhnd":
        like = lambda x: torch.empty_like(x, memory_format=torch.contiguous_format)  # noqa: E731
    else:  # (B, H, N, D) contiguous buffers, returned transposed
        like = lambda x: torch.empty_like(x.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)  # noqa: E731
    return (*(like(x) for x in (q, k, v)), *(q.new_empty(0) if t is None else like(t) for t in (tq, tk, tv)))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, layout, kv_lens = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, kv_lens)
    ctx.options = (causal, scale, layout)


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, kv_lens = ctx.saved_tensors
    dq, dk, dv = attn_bwd_op(do, q, k, v, o, lse, *ctx.options, kv_lens)
    return dq, dk, dv, None, None, None, None


attn_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _fwd_jvp_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6], *output, inputs[9])
    ctx.options = inputs[6:9]


def _fwd_jvp_backward(ctx, do, dto, dlse, dmu):
    q, k, v, tq, tk, tv, o, to, lse, mu, kv_lens = ctx.saved_tensors
    grads = attn_bwd_jvp_op(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, *ctx.options, kv_lens)
    return (*grads[:3], *(None if t is None else g for t, g in zip((tq, tk, tv), grads[3:])), None, None, None, None)


attn_fwd_jvp_op.register_autograd(_fwd_jvp_backward, setup_context=_fwd_jvp_setup_context)
