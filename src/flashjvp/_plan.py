"""The eager host path of plain calls: one dictionary lookup from a call's signature to what runs.

A *plain* call is one that no tangent can reach: no forward-AD level is open (``torch.func.jvp``
opens one too), no ``torch.func`` transform is active and Dynamo is not tracing. Such a call of
:func:`flashjvp.attention` or :func:`flashjvp.sdpa` is served from a plan cached by its signature
(sizes, strides, dtypes, devices, options, whether a backward can follow, 16-byte alignment and
the switches of ``_route.switch_values``) in ``_launch.PLANS``, the one plan cache: a repeated
call skips the argument checks, the routing and the launch arguments.

The plan runs the route ``_route.choose`` gave the call (``_backends.route_of``):

* ``flash``: ``aten._scaled_dot_product_flash_attention``, called directly; PyTorch records its
  backward (``ScaledDotProductFlashAttentionBackward0``).
* ``cudnn`` in both directions: ``aten._scaled_dot_product_cudnn_attention``, called directly,
  PyTorch records its backward; without a backward to follow, cuDNN's inference kernel runs.
* otherwise flashjvp's forward (Triton, or cuDNN's with its log-sum-exp) through
  ``AttentionFunction`` when a backward can follow, whose backward runs the route's backend.

``attention`` gets ``o`` contiguous in the call's layout (its contract; a copy where PyTorch's
operator returns other strides); ``sdpa`` gets ``o`` with the strides PyTorch's operator gives it,
as ``F.scaled_dot_product_attention`` does.

Calls with tangents, masks, key padding, windows or packed batches take the checked path.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

from flashjvp import _cudnn
from flashjvp._autograd import AttentionFunction, AttentionJVPFunction
from flashjvp._backends import PLANS, refuse, route_of, run_fwd
from flashjvp._cudnn import contiguous_strides, matching_layout_strides
from flashjvp._fwd import attn_fwd
from flashjvp._launch import LaunchLog, aligned16, out_shape, record_launch
from flashjvp._route import CUDNN, FLASH, TRITON, switch_values
from flashjvp._validate import AttnArgs, bhnd_view

_peek_transform = torch._C._functorch.peek_interpreter_stack
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_NO_PLAN = object()  # a signature the checked path must serve every time (cached refusal)


def plain_plan(q, k, v, causal, scale, layout, make_args, tag=None, contiguous=True):
    """The function ``(q, k, v) -> o`` serving this plain call, or None where the caller must take
    its checked path (not a plain call, or a signature no plan serves); the function itself
    returns None where cuDNN refused the call (then, too, the checked path). ``make_args()``
    validates the call on a cache miss: it returns its ``AttnArgs`` (raising the caller's errors for bad
    arguments) or None (no plan for this signature); ``tag`` separates callers whose arguments
    mean different things (``sdpa``'s ``enable_gqa``); ``contiguous``: ``o`` contiguous in the
    call's layout (else with the strides PyTorch's operator gives it)."""
    if torch.compiler.is_compiling() or fwAD._current_level >= 0 or _peek_transform() is not None:
        return None  # (is_compiling first: Dynamo cannot trace the functorch query)
    if type(q) not in _PLAIN_TYPES or type(k) not in _PLAIN_TYPES or type(v) not in _PLAIN_TYPES:
        return None
    try:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        values = switch_values()
        key = ("plain", q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, scale, layout, tag, contiguous, grad, aligned16(q, k, v), values)
        plan = PLANS.get(key)
    except (TypeError, RuntimeError):  # unhashable options, or tensors without strides
        return None
    if plan is None:
        a = make_args()
        plan = _NO_PLAN if a is None else _make_plan(q, k, v, a, grad, contiguous, values)
        PLANS.put(key, plan)
    return None if plan is _NO_PLAN else plan


def _make_plan(q, k, v, a: AttnArgs, grad: bool, contiguous: bool, values: tuple):
    if a.kv_lens is not None or a.window is not None or a.mask is not None or a.varlen is not None \
            or a.sparse is not None or not q.is_cuda:  # the CPU paths gain nothing from a plan
        return _NO_PLAN
    route = route_of(q, k, v, a, grad=grad, values=values)
    if route.fwd == FLASH:
        return _flash_plan(a, grad, contiguous)
    if route.fwd == CUDNN and route.bwd in (CUDNN, None):
        return _cudnn_plan(q, a, grad, contiguous)
    if grad:
        return lambda q, k, v: AttentionFunction.apply(q, k, v, a, False, route)[0]
    if route.fwd == TRITON:
        return lambda q, k, v: run_fwd(q, k, v, a, TRITON, need_lse=False)[0]
    return _NO_PLAN


def _direct(op):
    """The C++ callable behind an ``OpOverload`` (what its ``__call__`` forwards to), else the
    overload itself: a plan calls it without the Python frame in between, as SDPA does in C++."""
    return getattr(op, "_op", op)


def _output(o, a: AttnArgs, contiguous: bool):
    """``o`` of a PyTorch operator, (B, H, N, D), in the call's layout, contiguous if asked."""
    o = bhnd_view(o, a.layout)
    return o.contiguous() if contiguous else o


