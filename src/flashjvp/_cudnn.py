"""The plain forward (no tangents) and the plain backward through PyTorch's cuDNN attention.

Where cuDNN supports a case and measured faster, ``attn_fwd`` without tangents and
``attn_bwd`` hand it to ``aten._scaled_dot_product_cudnn_attention`` and its backward, called
directly (not through ``F.scaled_dot_product_attention``, so no backend choice and no autograd
node is involved). Everything else, and every call with tangents, stays on flashjvp's Triton
kernels. The launchers ask :func:`dispatch_fwd` / :func:`dispatch_bwd`, which return the
launcher's own result or ``None`` (run Triton).

``FLASHJVP_CUDNN`` (``_policy.cudnn_mode``, read at each call): ``auto`` (default) uses cuDNN
where :func:`cudnn_supported` holds and a row of :data:`CUDNN_FASTER` lists the case as faster
(eager plain calls that SDPA expresses follow PyTorch's own backend choice first, ``_plan.py``);
``1`` / ``always`` wherever it is supported; ``0`` / ``never`` not at all.

The log-sum-exp, and why flashjvp's saved ``(o, lse)`` can feed cuDNN's backward exactly
---------------------------------------------------------------------------------------
Both sides store the same quantity: for every query row, in float32, the natural-log
``lse_i = log(sum_j exp(scale * q_i . k_j))`` over the keys the row sees (flashjvp:
``_fwd._lse`` converts its base-2 running statistics with ``* ln 2`` before storing; cuDNN's
"Stats" output is ``rowmax + log(rowsum(exp(S - rowmax)))`` of the scaled scores ``S``, natural
log, see cudnn-frontend's reference in ``test/python/test_mhas.py``; PyTorch merges cuDNN's and
flash-attention's LSEs with the same natural-log formulas in its context-parallel ring). Only the
shape differs: PyTorch's cuDNN forward returns (and its backward takes) a float32 (B, H, Nq, 1)
tensor with strides (H*Nq, Nq, 1, 1) (``MHA.cpp``: ``at::empty({b, h, s_q, 1})``; the meta
function in ``torch/_meta_registrations.py``), while flashjvp keeps a contiguous (B, H, Nq)
float32 tensor. The conversion is ``lse.view(B, H, Nq, 1)``: a view of the same memory, no
arithmetic, no rounding, no copy, hence exact bit for bit. (A torch whose cuDNN forward returns
a 3-d LSE gets the 3-d tensor; the rank is read from the forward's meta function,
:func:`stats_rank`.) The backward uses the LSE only to recompute ``P = exp(S - lse)`` and ``o``
only for ``D = rowsum(dO * o)``, so any consistent pair of a forward's ``o`` and ``lse`` gives the
gradients, in particular the fused forward+JVP kernel's (the MeanFlow pattern: gradients through
the ``o`` of ``torch.func.jvp``). Cases that have rows seeing no key (``lse = -inf``: key padding,
bottom-right causal with Nq > Nk) never reach cuDNN.

Layouts and strides
-------------------
q, k, v go to cuDNN as (B, H, N, D) views of either storage order (no copies). PyTorch's cuDNN
forward allocates ``o`` in q's dimension order (``torch.empty_like(q)`` when Dqk == Dv, which is
(B, H, N, D)-contiguous for a q that is not dense, such as a packed ``qkv.unbind(2)`` view);
flashjvp's contract (and the fake tensors of the ``flashjvp::fwd`` operator) is ``o`` contiguous
in the call's layout: the same tensor whenever q is dense in its layout, copied otherwise. The
backward hands cuDNN ``o`` and ``dO`` with the strides cuDNN's own forward would give ``o`` (a
function of q's strides; copies only where they differ): older PyTorch versions cache the
backward graph by q/k/v sizes and strides only, so ``o``, ``dO`` and the LSE of one q layout must
always arrive with one set of strides. Gradients are returned with ``torch.empty_like(input)``'s
strides, as ``attn_bwd``'s are.

When cuDNN raises at run time (a shape its heuristics refuse), the call falls back to Triton and
the refusal is remembered per shape class (:func:`refusal_key`), with one warning.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch

from flashjvp._launch import LaunchLog, matching_layout_strides, out_strides, record_launch
from flashjvp._policy import cudnn_mode, env, length_bucket
from flashjvp._validate import AttnArgs, bhnd_view

__all__ = ["cudnn_fwd", "cudnn_bwd", "cudnn_supported", "use_cudnn", "dispatch_fwd", "dispatch_bwd",
           "CUDNN_FASTER", "Faster"]

# --------------------------------------------------------------------------- the operators

# Argument names, in order, of the schemas this module calls (PyTorch 2.5 through at least 2.13):
#   _scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias,
#       bool compute_log_sumexp, float dropout_p=0., bool is_causal=False,
#       bool return_debug_mask=False, *, float? scale=None)
#     -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_attn_mask)
#   _scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key,
#       Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset,
#       Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
#       float dropout_p, bool is_causal, *, float? scale=None) -> (Tensor, Tensor, Tensor)
# Any other schema (PyTorch 2.4 has no attn_bias / compute_log_sumexp) disables the cuDNN path.
FWD_ARGS = ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
            "return_debug_mask", "scale")
BWD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset",
            "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale")


@functools.cache
def cudnn_ops():
    """``(forward, backward)`` OpOverloads when this PyTorch has them with the schemas above, else None."""
    try:
        fwd = torch.ops.aten._scaled_dot_product_cudnn_attention.default
        bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    except (AttributeError, RuntimeError):
        return None
    names = lambda op: tuple(arg.name for arg in op._schema.arguments)  # noqa: E731
    if names(fwd) != FWD_ARGS or names(bwd) != BWD_ARGS:
        return None
    return fwd, bwd


def _ops():
    ops = cudnn_ops()
    if ops is None:
        raise RuntimeError("flashjvp: this PyTorch has no usable aten._scaled_dot_product_cudnn_attention "
                           f"(expected arguments {FWD_ARGS})")
    return ops


# Rank of the LSE seen from a real cuDNN forward, once one ran (overrides the meta function's).
_SEEN_STATS_RANK: dict[str, int] = {}


def stats_rank() -> int:
    """Rank of the LSE PyTorch's cuDNN forward returns and its backward takes: 4, (B, H, Nq, 1), in
    PyTorch 2.13's meta function and the cuDNN SDPA sources; read from the forward's meta function
    until a real forward ran, then from that forward."""
    return _SEEN_STATS_RANK.get("rank") or _meta_stats_rank()


@functools.cache
def _meta_stats_rank() -> int:
    ops = cudnn_ops()
    if ops is None:
        return 4
    try:
        x = torch.empty(1, 1, 16, 16, device="meta", dtype=torch.float16)
        return ops[0](x, x, x, None, True, 0.0, False, False, scale=1.0)[1].dim()
    except Exception:  # noqa: BLE001 - no meta function: the documented shape
        return 4


_PHILOX: dict = {}


def _philox(device: torch.device) -> torch.Tensor:
    """A 0-d int64 placeholder for the backward's philox seed and offset: read only with dropout,
    which flashjvp never uses (one per device, never written)."""
    t = _PHILOX.get(device)
    if t is None:
        t = _PHILOX[device] = torch.empty((), dtype=torch.int64, device=device)
    return t


# --------------------------------------------------------------------------- strides


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _is_dense(shape, strides) -> bool:
    """Non-overlapping and dense (``TensorImpl::is_non_overlapping_and_dense``): the elements fill
    a block of memory exactly, in some order of the dimensions (size-1 dimensions ignored)."""
    need = 1
    for st, size in sorted((st, size) for size, st in zip(shape, strides) if size != 1):
        if st != need:
            return False
        need *= size
    return True


def empty_like_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of ``torch.empty_like(x)`` (preserve_format), which autograd and the operators'
    fake implementations give the gradients: x's own when x is dense, else dense ones in x's
    order of dimensions (a q sliced out of a packed qkv projection keeps its (B, N, H, D) order)."""
    strides = tuple(x.stride())
    return strides if _is_dense(x.shape, strides) else _empty_like_strides(tuple(x.shape), strides)


