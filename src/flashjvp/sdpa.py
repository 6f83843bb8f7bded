"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` running flashjvp's kernels.

:func:`sdpa` has exactly the signature and semantics of PyTorch's SDPA. Calls that flashjvp's
kernels can serve go to :func:`flashjvp.attention` (fused forward + JVP under
``torch.func.jvp``/``forward_ad``, Triton backward); the others take one of two other paths:

* arguments that PyTorch rejects, or that only its own dispatcher defines (broadcast batch
  dims, key/value of other ranks, empty tensors, ...): PyTorch's SDPA itself is called, so
  errors and results are PyTorch's, word for word;
* valid arguments the kernels lack (``dropout_p > 0``, float64, head dims over 256,
  non-positive ``scale``, key and value with different head counts, a float ``attn_mask`` that
  requires grad or carries a forward tangent): :func:`_math_sdpa`,
  PyTorch's math backend in plain ``torch`` ops, correct under every transform
  (``torch.func.jvp``, ``vmap``, backward), unlike PyTorch's fused SDPA backends.

Either fallback warns (:class:`SDPAFallbackWarning`) once per call site and reason.
:func:`patch_sdpa` routes every ``scaled_dot_product_attention`` call made inside it to
:func:`sdpa`, however the caller imported the function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import sys
import threading
import warnings
from types import FunctionType

import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode

from flashjvp._plan import checked_args, plain_plan, signature
from flashjvp._validate import KERNEL_DTYPES, MAX_HEAD_DIM, check_inputs
from flashjvp.interface import _attention

__all__ = ["sdpa", "patch_sdpa", "SDPAFallbackWarning"]

# PyTorch's SDPA, captured at import: stays the real one even if someone rebinds the attribute
# ``torch.nn.functional.scaled_dot_product_attention`` to :func:`sdpa`.
_torch_sdpa = torch._C._nn.scaled_dot_product_attention

# True while a fallback of :func:`sdpa` runs: every patch_sdpa mode then passes calls through
# untouched, so the fallbacks' own call of PyTorch's SDPA never comes back here (nested modes too).
_inside_sdpa: contextvars.ContextVar[bool] = contextvars.ContextVar("flashjvp_inside_sdpa",
                                                                    default=False)

# (filename, line, reason) of every call site already warned about.
_warned: set[tuple[str, int, str]] = set()
_warned_lock = threading.Lock()

_TORCH, _MATH = "torch", "math"

# Calls ``func`` past one level of ``__torch_function__`` handling, so that a mode passing a
# Python-level function of ``torch.nn.functional`` through (``multi_head_attention_forward``) can
# stay active for the SDPA call inside it. PyTorch 2.11 lacks it: see _with_sdpa_rebound.
_redispatch = getattr(torch._C, "_skip_one_hop_torch_function", None)
_rebound: dict = {}


def _is_python_functional(func) -> bool:
    return isinstance(func, FunctionType) and func.__module__ == "torch.nn.functional"


def _with_sdpa_rebound(func):
    """For PyTorch without ``_skip_one_hop_torch_function`` (2.11): a copy of a
    ``torch.nn.functional`` function whose global ``scaled_dot_product_attention`` is
    :func:`sdpa` (the copy shares code, defaults and closure; only its globals differ). A mode is
    switched off while its ``__torch_function__`` runs, so without this the SDPA call inside
    ``F.multi_head_attention_forward`` would run PyTorch's own SDPA, which fails under
    ``torch.func.jvp`` on CUDA (seen on the H200 with torch 2.11)."""
    if "scaled_dot_product_attention" not in func.__code__.co_names:
        return func
    copy = _rebound.get(func)
    if copy is None:
        copy = FunctionType(func.__code__, {**func.__globals__, "scaled_dot_product_attention": sdpa},
                            func.__name__, func.__defaults__, func.__closure__)
        copy.__kwdefaults__ = func.__kwdefaults__
        _rebound[func] = copy
    return copy


class SDPAFallbackWarning(UserWarning):
    """A :func:`sdpa` call that flashjvp's kernels cannot serve took a PyTorch path instead."""


_OWN_FILES = {__file__, torch._dynamo.eval_frame.__file__}


