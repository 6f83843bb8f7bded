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

import dataclasses

import torch
from torch import Tensor

from flashjvp._backends import route_of, run_bwd, run_fwd
from flashjvp._bwd_jvp import attn_bwd_jvp
from flashjvp._fwd import attn_fwd
from flashjvp._launch import PLANS, out_buffer, stat_buffer
from flashjvp._sparse import SparsePlan
from flashjvp._validate import LAYOUTS, AttnArgs, check_inputs, varlen_args

# Every operator ends with the call's options, ``options(a)``: ``flags``, a list of integers
# (fields _F_*: causal, layout, window, packed-batch longest lengths, block-mask blocks, outputs in
# q's order), then ``scale`` and the tensor options kv_lens, cu_q, cu_k (packed sequences: the tensors
# are then the (1, total, H, D) views), the attention mask (its (B, Hq, Nq, Nk) view) and a block
# mask as _sparse.SparsePlan's row, col and bits tensors (None where absent). Packed, because the
# dispatcher's cost grows with the number of arguments it converts.
_CAUSALS = (None, "top_left", "bottom_right")
(_F_CAUSAL, _F_LAYOUT, _F_WINDOW, _F_LEFT, _F_RIGHT, _F_BOTTOM_RIGHT, _F_MAX_Q, _F_MAX_K, _F_BLOCK_M, _F_BLOCK_N,
 _F_RUNS, _F_OUT_LIKE_Q) = range(12)


def options(a: AttnArgs) -> tuple:
    """The operators' trailing arguments for the call ``a``."""
    vl, sp = a.varlen, a.sparse
    left, right = a.window or (-1, -1)
    flags = [_CAUSALS.index(a.causal), LAYOUTS.index(a.layout), int(a.window is not None), left, right,
             int(a.diagonal == "bottom_right"), 0 if vl is None else vl.max_q, 0 if vl is None else vl.max_k,
             0 if sp is None else sp.block_m, 0 if sp is None else sp.block_n, int(sp is not None and sp.runs),
             int(a.out_like_q)]
    return (flags, a.scale, a.kv_lens, None if vl is None else vl.cu_q, None if vl is None else vl.cu_k, a.mask,
            *((None,) * 3 if sp is None else (sp.row, sp.col, sp.bits)))


# AttnArgs of the operators' plain calls (no tensor option, no window) are kept in the plan cache
# by sizes, dtypes, devices and options: a compiled graph calls the same operators with the same
# shapes at every step, and the checks cost a good share of an operator's host time. AttnArgs is
# immutable: shared safely.


def _args(q: Tensor, k: Tensor, v: Tensor, flags: list[int], scale: float, kv_lens=None, cu_q=None, cu_k=None,
          mask=None, sp_row=None, sp_col=None, sp_bits=None) -> AttnArgs:
    """The ``AttnArgs`` the operators' arguments stand for (the inverse of ``options``)."""
    if kv_lens is None and cu_q is None and mask is None and sp_row is None and not flags[_F_WINDOW]:
        key = ("args", q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, tuple(flags),
               scale)
        try:
            a = PLANS.get(key)
        except TypeError:  # symbolic sizes (dynamic shapes, while tracing): not cached
            a = key = None
        if a is None:
            a = _checked(q, k, v, flags, scale)
            if key is not None:
                PLANS.put(key, a)
        return a
    return _checked(q, k, v, flags, scale, kv_lens, cu_q, cu_k, mask, sp_row, sp_col, sp_bits)


def _checked(q, k, v, flags, scale, kv_lens=None, cu_q=None, cu_k=None, mask=None, sp_row=None, sp_col=None,
             sp_bits=None) -> AttnArgs:
    layout = LAYOUTS[flags[_F_LAYOUT]]
    window = (flags[_F_LEFT], flags[_F_RIGHT]) if flags[_F_WINDOW] else None
    align = ("bottom_right" if flags[_F_BOTTOM_RIGHT] else "top_left") if window else None
    sparse = None
    if sp_row is not None:
        seq = 2 if layout == "bhnd" else 1
        sparse = SparsePlan(sp_row, sp_col, sp_bits, flags[_F_BLOCK_M], flags[_F_BLOCK_N], 0.0, q.shape[seq],
                            k.shape[seq], bool(flags[_F_RUNS]))
    a = check_inputs(q, k, v, causal=_CAUSALS[flags[_F_CAUSAL]], scale=scale, layout=layout, allow_float64=False,
                     kv_lens=kv_lens, window=window, attn_mask=mask, align=align, sparse=sparse)
    if cu_q is not None:  # checked by the public function: no device-to-host copy here
        a = varlen_args(a, q.device, cu_q, cu_k, flags[_F_MAX_Q], flags[_F_MAX_K], check_values=False)
    return dataclasses.replace(a, out_like_q=True) if flags[_F_OUT_LIKE_Q] else a


def _o_like(q: Tensor, a: AttnArgs) -> Tensor:  # the launcher's own buffers, faked
    return out_buffer(a, q)


def _lse_like(q: Tensor, a: AttnArgs) -> Tensor:
    return stat_buffer(a, q.device)


