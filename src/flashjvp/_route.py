"""Which backend serves a call: one pure rule, :func:`choose`, from a call's description to its route.

Every call of ``attention``, ``attention_jvp``, ``sdpa`` and the compiled-graph operators is routed
here, once per call signature (``_backends.route_of`` keeps the result in the one plan cache,
``_launch.PLANS``); nothing below decides again. A plain call traced by Dynamo is routed on its size
predicates (:data:`SIZE_PREDICATES`, :func:`representative`). The rule reads only three frozen
descriptions, so a test can state any case without a GPU:

* :class:`Call`: sizes, dtype, causal alignment, the masking options present, whether PyTorch's
  kernels can address q, k and v as they are (unit-stride head dim, 16-byte aligned pointers and
  strides), whether tangents come in and whether a backward can follow. Output contracts (``o`` in
  q's order of dimensions, contiguous, ...) are not part of it: they never change the kernel.
* :class:`Device`: the device kind, compute capability, cuDNN version, whether PyTorch's cuDNN
  attention operators exist with the schemas ``_cudnn`` calls, whether Triton's CPU interpreter
  runs the kernels.
* :class:`Switches`: ``FLASHJVP_CUDNN``, PyTorch's SDPA backend switches and priority order,
  deterministic mode, ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE``, and the shape classes where cuDNN
  failed at run time before.

The result is a :class:`Route`: the backend of the forward (``cudnn``, ``flash``: PyTorch's
flash-attention operator, ``triton``: flashjvp's kernels, ``ref``: the math reference in torch ops)
and of the backward (``None`` where none can follow). The policy, in order:

1. Not on a GPU: the kernels in Triton's interpreter, else the math reference.
2. Tangents: the fused forward+JVP kernel (only flashjvp has one); the backward as in 4.
3. ``FLASHJVP_CUDNN=never``: Triton; ``always``: cuDNN wherever it supports the call.
4. ``auto`` (default): where ``F.scaled_dot_product_attention`` expresses the call as it is, the
   backend PyTorch's SDPA would pick (:func:`torch_choice`) when that is cuDNN or flash attention:
   flashjvp.sdpa then runs what PyTorch runs, kernel for kernel; Triton where PyTorch would pick
   its memory-efficient or math backend (the SDPA switches and priority are the user's word).
   Where SDPA does not express the call (GQA, say): cuDNN where it supports the call and
   :data:`CUDNN_FASTER` lists it faster than flashjvp's Triton kernels, else Triton.

:func:`describe` builds the three descriptions of a live call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashjvp._launch import c_getter
from flashjvp._policy import cudnn_mode, env, interpreting

__all__ = ["Call", "Device", "Switches", "Route", "choose", "torch_choice", "cudnn_supports", "describe"]

CUDNN, FLASH, TRITON, REF = "cudnn", "flash", "triton", "ref"
HALF = (torch.float16, torch.bfloat16)

# Options that only flashjvp's kernels implement: any of them sends the call to Triton.
OPTIONS = frozenset({"mask", "kv_lens", "window", "varlen", "block_mask"})


@dataclass(frozen=True)
class Call:
    """What a call is, as far as routing goes (no tensors)."""

    dtype: torch.dtype
    batch: int
    h_q: int
    h_kv: int
    n_q: int
    n_k: int
    d_qk: int
    d_v: int
    causal: str | None = None  # None, "top_left" or "bottom_right"
    options: frozenset = frozenset()  # a subset of OPTIONS
    addressable: bool = True  # q, k, v as PyTorch's fused kernels take them (_cudnn.strides_ok)
    tangents: bool = False  # forward tangents come in (the fused forward+JVP kernel)
    grad: bool = False  # a backward can follow
    # flashjvp's autograd runs the backward (an autograd.Function, a compiled-graph operator): PyTorch's
    # flash operator, whose backward only PyTorch's autograd records, cannot serve the call
    own_backward: bool = False


@dataclass(frozen=True)
class Device:
    """The device a call runs on."""

    type: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    cudnn_version: int = 91900  # torch.backends.cudnn.version(); 0 where none is loaded
    cudnn_ops: bool = True  # aten's cuDNN attention operators with the schemas _cudnn calls
    interpreting: bool = False  # Triton's CPU interpreter runs the kernels on CPU tensors


# PyTorch's default order of SDPA backends (torch 2.5 through 2.13); cuDNN first where PyTorch
# prefers it (see torch_choice).
DEFAULT_PRIORITY = ("flash", "efficient", "math", "cudnn")


@dataclass(frozen=True)
class Switches:
    """Process-wide switches that change a decision."""

    mode: str = "auto"  # FLASHJVP_CUDNN: "auto", "always" or "never"
    cudnn_sdp: bool = True  # torch.backends.cuda.cudnn_sdp_enabled()
    flash_sdp: bool = True
    efficient_sdp: bool = True
    math_sdp: bool = True
    priority: tuple[str, ...] = DEFAULT_PRIORITY  # PyTorch's SDPA priority order
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED
    deterministic: bool = False  # torch.use_deterministic_algorithms(True), not warn-only
    avoid_recompile: bool = False  # TORCH_CUDNN_SDPA_AVOID_RECOMPILE
    refused: frozenset = frozenset()  # "fwd" / "bwd": cuDNN failed at run time for this shape class


@dataclass(frozen=True)
class Route:
    """The backends of a call's forward and backward (None: no backward can follow), and why."""

    fwd: str
    bwd: str | None
    why: str


