"""The torch.compile boundary: flashjvp's launches as PyTorch custom operators.

``torch.compile`` cannot trace into a Triton launcher written in Python (Dynamo refuses the
Autotuner and the launch), so under compilation the public functions call these operators,
which Dynamo and AOTAutograd treat as opaque nodes: the fake (meta) implementations give the
shapes, dtypes and strides of every output without running anything, the real ones call the same
launchers as eager mode.

Why custom operators with ``register_autograd`` for the compiled path, and the eager
``autograd.Function``s (``_autograd.py``) everywhere else:

* Forward-mode AD: a custom operator has no forward-mode rule (PyTorch offers none to register),
  and under ``torch.func.jvp`` such an operator silently yields a zero tangent. An
  ``autograd.Function`` with a ``jvp`` is no way out under compilation: Dynamo refuses it when
  inputs require grad ("Unsupported custom jvp"), and traced under ``torch.func.jvp`` it drops
  the rule and returns a wrong tangent. So a compiled call with a forward-AD level open writes the
  rule out instead (``interface._attention_dual``): the inputs' primals and tangents taken apart
  with ``unpack_dual``, the ``fwd_jvp`` operator on them, ``make_dual(o, to)``. That is only sound
  where the trace sees every tangent, i.e. where the level was opened inside the traced function;
  other compiled calls with a level open leave the graph for the eager path (the
  ``autograd.Function``s), which runs the same fused kernel.
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
from flashjvp._launch import PlanCache, out_buffer, stat_buffer
from flashjvp._sparse import SparsePlan
from flashjvp._validate import AttnArgs, check_inputs, varlen_args


# Every operator ends with the call's options, ``options(a)``: causal, scale, layout, kv_lens,
# window ([] or [left, right, bottom_right], bottom_right 1 where the window is measured from the
# bottom-right diagonal; a missing third entry means 0), for packed sequences cu_q, cu_k, max_q,
# max_k (the tensors are then the (1, total, H, D) views), the attention mask (its
# (B, Hq, Nq, Nk) view, or None), and a block mask as _sparse.SparsePlan's row, col and bits tensors
# with [block_m, block_n, runs] (all None without one: the defaults).
def options(a: AttnArgs) -> tuple:
    """The operators' trailing arguments for the call ``a``."""
    vl, sp = a.varlen, a.sparse
    window = [] if a.window is None else [*a.window, int(a.diagonal == "bottom_right")]
    return (a.causal, a.scale, a.layout, a.kv_lens, window,
            None if vl is None else vl.cu_q, None if vl is None else vl.cu_k,
            0 if vl is None else vl.max_q, 0 if vl is None else vl.max_k, a.mask,
            *((None,) * 4 if sp is None else (sp.row, sp.col, sp.bits, [sp.block_m, sp.block_n, int(sp.runs)])))


# AttnArgs of the operators' plain calls (no tensor option, no window) by sizes, dtypes, devices
# and options: a compiled graph calls the same operators with the same shapes at every step, and
# the checks cost a good share of an operator's host time. AttnArgs is immutable: shared safely.
_PLAIN = PlanCache()


def _args(q: Tensor, k: Tensor, v: Tensor, causal, scale, layout, kv_lens, window, cu_q, cu_k, max_q,
          max_k, mask, sp_row=None, sp_col=None, sp_bits=None, sp_block=None) -> AttnArgs:
    if kv_lens is None and not window and cu_q is None and mask is None and sp_row is None:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal, scale,
               layout)
        try:
            a = _PLAIN.get(key)
        except TypeError:  # symbolic sizes (dynamic shapes, while tracing): not cached
            a = key = None
        if a is None:
            a = check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False)
            if key is not None:
                _PLAIN.put(key, a)
        return a
    align = None
    if window:
        align = "bottom_right" if len(window) > 2 and window[2] else "top_left"
    sparse = None
    if sp_row is not None:
        seq = 2 if layout == "bhnd" else 1
        sparse = SparsePlan(sp_row, sp_col, sp_bits, sp_block[0], sp_block[1], 0.0, q.shape[seq], k.shape[seq],
                            bool(sp_block[2]))
    a = check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False, kv_lens=kv_lens,
                     window=tuple(window[:2]) if window else None, attn_mask=mask, align=align, sparse=sparse)
    if cu_q is not None:  # checked by the public function: no device-to-host copy here
        a = varlen_args(a, q.device, cu_q, cu_k, max_q, max_k, check_values=False)
    return a


def _o_like(q: Tensor, a: AttnArgs) -> Tensor:  # the launcher's own buffers, faked
    return out_buffer(a, q)


def _lse_like(q: Tensor, a: AttnArgs) -> Tensor:
    return stat_buffer(a, q.device)