@functools.lru_cache(maxsize=256)
def _empty_like_strides(shape: tuple, strides: tuple) -> tuple[int, ...]:
    # PyTorch's own rule (at::infer_dense_strides), run once per signature on a meta tensor.
    return torch.empty_like(torch.empty_strided(shape, strides, device="meta")).stride()


def with_strides(x: torch.Tensor, strides, *, align: bool = False) -> torch.Tensor:
    """``x`` with exactly ``strides``: itself; a view when only the strides of size-1 dimensions
    differ (they address nothing); else a copy. ``align``: also copy when x's data pointer is not
    16-byte aligned."""
    strides = tuple(strides)
    if not (align and x.data_ptr() % 16):
        if tuple(x.stride()) == strides:
            return x
        if all(a == b for size, a, b in zip(x.shape, x.stride(), strides) if size != 1):
            return x.as_strided(x.shape, strides)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


# --------------------------------------------------------------------------- the calls


def cudnn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttnArgs, *, need_lse: bool = True):
    """``(o, lse)`` of attention through PyTorch's cuDNN SDPA: ``o`` with ``attn_fwd``'s strides
    (``_launch.out_strides``), ``lse`` (B, Hq, Nq) float32 contiguous, natural log, or None without
    ``need_lse`` (cuDNN's inference kernel: no backward follows). For cases
    :func:`cudnn_supported` accepts (no check here)."""
    fwd, _ = _ops()
    out = fwd(bhnd_view(q, a.layout), bhnd_view(k, a.layout), bhnd_view(v, a.layout), None, need_lse, 0.0,
              a.causal is not None, False, scale=a.scale)
    o = bhnd_view(out[0], a.layout)  # back to the call's layout
    o = with_strides(o, out_strides(a, q) or contiguous_strides(o.shape))  # a view where cuDNN's are those
    if LaunchLog._active:
        record_launch("cudnn_sdpa_fwd", {}, CAUSAL=a.causal is not None, LAYOUT=a.layout, LSE=need_lse)
    if not need_lse:
        return o, None
    _SEEN_STATS_RANK["rank"] = out[1].dim()
    lse = out[1].reshape(a.batch, a.h_q, a.n_q)  # (B, H, Nq, 1) contiguous: a view
    if not lse.is_contiguous():  # e.g. TORCH_CUDNN_SDPA_AVOID_RECOMPILE's (B, Nq, H) order
        lse = lse.contiguous()
    return o, lse