# --------------------------------------------------------------------------- cuDNN's support

# Compute capabilities (major) where flashjvp sends work to cuDNN: Hopper, where it was tested and
# measured. PyTorch itself accepts sm80 to sm121; widen after testing there.
CUDNN_ARCHS = (9,)
# Head dims: Dqk == Dv, a multiple of 8 up to 128, or 256 on sm90 with cuDNN >= 9.10 (PyTorch's own
# check: flashjvp sends cuDNN what PyTorch's SDPA would).
CUDNN_HEAD_DIM_STEP = 8
CUDNN_MAX_HEAD_DIM = 128
MAX_BATCH_HEADS = 65535  # cuDNN SDPA's limit on batch size and head count (PyTorch's check)


def cudnn_max_head_dim(dev: Device) -> int:
    return 256 if dev.capability[0] == 9 and dev.cudnn_version >= 91000 else CUDNN_MAX_HEAD_DIM


def cudnn_supports(call: Call, dev: Device, sw: Switches, *, backward: bool) -> bool:
    """Whether PyTorch's cuDNN attention operator, called directly by ``_cudnn``, takes the call:
    an sm90 GPU with cuDNN >= 9, float16 / bfloat16, Dqk == Dv a multiple of 8 up to
    :func:`cudnn_max_head_dim`, none of
    flashjvp's own options, causal ``None`` or top-left (bottom-right only when Nq == Nk, where
    both coincide), Nk >= 2, GQA allowed, tensors it can address, no earlier run-time refusal of
    the shape class. ``backward``: also not in deterministic mode (cuDNN's backward is not
    deterministic)."""
    if dev.type != "cuda" or dev.capability[0] not in CUDNN_ARCHS or dev.cudnn_version < 90000 or not dev.cudnn_ops:
        return False
    if call.dtype not in HALF or call.options or not call.addressable or sw.avoid_recompile:
        return False
    if call.d_qk != call.d_v or call.d_qk % CUDNN_HEAD_DIM_STEP or call.d_qk > cudnn_max_head_dim(dev):
        return False
    if call.causal == "bottom_right" and call.n_q != call.n_k:
        return False
    if call.n_k < 2 or call.batch > MAX_BATCH_HEADS or call.h_q > MAX_BATCH_HEADS:
        return False
    if backward and sw.deterministic:
        return False
    return ("bwd" if backward else "fwd") not in sw.refused


@dataclass(frozen=True)
class Faster:
    """One row of the ``auto`` policy: calls matching every field measured faster on cuDNN than on
    flashjvp's Triton kernels."""

    directions: tuple[str, ...] = ("fwd", "bwd")
    dtypes: tuple[torch.dtype, ...] = HALF
    head_dims: tuple[int, ...] = (64, 128)
    min_n_q: int = 4096
    min_n_k: int = 4096
    causal: tuple[str | None, ...] = (None, "top_left", "bottom_right")
    gqa: bool = True  # also when Hq != Hkv

    def matches(self, call: Call, backward: bool) -> bool:
        return (("bwd" if backward else "fwd") in self.directions and call.dtype in self.dtypes
                and call.d_qk in self.head_dims and call.n_q >= self.min_n_q and call.n_k >= self.min_n_k
                and call.causal in self.causal and (self.gqa or call.h_q == call.h_kv))


# Where cuDNN takes the plain forward and backward that PyTorch's SDPA would not serve with cuDNN
# itself (GQA, say). Measured in bf16 (benchmarks/results/*/dispatch_table.md and dispatch.md): at
# head dim 64 from 256 to 8192 tokens cuDNN's forward and backward are faster than flashjvp's
# Triton kernels but for one backward (N1024 causal), at D64/D128 from 4096 tokens both directions
# are; other head dims follow PyTorch's own choice of cuDNN on Hopper. Re-measure with
# `python benchmarks/dispatch_table.py`.
CUDNN_FASTER: tuple[Faster, ...] = (Faster(head_dims=tuple(range(8, CUDNN_MAX_HEAD_DIM + 1, 8)), min_n_q=1, min_n_k=2),)