@torch.library.custom_op("flashjvp::fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd_op(q: Tensor, k: Tensor, v: Tensor, causal: str | None, scale: float, layout: str,
                kv_lens: Tensor | None, window: list[int], cu_q: Tensor | None, cu_k: Tensor | None,
                max_q: int, max_k: int, mask: Tensor | None,
                sp_row: Tensor | None = None, sp_col: Tensor | None = None, sp_bits: Tensor | None = None,
                sp_block: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """``(o, lse)``: o in ``layout`` (contiguous), lse (B, Hq, Nq) float32."""
    a = _args(q, k, v, causal, scale, layout, kv_lens, window, cu_q, cu_k, max_q, max_k, mask,
              sp_row, sp_col, sp_bits, sp_block)
    o, _, lse, _ = attn_fwd(q, k, v, None, None, None, a)
    return o, lse


@attn_fwd_op.register_fake
def _(q, k, v, *opts):
    a = _args(q, k, v, *opts)
    return _o_like(q, a), _lse_like(q, a)


@torch.library.custom_op("flashjvp::fwd_jvp", mutates_args=(), device_types=("cuda", "cpu"))
def attn_fwd_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor | None, tk: Tensor | None,
                    tv: Tensor | None, causal: str | None, scale: float, layout: str,
                    kv_lens: Tensor | None, window: list[int], cu_q: Tensor | None, cu_k: Tensor | None,
                    max_q: int, max_k: int, mask: Tensor | None,
                    sp_row: Tensor | None = None, sp_col: Tensor | None = None, sp_bits: Tensor | None = None,
                    sp_block: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(o, to, lse, mu)`` of one fused launch; ``to`` and ``mu`` are zeros without tangents."""
    a = _args(q, k, v, causal, scale, layout, kv_lens, window, cu_q, cu_k, max_q, max_k, mask,
              sp_row, sp_col, sp_bits, sp_block)
    o, to, lse, mu = attn_fwd(q, k, v, tq, tk, tv, a, store_mu=True)
    if to is None:
        to, mu = torch.zeros_like(o), torch.zeros_like(lse)
    return o, to, lse, mu


@attn_fwd_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, *opts):
    a = _args(q, k, v, *opts)
    return _o_like(q, a), _o_like(q, a), _lse_like(q, a), _lse_like(q, a)


@torch.library.custom_op("flashjvp::bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                causal: str | None, scale: float, layout: str, kv_lens: Tensor | None, window: list[int],
                cu_q: Tensor | None, cu_k: Tensor | None, max_q: int, max_k: int,
                mask: Tensor | None, sp_row: Tensor | None = None, sp_col: Tensor | None = None,
                sp_bits: Tensor | None = None,
                sp_block: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, each with its input's shape and strides (``torch.empty_like``)."""
    a = _args(q, k, v, causal, scale, layout, kv_lens, window, cu_q, cu_k, max_q, max_k, mask,
              sp_row, sp_col, sp_bits, sp_block)
    return attn_bwd(do, q, k, v, o, lse, a)


@attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, *opts):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("flashjvp::bwd_jvp", mutates_args=(), device_types=("cuda", "cpu"))
def attn_bwd_jvp_op(q: Tensor, k: Tensor, v: Tensor, tq: Tensor | None, tk: Tensor | None, tv: Tensor | None,
                    o: Tensor, to: Tensor, lse: Tensor, mu: Tensor, do: Tensor | None, dto: Tensor | None,
                    dlse: Tensor | None, dmu: Tensor | None, causal: str | None, scale: float,
                    layout: str, kv_lens: Tensor | None, window: list[int], cu_q: Tensor | None,
                    cu_k: Tensor | None, max_q: int, max_k: int,
                    mask: Tensor | None, sp_row: Tensor | None = None, sp_col: Tensor | None = None,
                sp_bits: Tensor | None = None,
                    sp_block: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dtq, dtk, dtv)`` of ``fwd_jvp``; a tangent's gradient is an empty tensor
    when the tangent is None (an operator cannot return None)."""
    a = _args(q, k, v, causal, scale, layout, kv_lens, window, cu_q, cu_k, max_q, max_k, mask,
              sp_row, sp_col, sp_bits, sp_block)
    grads = attn_bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, a)
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@attn_bwd_jvp_op.register_fake
def _(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, *opts):
    a = _args(q, k, v, *opts)
    if a.layout == "bhnd":
        like = lambda x: torch.empty_like(x, memory_format=torch.contiguous_format)  # noqa: E731
    else:  # (B, H, N, D) contiguous buffers, returned transposed
        like = lambda x: torch.empty_like(x.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)  # noqa: E731
    return (*(like(x) for x in (q, k, v)), *(q.new_empty(0) if t is None else like(t) for t in (tq, tk, tv)))


_N_OPTIONS = 14  # the options' count: none of them is differentiable
_TENSOR_OPTIONS = (3, 5, 6, 9, 10, 11, 12)  # kv_lens, cu_q, cu_k, mask, sp_row, sp_col, sp_bits: saved as tensors


def _save_options(ctx, opts) -> tuple:
    ctx.options = [None if i in _TENSOR_OPTIONS else x for i, x in enumerate(opts)]
    return tuple(opts[i] for i in _TENSOR_OPTIONS)


def _load_options(ctx, saved) -> list:
    opts = list(ctx.options)
    for i, x in zip(_TENSOR_OPTIONS, saved):
        opts[i] = x
    return opts


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, *opts = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, *_save_options(ctx, opts))


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, *saved = ctx.saved_tensors
    dq, dk, dv = attn_bwd_op(do, q, k, v, o, lse, *_load_options(ctx, saved))
    return dq, dk, dv, *(None,) * _N_OPTIONS


attn_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _fwd_jvp_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # unused outputs' cotangents come as None, not zeros
    ctx.save_for_backward(*inputs[:6], *output, *_save_options(ctx, inputs[6:]))


def _fwd_jvp_backward(ctx, do, dto, dlse, dmu):
    q, k, v, tq, tk, tv, o, to, lse, mu, *saved = ctx.saved_tensors
    opts = _load_options(ctx, saved)
    if dto is None and dlse is None and dmu is None:  # first order (MeanFlow): the plain backward
        if do is None:
            return (None,) * (6 + _N_OPTIONS)
        return (*attn_bwd_op(do, q, k, v, o, lse, *opts), *(None,) * (3 + _N_OPTIONS))
    grads = attn_bwd_jvp_op(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, *opts)
    return (*grads[:3], *(None if t is None else g for t, g in zip((tq, tk, tv), grads[3:])), *(None,) * _N_OPTIONS)


attn_fwd_jvp_op.register_autograd(_fwd_jvp_backward, setup_context=_fwd_jvp_setup_context)