def _warn_once(reason: str) -> None:
    """Warn about ``reason`` once per call site: the first frame outside this module (and
    outside the wrapper of ``torch.compiler.disable``)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename in _OWN_FILES:
        frame, level = frame.f_back, level + 1
    key = (frame.f_code.co_filename, frame.f_lineno, reason) if frame is not None else ("", 0, reason)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"flashjvp.sdpa: {reason}", SDPAFallbackWarning, stacklevel=level)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``None`` when the kernels serve the call, else ``(path, reason)`` with path ``_TORCH``
    (PyTorch's SDPA: it rejects the arguments or defines them itself) or ``_MATH``."""
    qkv = (query, key, value)
    if (not all(type(x) is torch.Tensor or isinstance(x, torch.nn.Parameter) for x in qkv)
            or not (attn_mask is None or isinstance(attn_mask, torch.Tensor))
            or type(is_causal) is not bool or type(enable_gqa) is not bool
            or not _is_real(dropout_p) or not (scale is None or _is_real(scale))):
        return _TORCH, "argument types or tensor subclasses flashjvp does not handle"
    if any(x.is_nested or x.layout != torch.strided for x in qkv):
        return _TORCH, "nested or sparse tensors"
    if len({x.dtype for x in qkv}) > 1 or len({x.device for x in qkv}) > 1:
        return _TORCH, "query, key and value of different dtypes or devices"
    if not query.is_floating_point():
        return _TORCH, f"dtype {query.dtype}"
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        return _TORCH, "query, key and value of different ranks, or of rank < 2"
    if (attn_mask is not None
            and (attn_mask.dtype not in (torch.bool, torch.float32, query.dtype) or is_causal)):
        return _TORCH, "attn_mask of an unsupported dtype, or together with is_causal=True"
    if not 0.0 <= dropout_p <= 1.0:
        return _TORCH, f"dropout_p={dropout_p}"
    if any(n == 0 for x in qkv for n in x.shape):
        return _TORCH, "empty tensors"
    if key.shape[-2] != value.shape[-2] or key.shape[-1] != query.shape[-1]:
        return _TORCH, "mismatched sequence lengths or head dims"
    if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:
        return _TORCH, "batch dims that differ (broadcast)"
    if rank >= 3:
        h_q, h_k, h_v = (x.shape[-3] for x in qkv)
        if enable_gqa and (h_q % h_k or h_q % h_v):
            return _TORCH, "head counts of key/value that do not divide those of query"
        if not enable_gqa and (h_k != h_q or h_v != h_q):
            return _TORCH, "head counts that differ with enable_gqa=False (broadcast)"
        if h_k != h_v:
            return _MATH, "key and value with different head counts"
    elif enable_gqa:
        return _TORCH, "enable_gqa=True with 2-d inputs"
    if attn_mask is not None and attn_mask.dtype != torch.bool and _differentiable(attn_mask):
        return _MATH, "a float attn_mask that requires grad or carries a tangent (its derivative is computed in math)"
    if dropout_p > 0:
        return _MATH, "dropout_p > 0 is not supported by flashjvp's kernels"
    if query.dtype not in KERNEL_DTYPES:
        return _MATH, f"dtype {query.dtype} is not supported by flashjvp's kernels"
    if query.shape[-1] > MAX_HEAD_DIM or value.shape[-1] > MAX_HEAD_DIM:
        return _MATH, f"head dims over {MAX_HEAD_DIM} are not supported by flashjvp's kernels"
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return _MATH, "a scale that is not positive and finite is not supported by flashjvp's kernels"
    return None


def _differentiable(mask: torch.Tensor) -> bool:
    """Whether ``mask`` takes part in reverse or forward mode AD (``torch.func`` wraps it). Dynamo
    traces no ``torch.func`` wrapper (and cannot trace the query for one): while compiling, the
    other two tests decide."""
    if mask.requires_grad or fwAD.unpack_dual(mask).tangent is not None:
        return True
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(mask)