def _flash_plan(a: AttnArgs, grad: bool, contiguous: bool):
    """``(q, k, v) -> o`` through ``aten._scaled_dot_product_flash_attention`` (PyTorch records the
    backward); the log-sum-exp it returns is dropped."""
    op = _direct(torch.ops.aten._scaled_dot_product_flash_attention.default)
    causal, scale, layout = a.causal is not None, a.scale, a.layout

    def run(q, k, v):
        o = op(bhnd_view(q, layout), bhnd_view(k, layout), bhnd_view(v, layout), 0.0, causal, False, scale=scale)[0]
        if LaunchLog._active:
            record_launch("torch_flash_fwd", {}, CAUSAL=causal, LAYOUT=layout, GRAD=grad)
        return _output(o, a, contiguous)

    return run


def _cudnn_plan(q, a: AttnArgs, grad: bool, contiguous: bool):
    """``(q, k, v) -> o`` through ``aten._scaled_dot_product_cudnn_attention`` for the call ``a``
    (None if cuDNN refuses it: the caller then takes its checked path, which from then on routes
    the shape class to Triton); PyTorch's autograd records the backward. ``o`` comes back
    contiguous in the call's layout, as from the checked path (a copy only where cuDNN, which
    gives ``o`` q's order of dimensions, gives another)."""
    op = _direct(_cudnn._ops()[0])
    causal, scale, layout = a.causal is not None, a.scale, a.layout
    flip = layout == "bnhd"
    o_shape = (a.batch, a.h_q, a.n_q, a.d_v)
    o_strides = bhnd_view(torch.empty_strided(o_shape, matching_layout_strides(bhnd_view(q, layout), o_shape),
                                              device="meta"), layout).stride()
    copy = contiguous and o_strides != contiguous_strides(out_shape(a.batch, a.h_q, a.n_q, a.d_v, layout))

    def run(q, k, v):
        if flip:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        try:
            o = op(q, k, v, None, grad, 0.0, causal, False, scale=scale)[0]
        except RuntimeError as e:
            refuse(q, a, False, e)
            return None
        if flip:
            o = o.transpose(1, 2)
        if copy:
            o = o.contiguous()
        if LaunchLog._active:
            record_launch("cudnn_sdpa_fwd", {}, CAUSAL=causal, LAYOUT=layout, LSE=grad)
        return o

    return run


def jvp_plan(q, k, v, tq, tk, tv, causal, scale, layout, align, return_lse, make_args):
    """The function ``(q, k, v, tq, tk, tv) -> (o, to, lse, mu)`` serving this call of
    ``attention_jvp`` without masking options (as ``_attention_jvp`` returns them), or None where
    the caller must take its checked path: under a transform, a forward-AD level or Dynamo, for
    tensor subclasses, on the CPU, or without any tangent. ``make_args()`` validates the call on a
    cache miss."""
    if torch.compiler.is_compiling() or fwAD._current_level >= 0 or _peek_transform() is not None:
        return None
    xs = (q, k, v, tq, tk, tv)
    if any(x is not None and type(x) not in _PLAIN_TYPES for x in xs) or (tq is None and tk is None and tv is None):
        return None
    try:
        grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)
        values = switch_values()
        key = ("jvp", *(None if x is None else (x.shape, x.stride(), x.dtype, x.device) for x in xs), causal,
               scale, layout, align, return_lse, grad, aligned16(*xs), values)
        plan = PLANS.get(key)
    except (TypeError, RuntimeError):  # unhashable options, or tensors without strides
        return None
    if plan is None:
        a = make_args()
        plan = _NO_PLAN
        if q.is_cuda and a.kv_lens is None and a.window is None and a.mask is None and a.sparse is None:
            plan = _jvp_run(a, grad, return_lse, route_of(q, k, v, a, tangents=True, grad=grad, in_function=True))
        PLANS.put(key, plan)
    return None if plan is _NO_PLAN else plan


def _jvp_run(a: AttnArgs, grad: bool, return_lse: bool, route):
    def run(q, k, v, tq, tk, tv):
        if grad:
            o, to, lse, mu = AttentionJVPFunction.apply(q, k, v, tq, tk, tv, a, True, route)
        else:
            o, to, lse, mu = attn_fwd(q, k, v, tq, tk, tv, a, store_mu=return_lse)
        return o, to, lse, (mu if return_lse else None)

    return run


_MISSING = object()


def checked_args(key_of, make):
    """The validated ``AttnArgs`` of a call that no plan serves (inside ``torch.func`` transforms,
    under forward AD): ``make()``, kept in the plan cache by ``key_of()`` (the sizes, dtypes,
    devices and options the checks read), so a model's repeated calls skip the checks. Not while
    Dynamo traces (it would guard on the cache), not for arguments without such a key; ``make()``
    raises its errors on every call (nothing is kept for them)."""
    if torch.compiler.is_compiling():
        return make()
    try:
        key = key_of()
        a = PLANS.get(key, _MISSING)
    except (TypeError, AttributeError, RuntimeError):  # not tensors, unhashable options, symbolic sizes
        return make()
    if a is _MISSING:
        a = make()
        PLANS.put(key, a)
    return a


def signature(*xs) -> tuple:
    """What argument checks read of tensors (``None`` allowed): types, shapes, dtypes, devices, layouts."""
    return tuple(None if x is None else (type(x), x.shape, x.dtype, x.device, x.layout) for x in xs)