def cudnn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, a: AttnArgs):
    """``(dq, dk, dv)`` of ``o = attention(q, k, v)`` through PyTorch's cuDNN SDPA backward, from
    any forward's ``o`` and ``lse`` ((B, Hq, Nq) float32, natural log: flashjvp's or cuDNN's; the
    conversion is a view, see the module docstring). Gradients have ``torch.empty_like``'s
    strides of their inputs. For cases :func:`cudnn_supported` accepts (no check here)."""
    _, bwd = _ops()
    qb, kb, vb = bhnd_view(q, a.layout), bhnd_view(k, a.layout), bhnd_view(v, a.layout)
    # o and dO with the strides cuDNN's forward gives o for this q (a function of q's strides)
    o_strides = matching_layout_strides(qb, (a.batch, a.h_q, a.n_q, a.d_v))
    ob = with_strides(bhnd_view(o, a.layout), o_strides, align=True)
    dob = with_strides(bhnd_view(do, a.layout), o_strides, align=True)
    if not lse.is_contiguous():
        lse = lse.contiguous()
    stats = lse.view(a.batch, a.h_q, a.n_q, 1) if stats_rank() == 4 else lse  # exact: a view
    seed = _philox(q.device)
    dq, dk, dv = bwd(dob, qb, kb, vb, ob, stats, seed, seed, None, None, None, a.n_q, a.n_k, 0.0,
                     a.causal is not None, scale=a.scale)
    if LaunchLog._active:
        record_launch("cudnn_sdpa_bwd", {}, CAUSAL=a.causal is not None, LAYOUT=a.layout)
    return tuple(with_strides(bhnd_view(g, a.layout), empty_like_strides(x))
                 for g, x in ((dq, q), (dk, k), (dv, v)))


# --------------------------------------------------------------------------- support


# Compute capabilities (major) where flashjvp sends work to cuDNN: Hopper, where it was tested
# and measured. PyTorch itself accepts sm80 to sm121; widen after testing there.
CUDNN_ARCHS = (9,)
CUDNN_DTYPES = (torch.float16, torch.bfloat16)
# Head dims: Dqk == Dv, a multiple of CUDNN_HEAD_DIM_STEP up to CUDNN_MAX_HEAD_DIM, as PyTorch's
# own cuDNN SDPA check (which goes to 256 on sm90 with cuDNN >= 9.10; flashjvp sends up to 128).
CUDNN_HEAD_DIM_STEP = 8
CUDNN_MAX_HEAD_DIM = 128
_MAX_BATCH_HEADS = 65535  # cuDNN SDPA's limit on batch size and head count (PyTorch's check)
_INT32_MAX = 2**31 - 1  # PyTorch's cuDNN graph cache stores sizes and strides as int


@functools.cache
def _backend_ok() -> bool:
    """The operators exist with the expected schemas and cuDNN >= 9 is loaded."""
    if cudnn_ops() is None or not torch.backends.cudnn.is_available():
        return False
    return (torch.backends.cudnn.version() or 0) >= 90000