def listed_faster(call: Call, *, backward: bool) -> bool:
    return any(row.matches(call, backward) for row in CUDNN_FASTER)


# --------------------------------------------------------------------------- PyTorch's own choice


def sdpa_expresses(call: Call) -> bool:
    """Whether ``F.scaled_dot_product_attention`` computes this call as it is: no flashjvp option,
    no tangent, equal head counts (GQA is left to flashjvp's own rule), Dqk == Dv, causal top-left
    or Nq == Nk, q, k and v addressable by the fused kernels."""
    return (not call.options and not call.tangents and call.h_q == call.h_kv and call.d_qk == call.d_v
            and call.addressable and (call.causal != "bottom_right" or call.n_q == call.n_k))


def _prefers_cudnn(dev: Device, sw: Switches) -> bool:
    """PyTorch's ``check_prefer_cudnn_attention`` (2.11, 2.13): cuDNN first on sm90, sm100 and sm103
    with cuDNN newer than 9.15, unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set."""
    major, minor = dev.capability
    return major in (9, 10) and minor in (0, 3) and dev.cudnn_version > 91500 and not sw.cudnn_deprioritized


def _flash_takes(call: Call, dev: Device, sw: Switches) -> bool:
    """PyTorch's ``can_use_flash_attention`` for dense half-precision inputs without mask or dropout:
    sm80 to sm121, Dqk == Dv up to 256 (SDPA pads it to a multiple of 8 itself), no causal mask
    with Nq != Nk, and on sm86-89 and sm120-121 no backward for head dims from 193 to 224."""
    if not (sw.flash_sdp and (8, 0) <= dev.capability <= (12, 1) and call.dtype in HALF and call.d_qk <= 256):
        return False
    if call.causal is not None and call.n_q != call.n_k:
        return False
    consumer = (8, 6) <= dev.capability <= (8, 9) or dev.capability >= (12, 0)
    return not (call.grad and consumer and 192 < call.d_qk <= 224)


def _cudnn_sdpa_takes(call: Call, dev: Device, sw: Switches) -> bool:
    """PyTorch's ``can_use_cudnn_attention`` for the same inputs: sm80 to sm121 with cuDNN >= 9,
    head dims multiples of 8 up to :func:`cudnn_max_head_dim`, Nk >= 2, batch and heads up to
    65535, not in deterministic mode (forward or backward)."""
    return (sw.cudnn_sdp and (8, 0) <= dev.capability <= (12, 1) and dev.cudnn_version >= 90000
            and call.dtype in HALF and call.d_qk % 8 == 0 and call.d_v % 8 == 0
            and max(call.d_qk, call.d_v) <= cudnn_max_head_dim(dev) and call.n_k >= 2
            and call.batch <= MAX_BATCH_HEADS and call.h_q <= MAX_BATCH_HEADS and not sw.deterministic)


def _efficient_takes(call: Call, dev: Device, sw: Switches) -> bool:
    """PyTorch's ``can_use_mem_efficient_attention``, in short: head dims multiples of the GEMM
    alignment (8 in half precision, 4 in float32 on sm80+)."""
    align = 8 if call.dtype in HALF else 4
    return sw.efficient_sdp and dev.capability >= (5, 0) and call.d_qk % align == 0 and call.d_v % align == 0


def torch_choice(call: Call, dev: Device, sw: Switches) -> str | None:
    """The backend ``F.scaled_dot_product_attention`` would run for this call on ``dev``: ``"cudnn"``,
    ``"flash"``, ``"efficient"`` or ``"math"``; None where it does not express the call as it is
    (:func:`sdpa_expresses`) or the device is not a GPU."""
    if dev.type != "cuda" or not sdpa_expresses(call):
        return None
    order = sw.priority
    if order == DEFAULT_PRIORITY and _prefers_cudnn(dev, sw):  # what PyTorch sets on its first SDPA call
        order = ("cudnn", "flash", "efficient", "math")
    takes = {"cudnn": _cudnn_sdpa_takes, "flash": _flash_takes, "efficient": _efficient_takes,
             "math": lambda call, dev, sw: sw.math_sdp}
    for backend in order:
        if takes[backend](call, dev, sw):
            return backend
    return None


# --------------------------------------------------------------------------- the rule


