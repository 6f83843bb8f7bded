"""The plain forward (no tangents) and the plain backward through PyTorch's cuDNN attention.

``_backends.run_fwd`` / ``run_bwd`` call :func:`cudnn_fwd` and :func:`cudnn_bwd` where the call's
route (``_route.choose``: which calls cuDNN supports, and when it is chosen) names cuDNN; they
hand ``aten._scaled_dot_product_cudnn_attention`` and its backward the tensors directly (not
through ``F.scaled_dot_product_attention``, so no backend choice and no autograd node is
involved). :func:`strides_ok` is the one tensor property that routing reads from here.

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
the refusal is remembered per shape class (:func:`refusal_key`), with one warning; routing reads
it (``_backends.route_of``).
"""

from __future__ import annotations

import functools
import warnings

import torch

from flashjvp._launch import LaunchLog, matching_layout_strides, out_strides, record_launch
from flashjvp._policy import length_bucket
from flashjvp._validate import AttnArgs, bhnd_view

__all__ = ["cudnn_fwd", "cudnn_bwd", "cudnn_ops", "strides_ok", "refuse"]

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
    ``_route.cudnn_supports`` accepts (no check here)."""
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
    strides of their inputs. For cases ``_route.cudnn_supports`` accepts (no check here)."""
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

_INT32_MAX = 2**31 - 1  # PyTorch's cuDNN graph cache stores sizes and strides as int


def strides_ok(x: torch.Tensor, *, pointer: bool = True) -> bool:
    """Unit-stride head dim, 16-byte aligned data and (B, H, N) strides, nothing broadcast, and
    an extent that fits in int32. ``pointer=False``: all but the data pointer's alignment (a tensor
    Dynamo traces has none to read; its sizes may be symbolic, each test then a guard)."""
    if x.stride(-1) != 1 or (pointer and x.data_ptr() % 16):
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


# --------------------------------------------------------------------------- refusals


# Shape classes where cuDNN raised: {refusal_key: message}; never retried in this process.
_REFUSED: dict = {}


def refusal_key(q: torch.Tensor, a: AttnArgs, backward: bool) -> tuple:
    """The shape class a cuDNN refusal is remembered for: direction, device, dtype, heads, head
    dims, causal, layout and the power-of-two buckets of both lengths."""
    return (backward, q.device.index, q.dtype, a.h_q, a.h_kv, a.d_qk, a.d_v, a.causal, a.layout,
            length_bucket(a.n_q), length_bucket(a.n_k))


def refuse(q: torch.Tensor, a: AttnArgs, backward: bool, error: BaseException) -> None:
    msg = " ".join(str(error).split())[:300]
    _REFUSED[refusal_key(q, a, backward)] = msg
    what = "backward" if backward else "forward"
    warnings.warn(f"flashjvp: PyTorch's cuDNN attention {what} failed for B{a.batch} Hq{a.h_q} Hkv{a.h_kv} "
                  f"Nq{a.n_q} Nk{a.n_k} D{a.d_qk} {q.dtype} causal={a.causal} layout={a.layout} "
                  f"({type(error).__name__}: {msg}); this shape class runs flashjvp's Triton kernels "
                  "from now on", RuntimeWarning, stacklevel=5)