def _mask_bhnd(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``mask`` (broadcastable to (..., Hq, L, S)) as a (prod(batch), Hq, L, S) view that repeats
    along broadcast dims (no copy for inputs of up to 4 dims). ``flashjvp.attention`` unwraps it
    from ``torch.func``'s wrappers (a boolean or constant mask has no derivative to keep)."""
    target = (*query.shape[:-1], key.shape[-2])
    m = mask.expand(target)
    return _to_bhnd(m) if m.dim() <= 4 else m.reshape(-1, *target[-3:])


def _to_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(L, E) -> (1, 1, L, E); (H, L, E) -> (1, H, L, E); (*batch, H, L, E) -> (prod(batch), H, L, E)."""
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    return x.reshape(-1, *x.shape[-3:])


def _safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim giving zeros (not NaN) for rows that are all ``-inf``."""
    if hasattr(torch, "_safe_softmax"):
        return torch._safe_softmax(x, -1)
    dead = torch.isneginf(x).all(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(dead, torch.zeros_like(x), x), dim=-1)
    return torch.where(dead, torch.zeros_like(p), p)


def _math_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    """PyTorch's math SDPA backend in plain ``torch`` ops, so that forward-mode AD, ``vmap`` and
    backward all work. Arguments, shapes and result as in :func:`sdpa`; the arguments must be
    valid for SDPA (:func:`sdpa` sends invalid ones to PyTorch's SDPA, which raises).

    Mirrors ATen's ``_scaled_dot_product_attention_math``: float16/bfloat16 are computed in
    float32 unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``, the scale is
    split as ``sqrt(|scale|)`` onto query and key, a bool mask keeps the ``True`` positions, a float
    mask is added, rows that see no key give zeros, and dropout is ``torch.dropout`` on the
    attention weights (so it draws the same random numbers as PyTorch's math backend).
    """
    dtype = query.dtype
    acc = dtype
    if dtype in (torch.float16, torch.bfloat16) and \
            not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        acc = torch.float32
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if enable_gqa and q.dim() >= 3:
        if k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        if v.shape[-3] != q.shape[-3]:
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    root = math.sqrt(abs(s))
    attn = torch.matmul(q * (-root if s < 0 else root), k.transpose(-2, -1) * root)
    if is_causal:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        attn_mask = visible
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
            attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
        attn = attn + attn_mask
    attn = _safe_softmax(attn)
    if dropout_p > 0:
        attn = torch.dropout(attn, dropout_p, True)
    return torch.matmul(attn, v).to(dtype)


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by flashjvp's kernels.

    Arguments:
        query: (..., Hq, L, E) — any number of leading batch dims (at least 2-d in all).
        key: (..., Hkv, S, E), same leading dims, dtype and device as query.
        value: (..., Hkv, S, Ev).
        attn_mask: ``None``, or a bool (``True`` = attend) or float (added to the scores) tensor
            broadcastable to (..., Hq, L, S), read tile by tile by the kernels (never expanded
            in memory). A float mask that requires grad or carries a forward tangent is served
            by the math fallback, which computes its derivative.
        dropout_p: dropout on the attention weights, applied whenever ``> 0`` (as SDPA does, in
            eval mode too). Served by the math fallback.
        is_causal: top-left causal mask: query ``i`` sees keys ``j <= i``.
        scale: softmax scale, default ``E ** -0.5``.
        enable_gqa: allow ``Hq % Hkv == 0`` (query head ``h`` uses kv head ``h // (Hq // Hkv)``);
            with ``False`` the head counts must be equal.

    Returns:
        out: (..., Hq, L, Ev), dtype of query.

    The kernels serve float16/bfloat16/float32 inputs without dropout, with
    ``E, Ev <= 256`` and a positive scale; such calls work under ``torch.func.jvp`` and
    ``forward_ad`` (fused forward + tangent) and backward (Triton). Other valid calls run
    PyTorch's math backend in plain ops, correct under the same transforms; calls SDPA rejects
    raise SDPA's own error. Both fallbacks warn once per call site (:class:`SDPAFallbackWarning`).
    """
    if attn_mask is None and type(dropout_p) in (int, float) and dropout_p == 0:  # plain calls: a cached plan
        plan = plain_plan(query, key, value, is_causal, scale, "bhnd",
                          lambda: _plan_args(query, key, value, is_causal, scale, enable_gqa), tag=enable_gqa,
                          contiguous=False)
        if plan is not None and (out := plan(query, key, value)) is not None:
            return out
        if type(query) is torch.Tensor and query.dim() == 4:  # transforms, forward AD: checks kept per signature
            a = checked_args(lambda: ("sdpa", signature(query, key, value), is_causal, scale, enable_gqa),
                             lambda: _plan_args(query, key, value, is_causal, scale, enable_gqa))
            if a is not None:
                return _attention(query, key, value, a)
    route = _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if route is None:
        mask = None if attn_mask is None else _mask_bhnd(attn_mask, query, key)
        q, k, v = _to_bhnd(query), _to_bhnd(key), _to_bhnd(value)
        a = check_inputs(q, k, v, causal=is_causal, scale=scale, allow_float64=False, attn_mask=mask)
        out = _attention(q, k, v, dataclasses.replace(a, out_like_q=True))  # out in query's order, as SDPA's
        return out.reshape(*query.shape[:-1], value.shape[-1])
    return _fallback(*route, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _plan_args(query, key, value, is_causal, scale, enable_gqa):
    """The ``AttnArgs`` of a 4-d call without mask and dropout that the kernels serve as it is (for
    ``_plan.plain_plan``), else None."""
    if query.dim() != 4 or _route(query, key, value, None, 0.0, is_causal, scale, enable_gqa) is not None:
        return None
    a = check_inputs(query, key, value, causal=is_causal, scale=scale, allow_float64=False)
    return dataclasses.replace(a, out_like_q=True)


# Outside any compiled graph: it warns (reading the caller's frame) and guards against its own
# SDPA call coming back through patch_sdpa's mode (a context variable), neither of which Dynamo
# traces; under torch.compile a call that falls back breaks the graph here, the kernel path not.
@torch.compiler.disable
def _fallback(path, reason, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    token = _inside_sdpa.set(True)
    try:
        if path == _MATH:
            _warn_once(f"{reason}; using PyTorch's math attention (plain torch ops)")
            return _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        out = _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        _warn_once(f"{reason}; calling torch.nn.functional.scaled_dot_product_attention itself "
                   f"(its fused backends have no forward-mode AD)")
        return out
    finally:
        _inside_sdpa.reset(token)


class _SDPAMode(TorchFunctionMode):
    """Sends ``scaled_dot_product_attention`` to :func:`sdpa`; every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Dynamo cannot read a ContextVar (a graph break at every call); in a graph the guard is not
        # needed: the fallbacks, which set it, run outside any graph (torch.compiler.disable).
        if func is _torch_sdpa and (torch.compiler.is_compiling() or not _inside_sdpa.get()):
            return sdpa(*args, **kwargs)
        if _is_python_functional(func):
            # Dynamo mistraces the redispatch inside a re-entered mode (a compiled DiT failed with
            # "to() received ... dtype=torch.Size"); the rebound copy traces as plain Python.
            if _redispatch is not None and not torch.compiler.is_compiling():
                with self:  # stay on for the calls inside, e.g. F.multi_head_attention_forward's SDPA
                    return _redispatch(func, types, args, kwargs)
            return _with_sdpa_rebound(func)(*args, **kwargs)
        return func(*args, **kwargs)


class _PatchSDPA(contextlib.ContextDecorator):
    """Context manager/decorator pushing one :class:`_SDPAMode` per entry (per thread, since
    PyTorch's mode stack is thread-local), so nesting and re-entry are safe."""

    def __init__(self):
        self._local = threading.local()

    def __enter__(self):
        stack = self._local.__dict__.setdefault("modes", [])
        mode = _SDPAMode()
        mode.__enter__()
        stack.append(mode)
        return self

    def __exit__(self, exc_type, exc, tb):
        self._local.modes.pop().__exit__(exc_type, exc, tb)
        return False


def patch_sdpa(fn=None):
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to :func:`sdpa` inside a block.

    Use as ``with patch_sdpa(): ...``, ``@patch_sdpa()`` or ``@patch_sdpa``. Inside, every call of
    PyTorch's SDPA on this thread — ``F.scaled_dot_product_attention``, ``torch._C._nn`` or a
    name bound by ``from torch.nn.functional import scaled_dot_product_attention`` — runs
    :func:`sdpa`, which needs no change to the model. It is a ``torch.overrides.TorchFunctionMode``:
    nothing is rebound, nothing changes outside the block, and nested or re-entrant use is safe.
    """
    cm = _PatchSDPA()
    if fn is None:
        return cm
    if not callable(fn):
        raise TypeError(f"patch_sdpa: expected a callable or no argument, got {type(fn).__name__}")
    return cm(fn)