@functools.cache
def _arch_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] in CUDNN_ARCHS


def _avoid_recompile() -> bool:
    """``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` on: PyTorch's cuDNN backward then expects a (B, Nq, H)
    ordered LSE and ragged offsets derived from its strides, so flashjvp's LSE cannot go there."""
    value = env("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "")
    return value.strip().lower() not in ("", "0", "false", "off", "no", "n")


def strides_ok(x: torch.Tensor) -> bool:
    """Unit-stride head dim, 16-byte aligned data and (B, H, N) strides, nothing broadcast, and
    an extent that fits in int32."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return False
    align = 16 // x.element_size()
    extent = x.shape[-1]
    for size, st in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if st <= 0 or st % align:
            return False
        extent += (size - 1) * st
    return extent <= _INT32_MAX


# AttnArgs fields this module knows; any other option (an attention mask, whatever is added later)
# must be at its default for cuDNN to take the call.
_KNOWN_FIELDS = ("batch", "h_q", "h_kv", "n_q", "n_k", "d_qk", "d_v", "causal", "scale", "layout", "kv_lens",
                 "window", "varlen")
_OTHER_OPTIONS = tuple((f.name, f.default) for f in dataclasses.fields(AttnArgs) if f.name not in _KNOWN_FIELDS)


def no_other_option(a: AttnArgs) -> bool:
    for name, default in _OTHER_OPTIONS:
        value = getattr(a, name)
        if value is not default and (isinstance(value, torch.Tensor) or value != default):
            return False
    return True


def cudnn_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttnArgs, *,
                    backward: bool = False) -> bool:
    """Whether PyTorch's cuDNN attention handles this call (conservative; host-side only, no GPU
    synchronisation): CUDA tensors on an sm90 GPU (``CUDNN_ARCHS``), float16 / bfloat16, Dqk == Dv
    a multiple of 8 up to 128, no key padding, no window, not packed variable-length, no mask (nor
    any other AttnArgs option this module does not know), causal ``None`` or top-left
    (bottom-right only when Nq == Nk, where both coincide), Nk >= 2, GQA allowed; unit-stride head
    dim, 16-byte aligned pointers and strides; cuDNN >= 9 and the operators' expected schemas.
    ``backward``: also not under ``torch.use_deterministic_algorithms(True)`` (cuDNN's backward is
    not deterministic)."""
    if not q.is_cuda or q.dtype not in CUDNN_DTYPES:
        return False
    if a.kv_lens is not None or a.window is not None or a.varlen is not None or not no_other_option(a):
        return False
    if a.d_qk != a.d_v or a.d_qk % CUDNN_HEAD_DIM_STEP or a.d_qk > CUDNN_MAX_HEAD_DIM:
        return False
    if a.causal == "bottom_right" and a.n_q != a.n_k:
        return False
    if a.n_k < 2 or a.batch > _MAX_BATCH_HEADS or a.h_q > _MAX_BATCH_HEADS:
        return False
    if backward and torch.are_deterministic_algorithms_enabled() \
            and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if _avoid_recompile() or not _backend_ok() or not _arch_ok(q.device.index):
        return False
    return strides_ok(q) and strides_ok(k) and strides_ok(v)


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class Faster:
    """One row of the ``auto`` policy: calls matching every field measured faster on cuDNN than on
    flashjvp's Triton kernels."""

    directions: tuple[str, ...] = ("fwd", "bwd")
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    head_dims: tuple[int, ...] = (64, 128)
    min_n_q: int = 4096
    min_n_k: int = 4096
    causal: tuple[str | None, ...] = (None, "top_left", "bottom_right")
    gqa: bool = True  # also when Hq != Hkv

    def matches(self, dtype: torch.dtype, a: AttnArgs, backward: bool) -> bool:
        return (("bwd" if backward else "fwd") in self.directions and dtype in self.dtypes
                and a.d_qk in self.head_dims and a.n_q >= self.min_n_q and a.n_k >= self.min_n_k
                and a.causal in self.causal and (self.gqa or a.h_q == a.h_kv))