# Defined with torch.library.Library rather than torch.library.custom_op: the latter wraps each
# implementation in Python that checks its outputs for aliases on every call, which costs more
# host time than the launch itself at image-model sizes; these implementations never alias.
_LIB = torch.library.Library("flashjvp", "DEF")
_OPTIONS = "int[] flags, float scale, Tensor? kv_lens, Tensor? cu_q, Tensor? cu_k, Tensor? mask, " \
           "Tensor? sp_row, Tensor? sp_col, Tensor? sp_bits"


def _define(schema: str, impl, fake):
    """Define ``flashjvp::<name>`` with ``schema`` (the options appended), its CPU and CUDA
    implementation and its fake; returns the operator's ``OpOverload``."""
    name = schema[:schema.index("(")]
    _LIB.define(schema.replace("OPTIONS", _OPTIONS))
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, impl, key)
    torch.library.register_fake(f"flashjvp::{name}", fake, lib=_LIB)
    return getattr(torch.ops.flashjvp, name).default


def _fwd(q, k, v, *opts):
    """``(o, lse)``: o with ``_launch.out_strides``, lse (B, Hq, Nq) float32; on the backend of the
    call's route (flashjvp's autograd runs its backward: ``in_function``)."""
    a = _args(q, k, v, *opts)
    o, _, lse, _ = run_fwd(q, k, v, a, route_of(q, k, v, a, grad=True, in_function=True).fwd)
    return o, lse


def _fwd_fake(q, k, v, *opts):
    a = _args(q, k, v, *opts)
    return _o_like(q, a), _lse_like(q, a)


attn_fwd_op = _define("fwd(Tensor q, Tensor k, Tensor v, OPTIONS) -> (Tensor, Tensor)", _fwd, _fwd_fake)


def _fwd_jvp(q, k, v, tq, tk, tv, *opts):
    """``(o, to, lse, mu)`` of one fused launch; ``to`` and ``mu`` are zeros without tangents."""
    o, to, lse, mu = attn_fwd(q, k, v, tq, tk, tv, _args(q, k, v, *opts), store_mu=True)
    if to is None:
        to, mu = torch.zeros_like(o), torch.zeros_like(lse)
    return o, to, lse, mu


def _fwd_jvp_fake(q, k, v, tq, tk, tv, *opts):
    a = _args(q, k, v, *opts)
    return _o_like(q, a), _o_like(q, a), _lse_like(q, a), _lse_like(q, a)


attn_fwd_jvp_op = _define("fwd_jvp(Tensor q, Tensor k, Tensor v, Tensor? tq, Tensor? tk, Tensor? tv, OPTIONS) "
                          "-> (Tensor, Tensor, Tensor, Tensor)", _fwd_jvp, _fwd_jvp_fake)


def _bwd(do, q, k, v, o, lse, *opts):
    """``(dq, dk, dv)``, each with its input's shape and strides (``torch.empty_like``), on the
    backend of the call's route."""
    a = _args(q, k, v, *opts)
    return run_bwd(do, q, k, v, o, lse, a, route_of(q, k, v, a, grad=True, in_function=True).bwd)


def _bwd_fake(do, q, k, v, o, lse, *opts):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


attn_bwd_op = _define("bwd(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, OPTIONS) "
                      "-> (Tensor, Tensor, Tensor)", _bwd, _bwd_fake)


def _bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, *opts):
    """``(dq, dk, dv, dtq, dtk, dtv)`` of ``fwd_jvp``; a tangent's gradient is an empty tensor
    when the tangent is None (an operator cannot return None)."""
    grads = attn_bwd_jvp(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, _args(q, k, v, *opts))
    return tuple(q.new_empty(0) if g is None else g for g in grads)


def _bwd_jvp_fake(q, k, v, tq, tk, tv, o, to, lse, mu, do, dto, dlse, dmu, *opts):
    a = _args(q, k, v, *opts)
    if a.layout == "bhnd":
        like = lambda x: torch.empty_like(x, memory_format=torch.contiguous_format)  # noqa: E731
    else:  # (B, H, N, D) contiguous buffers, returned transposed
        like = lambda x: torch.empty_like(x.transpose(1, 2), memory_format=torch.contiguous_format).transpose(1, 2)  # noqa: E731
    return (*(like(x) for x in (q, k, v)), *(q.new_empty(0) if t is None else like(t) for t in (tq, tk, tv)))


attn_bwd_jvp_op = _define(
    "bwd_jvp(Tensor q, Tensor k, Tensor v, Tensor? tq, Tensor? tk, Tensor? tv, Tensor o, Tensor to, Tensor lse, "
    "Tensor mu, Tensor? do, Tensor? dto, Tensor? dlse, Tensor? dmu, OPTIONS) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _bwd_jvp, _bwd_jvp_fake)


_N_OPTIONS = 9  # the options' count: none of them is differentiable
_TENSOR_OPTIONS = (2, 3, 4, 5, 6, 7, 8)  # kv_lens, cu_q, cu_k, mask, sp_row, sp_col, sp_bits: saved as tensors


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


torch.library.register_autograd("flashjvp::fwd", _fwd_backward, setup_context=_fwd_setup_context, lib=_LIB)


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


torch.library.register_autograd("flashjvp::fwd_jvp", _fwd_jvp_backward, setup_context=_fwd_jvp_setup_context,
                                lib=_LIB)
