"""Routes of live calls, kept in the one plan cache, and the launchers each backend binds.

:func:`route_of` describes a call (``_route.describe``) and asks ``_route.choose`` once per call
signature; :data:`PLANS` keeps the answer, and the eager plans of ``_plan.py`` live in the same
cache under their own keys. :func:`run_fwd` and :func:`run_bwd` run one direction on the backend a
route names; they do not decide again, except that a cuDNN call which raises at run time (a shape
its heuristics refuse) is remembered for its shape class (``_cudnn.refuse``), the cache is cleared
so that every signature is routed anew, and this call runs Triton.
"""

from __future__ import annotations

import torch

from flashjvp import _cudnn
from flashjvp._bwd import attn_bwd
from flashjvp._fwd import attn_fwd
from flashjvp._launch import PLANS, aligned16
from flashjvp._route import CUDNN, Route, choose, describe, switch_values
from flashjvp._validate import AttnArgs


def _refused(q: torch.Tensor, a: AttnArgs) -> frozenset:
    if not _cudnn._REFUSED:
        return frozenset()
    return frozenset(d for d, backward in (("fwd", False), ("bwd", True))
                     if _cudnn.refusal_key(q, a, backward) in _cudnn._REFUSED)


def route_of(q, k, v, a: AttnArgs, *, tangents: bool = False, grad: bool = False, in_function: bool = False,
             values: tuple | None = None) -> Route:
    """The route of a call on validated arguments ``a``, from :data:`PLANS` after the first call of
    a signature. ``in_function``: flashjvp's autograd runs the backward (an ``autograd.Function``
    or a compiled-graph operator), so PyTorch's flash operator, whose backward PyTorch records
    itself, cannot serve the call. ``values``: ``_route.switch_values()`` when the caller has
    them."""
    values = switch_values() if values is None else values
    try:
        aligned = aligned16(q, k, v)
    except RuntimeError:  # torch.func's wrappers have no storage: routed as tensors PyTorch cannot address
        return choose(*describe(q, k, v, a, tangents=tangents, grad=grad, own_backward=in_function, values=values,
                                readable=False))
    tensors = (a.kv_lens is None, a.mask is None, a.varlen is None, a.sparse is None)
    key = ("route", a, tensors, q.dtype, q.device, q.stride(), k.stride(), v.stride(), aligned, tangents, grad,
           in_function, values)
    route = PLANS.get(key)
    if route is None:
        route = choose(*describe(q, k, v, a, tangents=tangents, grad=grad, own_backward=in_function, values=values,
                                 refused=_refused(q, a)))
        PLANS.put(key, route)
    return route


def refuse(q: torch.Tensor, a: AttnArgs, backward: bool, error: BaseException) -> None:
    """cuDNN raised for this call: remember its shape class, route every signature anew."""
    _cudnn.refuse(q, a, backward, error)
    PLANS.clear()


def run_fwd(q, k, v, a: AttnArgs, backend: str, *, need_lse: bool = True):
    """``attn_fwd``'s ``(o, None, lse, None)`` of a call without tangents on ``backend`` (cuDNN or
    Triton); ``lse`` may be None without ``need_lse``."""
    if backend == CUDNN:
        try:
            o, lse = _cudnn.cudnn_fwd(q, k, v, a, need_lse=need_lse)
            return o, None, lse, None
        except torch.cuda.OutOfMemoryError:
            pass  # not a refusal: Triton needs no workspace, cuDNN is tried again next time
        except RuntimeError as e:
            refuse(q, a, False, e)
    return attn_fwd(q, k, v, None, None, None, a)


def run_bwd(do, q, k, v, o, lse, a: AttnArgs, backend: str):
    """``(dq, dk, dv)`` on ``backend`` (cuDNN or Triton) from any flashjvp forward's ``o`` and
    ``lse`` (the fused forward+JVP kernel's included: the MeanFlow pattern)."""
    if backend == CUDNN and do.dtype == q.dtype and o.dtype == q.dtype and lse.dtype == torch.float32:
        try:
            return _cudnn.cudnn_bwd(do, q, k, v, o, lse, a)
        except torch.cuda.OutOfMemoryError:
            pass
        except RuntimeError as e:
            refuse(q, a, True, e)
    return attn_bwd(do, q, k, v, o, lse, a)
