"""The eager host path of plain calls: one dictionary lookup from a call's signature to what runs.

A *plain* call is one that no tangent can reach: no forward-AD level is open (``torch.func.jvp``
opens one too), no ``torch.func`` transform is active and Dynamo is not tracing. Such a call of
:func:`flashjvp.attention` or :func:`flashjvp.sdpa` is served from a plan cached by its signature
(sizes, strides, dtypes, devices, options, whether a backward can follow, 16-byte alignment and
the switches that choose a path), made once by the checked path: a repeated call skips the
argument checks, the routing and the launch arguments.

A plan runs one of

* with ``FLASHJVP_CUDNN=auto`` (the default), where PyTorch's SDPA expresses the call as it is:
  the fused backend PyTorch's own dispatcher picks for it (``torch._fused_sdp_choice``, which
  honours ``sdpa_kernel`` and the ``torch.backends.cuda.enable_*_sdp`` switches). Its flash
  attention operator is called directly; where PyTorch picks cuDNN, the cuDNN plan below serves
  the call if ``_cudnn.use_cudnn`` takes it; where it picks neither, Triton. A plain call so costs
  what the same call of ``F.scaled_dot_product_attention`` costs, kernel for kernel.
* PyTorch's cuDNN attention operator, called directly, where ``_cudnn.use_cudnn`` takes the call
  in both directions. PyTorch records the backward of either operator natively
  (``ScaledDotProductCudnnAttentionBackward0``, ``ScaledDotProductFlashAttentionBackward0``), so
  neither direction has an ``autograd.Function`` in Python; without a backward to follow, cuDNN's
  inference kernel runs (no log-sum-exp).
* flashjvp's Triton forward with the call's ``AttnArgs`` already built (``_fwd.attn_fwd``, itself
  with a launch plan), through ``AttentionFunction`` when a backward can follow.

``attention`` gets ``o`` contiguous in the call's layout (its contract; a copy where PyTorch's
operator returns other strides); ``sdpa`` gets ``o`` with the strides PyTorch's operator gives it,
as ``F.scaled_dot_product_attention`` does.

Calls with tangents, masks, key padding, windows or packed batches take the checked path.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.attention import SDPBackend

from flashjvp import _cudnn
from flashjvp._autograd import AttentionFunction
from flashjvp._cudnn import (
    CUDNN_DTYPES,
    contiguous_strides,
    cudnn_ops,
    matching_layout_strides,
    no_other_option,
    refuse,
    use_cudnn,
)
from flashjvp._fwd import attn_fwd
from flashjvp._launch import LaunchLog, PlanCache, aligned16, allow_tf32, c_getter, out_shape, record_launch
from flashjvp._policy import cudnn_mode, env
from flashjvp._validate import AttnArgs, bhnd_view

_peek_transform = torch._C._functorch.peek_interpreter_stack
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLANS = PlanCache()
_NO_PLAN = object()  # a signature the checked path must serve every time (cached refusal)


# The SDPA backend switches a plain call reads on every call, through their C getters.
_CUDNN_SDP = c_getter("_get_cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled)
_FLASH_SDP = c_getter("_get_flash_sdp_enabled", torch.backends.cuda.flash_sdp_enabled)
_MEM_EFF_SDP = c_getter("_get_mem_efficient_sdp_enabled", torch.backends.cuda.mem_efficient_sdp_enabled)


def _switches() -> tuple:
    """Everything besides the tensors that can change which path a plain call takes."""
    return (cudnn_mode(), _CUDNN_SDP(), _FLASH_SDP(), _MEM_EFF_SDP(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), env("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", ""),
            allow_tf32())


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
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, causal, scale, layout, tag, contiguous, grad, aligned16(q, k, v),
               _switches())
        plan = _PLANS.get(key)
    except (TypeError, RuntimeError):  # unhashable options, or tensors without strides
        return None
    if plan is None:
        a = make_args()
        plan = _NO_PLAN if a is None else _make_plan(q, k, v, a, grad, contiguous)
        _PLANS.put(key, plan)
    return None if plan is _NO_PLAN else plan


def _make_plan(q, k, v, a: AttnArgs, grad: bool, contiguous: bool):
    if a.kv_lens is not None or a.window is not None or a.mask is not None or a.varlen is not None:
        return _NO_PLAN
    if not q.is_cuda:  # the CPU paths (math reference, interpreter) gain nothing from a plan
        return _NO_PLAN
    choice = _torch_choice(q, k, v, a) if cudnn_mode() == "auto" else None
    if choice == SDPBackend.FLASH_ATTENTION:
        return _flash_plan(q, a, grad, contiguous)
    if choice in (None, SDPBackend.CUDNN_ATTENTION) and cudnn_ops() is not None \
            and use_cudnn(q, k, v, a, backward=False) and (not grad or use_cudnn(q, k, v, a, backward=True)):
        return _cudnn_plan(q, a, grad, contiguous)
    if grad:
        return lambda q, k, v: AttentionFunction.apply(q, k, v, a, False)[0]
    return lambda q, k, v: attn_fwd(q, k, v, None, None, None, a, need_lse=False)[0]


def _torch_choice(q, k, v, a: AttnArgs):
    """The backend ``F.scaled_dot_product_attention`` would run for this call (an ``SDPBackend``),
    or None where SDPA does not express the call as it is (GQA, Dqk != Dv, bottom-right causal
    with Nq != Nk, an option SDPA lacks, not half precision) or its operators would not take the
    tensors as they are (a head dim SDPA pads, unaligned pointers or strides)."""
    if q.dtype not in CUDNN_DTYPES or a.h_q != a.h_kv or a.d_qk != a.d_v or a.d_qk % 8 or not no_other_option(a) \
            or (a.causal == "bottom_right" and a.n_q != a.n_k):
        return None
    if not (_cudnn.strides_ok(q) and _cudnn.strides_ok(k) and _cudnn.strides_ok(v)):
        return None
    qb, kb, vb = bhnd_view(q, a.layout), bhnd_view(k, a.layout), bhnd_view(v, a.layout)
    return SDPBackend(torch._fused_sdp_choice(qb, kb, vb, None, 0.0, a.causal is not None, scale=a.scale))


def _direct(op):
    """The C++ callable behind an ``OpOverload`` (what its ``__call__`` forwards to), else the
    overload itself: a plan calls it without the Python frame in between, as SDPA does in C++."""
    return getattr(op, "_op", op)


def _output(o, a: AttnArgs, contiguous: bool):
    """``o`` of a PyTorch operator, (B, H, N, D), in the call's layout, contiguous if asked."""
    o = bhnd_view(o, a.layout)
    return o.contiguous() if contiguous else o


def _flash_plan(q, a: AttnArgs, grad: bool, contiguous: bool):
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
    (None if cuDNN refuses it: the caller then takes its checked path, which from then on avoids
    cuDNN for the shape class); PyTorch's autograd records the backward. ``o`` comes back
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
            _PLANS.clear()
            return None
        if flip:
            o = o.transpose(1, 2)
        if copy:
            o = o.contiguous()
        if LaunchLog._active:
            record_launch("cudnn_sdpa_fwd", {}, CAUSAL=causal, LAYOUT=layout, LSE=grad)
        return o

    return run