def _backward(call: Call, dev: Device, sw: Switches) -> str | None:
    """The backend of a backward that flashjvp runs itself (after a Triton or cuDNN forward, or the
    fused forward+JVP kernel's ``o``): cuDNN per the mode and the table, else Triton."""
    if not call.grad:
        return None
    if sw.mode == "never" or not cudnn_supports(call, dev, sw, backward=True):
        return TRITON
    if sw.mode == "always" or (sw.cudnn_sdp and listed_faster(call, backward=True)):
        return CUDNN
    return TRITON


def choose(call: Call, dev: Device, sw: Switches) -> Route:
    """The route of ``call``: see the module docstring for the rule."""
    if dev.type != "cuda":
        if dev.interpreting:
            return Route(TRITON, TRITON if call.grad else None, "CPU tensors, Triton's interpreter")
        return Route(REF, REF if call.grad else None, "CPU tensors: the math reference")
    if call.tangents:
        return Route(TRITON, _backward(call, dev, sw), "tangents: the fused forward+JVP kernel")
    if sw.mode == "never":
        return Route(TRITON, TRITON if call.grad else None, "FLASHJVP_CUDNN=never")
    if sw.mode == "always":
        fwd = CUDNN if cudnn_supports(call, dev, sw, backward=False) else TRITON
        return Route(fwd, _backward(call, dev, sw), "FLASHJVP_CUDNN=always")
    picked = torch_choice(call, dev, sw)
    if picked == FLASH and not call.own_backward and call.d_qk % 8 == 0:  # the operator wants SDPA's padding
        return Route(FLASH, FLASH if call.grad else None, "PyTorch's SDPA picks flash attention")
    if picked == CUDNN:
        if not cudnn_supports(call, dev, sw, backward=False):  # e.g. a shape class cuDNN failed on before
            return Route(TRITON, _backward(call, dev, sw), "PyTorch's SDPA picks cuDNN, which refuses the call")
        bwd = CUDNN if cudnn_supports(call, dev, sw, backward=True) else TRITON
        return Route(CUDNN, bwd if call.grad else None, "PyTorch's SDPA picks cuDNN")
    if picked is None and sw.cudnn_sdp and cudnn_supports(call, dev, sw, backward=False) \
            and listed_faster(call, backward=False):
        return Route(CUDNN, _backward(call, dev, sw), "not an SDPA call; cuDNN listed faster")
    if picked is None:
        return Route(TRITON, _backward(call, dev, sw), "flashjvp's kernels")
    return Route(TRITON, TRITON if call.grad else None, f"PyTorch's SDPA would pick {picked}")


# --------------------------------------------------------------------------- traced calls

# What the rule reads of a call's sizes, as predicates of its ``AttnArgs``: a call Dynamo traces
# may have symbolic sizes, so a compiled graph routes on these (each a guard) and
# :func:`representative` builds a call with the same answers.
SIZE_PREDICATES = (
    lambda a: a.n_k >= 2,
    lambda a: a.n_q == a.n_k,
    lambda a: a.batch <= MAX_BATCH_HEADS and a.h_q <= MAX_BATCH_HEADS,
    lambda a: a.h_q == a.h_kv,
    lambda a: a.d_qk == a.d_v,
    lambda a: a.d_qk % 8 == 0,
    lambda a: a.d_qk <= 128,
    lambda a: a.d_qk <= 192,
    lambda a: a.d_qk <= 224,
    lambda a: a.d_qk <= 256,
)


def representative(dtype: torch.dtype, causal: str | None, options: frozenset, sizes: tuple, addressable: bool,
                   grad: bool) -> Call:
    """A plain call whose sizes answer :data:`SIZE_PREDICATES` as ``sizes`` does: the rule reads no
    more of them, so it routes this call as the traced one (tests/test_route.py checks it)."""
    keys, square, small, heads, dims, mult8, le128, le192, le224, le256 = sizes
    n_k = 2 if keys else 1
    h = 1 if small else MAX_BATCH_HEADS + 1
    d = (128 if le128 else 192 if le192 else 224 if le224 else 256 if le256 else 264) if mult8 else \
        (100 if le128 else 190 if le192 else 220 if le224 else 250 if le256 else 260)
    return Call(dtype, h, h, h if heads else h + 1, n_k if square else n_k + 1, n_k, d, d if dims else d + 8,
                causal, options, addressable, False, grad)


# --------------------------------------------------------------------------- live descriptions