# Where cuDNN takes the plain forward and backward (auto). Measured (bf16, benchmarks/results/*/dispatch_table.md
# and dispatch.md): at head dim 64 from 256 to 8192 tokens cuDNN's forward is 1.06-1.28x and its
# backward 1.05-1.55x faster than flashjvp's Triton kernels, except one backward (N1024 causal,
# 0.92x); at D64/D128 from 4096 tokens both directions are 1.20-1.48x faster. Other head dims (40,
# 72, 96, ...) follow without a table of their own yet; PyTorch's own SDPA picks cuDNN for them on
# Hopper. Re-measure with `python benchmarks/dispatch_table.py`.
CUDNN_FASTER: tuple[Faster, ...] = (Faster(head_dims=tuple(range(8, CUDNN_MAX_HEAD_DIM + 1, 8)), min_n_q=1, min_n_k=2),)


def listed_faster(dtype: torch.dtype, a: AttnArgs, *, backward: bool) -> bool:
    for row in CUDNN_FASTER:  # a loop, not any() over a generator: asked on every plain call
        if row.matches(dtype, a, backward):
            return True
    return False


# Shape classes where cuDNN raised: {refusal_key: message}; never retried in this process.
_REFUSED: dict = {}


def refusal_key(q: torch.Tensor, a: AttnArgs, backward: bool) -> tuple:
    """The shape class a cuDNN refusal is remembered for: direction, device, dtype, heads, head
    dims, causal, layout and the power-of-two buckets of both lengths."""
    return (backward, q.device.index, q.dtype, a.h_q, a.h_kv, a.d_qk, a.d_v, a.causal, a.layout,
            length_bucket(a.n_q), length_bucket(a.n_k))


def use_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttnArgs, *, backward: bool) -> bool:
    """Whether this plain forward (``backward=False``; callers ask only without tangents) or
    backward goes to cuDNN: never with ``FLASHJVP_CUDNN=0``; with ``1`` wherever
    :func:`cudnn_supported`; with ``auto`` also only where :data:`CUDNN_FASTER` lists the case and
    ``torch.backends.cuda.cudnn_sdp_enabled()``. A shape class where cuDNN raised before is not
    tried again."""
    if q.dtype not in CUDNN_DTYPES:  # the cheapest refusal first: short calls are bound by this code
        return False
    mode = cudnn_mode()
    if mode == "never":
        return False
    if mode == "auto" and not (listed_faster(q.dtype, a, backward=backward)
                               and torch.backends.cuda.cudnn_sdp_enabled()):
        return False
    if not cudnn_supported(q, k, v, a, backward=backward):
        return False
    return not (_REFUSED and refusal_key(q, a, backward) in _REFUSED)


def refuse(q: torch.Tensor, a: AttnArgs, backward: bool, error: BaseException) -> None:
    msg = " ".join(str(error).split())[:300]
    _REFUSED[refusal_key(q, a, backward)] = msg
    what = "backward" if backward else "forward"
    warnings.warn(f"flashjvp: PyTorch's cuDNN attention {what} failed for B{a.batch} Hq{a.h_q} Hkv{a.h_kv} "
                  f"Nq{a.n_q} Nk{a.n_k} D{a.d_qk} {q.dtype} causal={a.causal} layout={a.layout} "
                  f"({type(error).__name__}: {msg}); this shape class runs flashjvp's Triton kernels "
                  "from now on", RuntimeWarning, stacklevel=4)


def dispatch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: AttnArgs, *, need_lse: bool = True):
    """``attn_fwd``'s ``(o, None, lse, None)`` from cuDNN when :func:`use_cudnn` says so and the call
    succeeds (``lse`` None without ``need_lse``); else None (the caller launches Triton). Call only
    without tangents."""
    if not use_cudnn(q, k, v, a, backward=False):
        return None
    try:
        o, lse = cudnn_fwd(q, k, v, a, need_lse=need_lse)
    except torch.cuda.OutOfMemoryError:
        return None  # not a refusal: Triton needs no workspace, retry cuDNN next time
    except RuntimeError as e:
        refuse(q, a, False, e)
        return None
    return o, None, lse, None


def dispatch_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, a: AttnArgs):
    """``attn_bwd``'s ``(dq, dk, dv)`` from cuDNN when :func:`use_cudnn` says so and the call
    succeeds; else None (the caller launches Triton). ``o`` and ``lse`` may come from any
    flashjvp forward, the fused forward+JVP kernel's included."""
    if not use_cudnn(q, k, v, a, backward=True):
        return None
    if do.dtype != q.dtype or o.dtype != q.dtype or lse.dtype != torch.float32:
        return None
    try:
        return cudnn_bwd(do, q, k, v, o, lse, a)
    except torch.cuda.OutOfMemoryError:
        return None
    except RuntimeError as e:
        refuse(q, a, True, e)
        return None