@functools.cache
def _cuda_device(index: int) -> Device:
    ops = _cudnn_ops_ok()
    version = (torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0
    return Device("cuda", tuple(torch.cuda.get_device_capability(index)), version, ops, False)


@functools.cache
def _cudnn_ops_ok() -> bool:
    from flashjvp._cudnn import cudnn_ops

    return cudnn_ops() is not None


def device_of(device: torch.device) -> Device:
    if device.type == "cuda":
        return _cuda_device(device.index if device.index is not None else torch.cuda.current_device())
    return Device(device.type, (0, 0), 0, False, device.type == "cpu" and interpreting())


_CUDNN_SDP = c_getter("_get_cudnn_sdp_enabled", torch.backends.cuda.cudnn_sdp_enabled)
_FLASH_SDP = c_getter("_get_flash_sdp_enabled", torch.backends.cuda.flash_sdp_enabled)
_EFFICIENT_SDP = c_getter("_get_mem_efficient_sdp_enabled", torch.backends.cuda.mem_efficient_sdp_enabled)
_MATH_SDP = c_getter("_get_math_sdp_enabled", torch.backends.cuda.math_sdp_enabled)
_PRIORITY = getattr(torch._C, "_get_sdp_priority_order", None)
_PRIORITY_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def _priority_names(raw: tuple) -> tuple[str, ...]:
    order = tuple(_PRIORITY_NAMES.get(int(b), str(b)) for b in raw)
    return tuple(b for b in order if b != "overrideable") or DEFAULT_PRIORITY


def switch_values() -> tuple:
    """The raw switches, read on every call (C getters where PyTorch has them): a plan key holds
    them, :func:`switches` turns them into a :class:`Switches`."""
    return (cudnn_mode(), _CUDNN_SDP(), _FLASH_SDP(), _EFFICIENT_SDP(), _MATH_SDP(),
            tuple(_PRIORITY()) if _PRIORITY is not None else (),
            torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled(),
            env("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", ""), env("TORCH_CUDNN_SDPA_DEPRIORITIZED", ""))


def switches(values: tuple, refused: frozenset = frozenset()) -> Switches:
    """The :class:`Switches` of :func:`switch_values`'s tuple."""
    mode, cudnn_sdp, flash_sdp, efficient_sdp, math_sdp, priority, deterministic, avoid, deprioritized = values
    return Switches(mode, cudnn_sdp, flash_sdp, efficient_sdp, math_sdp, _priority_names(priority),
                    _env_true(deprioritized), deterministic, _env_true(avoid), refused)


def _env_true(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "off", "no", "n")


def option_names(a) -> tuple[str, ...]:
    """The names (``OPTIONS``) of the masking options ``a`` (an ``AttnArgs``) carries."""
    return tuple(name for name, present in (
        ("mask", a.mask is not None), ("kv_lens", a.kv_lens is not None), ("window", a.window is not None),
        ("varlen", a.varlen is not None), ("block_mask", a.sparse is not None)) if present)


def call_of(a, dtype: torch.dtype, *, addressable: bool, tangents: bool, grad: bool, own_backward: bool) -> Call:
    """The :class:`Call` of validated arguments ``a`` (an ``AttnArgs``). Every field of ``AttnArgs``
    is either read here or listed in ``OUTPUT_FIELDS`` (tests/test_route.py holds the two to it)."""
    options = frozenset(option_names(a))
    causal = a.causal if a.causal is not None or a.window is None else None
    return Call(dtype, a.batch, a.h_q, a.h_kv, a.n_q, a.n_k, a.d_qk, a.d_v, causal, options, addressable,
                tangents, grad, own_backward)


# AttnArgs fields that change what a call returns or how it is laid out, never which kernel runs.
# ``scale`` and ``align`` (the diagonal of a window: routing sees the window itself) are listed too.
ROUTED_FIELDS = ("batch", "h_q", "h_kv", "n_q", "n_k", "d_qk", "d_v", "causal", "kv_lens", "window", "varlen",
                 "mask", "sparse")
OUTPUT_FIELDS = ("scale", "layout", "align", "out_like_q")


def describe(q, k, v, a, *, tangents: bool, grad: bool, own_backward: bool = False, values: tuple | None = None,
             refused: frozenset = frozenset(), readable: bool = True) -> tuple[Call, Device, Switches]:
    """The descriptions of a live call on validated arguments ``a``; ``readable``: the tensors have
    storage whose pointers can be read (not ``torch.func``'s wrappers)."""
    from flashjvp._cudnn import strides_ok

    addressable = readable and q.is_cuda and strides_ok(q) and strides_ok(k) and strides_ok(v)
    call = call_of(a, q.dtype, addressable=addressable, tangents=tangents, grad=grad, own_backward=own_backward)
    return call, device_of(q.device), switches(switch_values() if values is None else values, refused)

