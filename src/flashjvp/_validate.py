"""Argument checking shared by the kernels and the reference: clear errors before any launch."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD

from flashjvp._launch import PLANS
from flashjvp._policy import block_mask_tiles_ok, interpreting
from flashjvp._sparse import SparsePlan, plan_of

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REF_DTYPES = KERNEL_DTYPES + (torch.float64,)
_CAUSAL = {False: None, None: None, True: "top_left", "top_left": "top_left",
           "bottom_right": "bottom_right"}
ALIGNS = ("top_left", "bottom_right")
LAYOUTS = ("bhnd", "bnhd")


@dataclass(frozen=True)
class AttnArgs:
    """Sizes and options of one attention call, normalised."""

    batch: int
    h_q: int
    h_kv: int
    n_q: int
    n_k: int
    d_qk: int
    d_v: int
    causal: str | None  # None, "top_left" or "bottom_right"
    scale: float
    layout: str
    # (B,) int32 valid keys per batch element (key padding), or None: keys j >= kv_lens[b] unseen
    kv_lens: torch.Tensor | None = field(default=None, compare=False)
    # sliding window (left, right), -1 = unbounded on that side; None: no window
    window: tuple[int, int] | None = None
    # packed variable-length batch (attention_varlen), or None for the dense (B, ...) layouts
    varlen: Varlen | None = field(default=None, compare=False)
    # attention mask: a (B, Hq, Nq, Nk) view (stride 0 along broadcast dims), float32 / the inputs'
    # dtype (added to the logits) or bool (True = attend); or None
    mask: torch.Tensor | None = field(default=None, compare=False)
    # the diagonal a window is measured from when ``causal`` is None ("top_left" or "bottom_right");
    # with causal attention ``causal`` names it. None: "top_left"
    align: str | None = None
    # block mask (a FlexAttention BlockMask as the kernels read it, _sparse.SparsePlan), or None
    sparse: SparsePlan | None = field(default=None, compare=False)
    # outputs (o, to) dense in q's order of dimensions, as PyTorch's SDPA kernels give them (so that
    # a model's transpose back to (B, N, H*D) is a view); False: contiguous in ``layout``
    out_like_q: bool = False

    @property
    def diagonal(self) -> str:
        """The diagonal causal masking and the window are measured from: "top_left" (query ``i``'s
        diagonal key is ``i``) or "bottom_right" (key ``i + Nk - Nq``)."""
        return self.causal or self.align or "top_left"

    @property
    def window_left(self) -> int:
        """Keys more than this many positions left of a query's diagonal are unseen (-1: none)."""
        return -1 if self.window is None else self.window[0]

    @property
    def window_right(self) -> int:
        """Keys more than this many positions right of a query's diagonal are unseen (-1: none;
        causal attention is a right bound of 0)."""
        if self.causal is not None:
            return 0
        return -1 if self.window is None else self.window[1]

    @property
    def groups(self) -> int:
        return self.h_q // self.h_kv

    @property
    def causal_offset(self) -> int:
        """Query ``i``'s diagonal key is ``i + causal_offset`` (causal masking: ``j <= i + causal_offset``;
        a window's bounds are counted from it)."""
        return self.n_k - self.n_q if self.diagonal == "bottom_right" else 0


@dataclass(frozen=True)
class Varlen:
    """A packed batch of ``len(cu_q) - 1`` sequences (flash-attn's varlen convention): sequence
    ``b`` has query rows ``cu_q[b]:cu_q[b+1]`` of the (total_q, H, D) tensors and keys
    ``cu_k[b]:cu_k[b+1]``; no sequence is longer than ``max_q`` / ``max_k``."""

    cu_q: torch.Tensor  # (B + 1,) int32
    cu_k: torch.Tensor  # (B + 1,) int32
    max_q: int
    max_k: int
    total_q: int
    total_k: int


def bhnd_view(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """The (B, H, N, D) view of a tensor given in ``layout`` (and back: the swap is its own
    inverse); ``None`` stays ``None``."""
    return x.transpose(1, 2) if (x is not None and layout == "bnhd") else x


def _dims(x: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    b, a1, a2, d = x.shape
    return (b, a1, a2, d) if layout == "bhnd" else (b, a2, a1, d)


def _norm_causal(causal) -> str | None:
    if isinstance(causal, (bool, str)) or causal is None:
        if causal in _CAUSAL:
            return _CAUSAL[causal]
    raise ValueError(
        f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}"
    )


def _norm_align(causal, align, window, n_q, n_k, default: str | None) -> str | None:
    """The diagonal of the call: named by ``causal`` ("top_left" / "bottom_right"), else by ``align``,
    else ``default`` (the convention of the function's model: flash-attn's bottom-right for the packed
    API). Without any, a window with ``Nq != Nk`` is ambiguous (PyTorch and flash-attn measure it from
    different diagonals) and refused; otherwise top-left. ``window``: normalised."""
    if align is not None and align not in ALIGNS:
        raise ValueError(f"align: expected None, 'top_left' or 'bottom_right', got {align!r}")
    named = causal if isinstance(causal, str) else None
    if named is not None and align is not None and named != align:
        raise ValueError(f"align: expected None or {named!r} (the alignment causal={named!r} names), got {align!r}")
    chosen = named or align or default
    if chosen is None and window is not None and n_q != n_k:
        raise ValueError(
            f"align: a window with Nq != Nk ({n_q} queries, {n_k} keys) is measured from the top-left diagonal "
            f"(PyTorch's convention) or the bottom-right one (flash-attn's); name it: align='top_left' or "
            f"align='bottom_right' (or causal='top_left' / 'bottom_right'), got align=None")
    return chosen


def _norm_scale(scale, d_qk: int) -> float:
    if scale is None:
        return d_qk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a positive finite float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite float or None, got {scale}")
    return scale


def _plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` without the wrappers of ``torch.func`` grad/jvp levels, which wrap every tensor made
    inside them, also from plain ones: the kernels read memory, and these integer or boolean
    tensors (or constant masks) have no derivative. Batched (vmap) tensors are kept: that path runs
    the math reference."""
    if torch.compiler.is_compiling():  # Dynamo traces no transform's wrappers
        return x
    fn = torch._C._functorch
    while fn.is_functorch_wrapped_tensor(x) and not fn.is_batchedtensor(x):
        x = fn.get_unwrapped(x)
    return x


def _check_kv_lens(kv_lens, batch: int, device) -> torch.Tensor | None:
    """``kv_lens`` as a contiguous int32 (B,) tensor on the inputs' device (values are clamped
    to [0, Nk] by the kernels: checking them here would synchronise with the GPU)."""
    if kv_lens is None:
        return None
    if not isinstance(kv_lens, torch.Tensor):
        raise TypeError(f"kv_lens: expected a torch.Tensor of shape ({batch},) or None, got {type(kv_lens).__name__}")
    if kv_lens.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError(f"kv_lens: expected an integer dtype, got {kv_lens.dtype}")
    if tuple(kv_lens.shape) != (batch,):
        raise ValueError(f"kv_lens: expected shape ({batch},) (the batch size of q), got {tuple(kv_lens.shape)}")
    if kv_lens.device != device:
        raise ValueError(f"kv_lens: expected device {device} (the device of q), got {kv_lens.device}")
    return _plain(kv_lens.to(torch.int32).contiguous())


def _norm_window(window) -> tuple[int, int] | None:
    """``(left, right)`` with -1 for an unbounded side, or None when both sides are unbounded."""
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window: expected None or a pair of ints (left, right), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(f"window: expected sizes >= 0, or -1 for unbounded, got {(left, right)}")
    return None if (left, right) == (-1, -1) else (left, right)


def _check_mask(mask, q, shape: tuple[int, int, int, int], any_float: bool) -> torch.Tensor | None:
    """``mask`` as the kernels read it: a (B, Hq, Nq, Nk) view that repeats along broadcast dims
    (stride 0, nothing copied), of the mask's own dtype. ``any_float``: the reference's rule (a
    float mask of any precision), else float32 or q's dtype. A boolean mask stays bool here: the
    launchers reinterpret it as bytes for the kernels (a dtype view that Inductor cannot lower in
    a compiled graph, so it happens inside the operators)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got {type(mask).__name__}")
    floats = (torch.float32, q.dtype)
    if mask.dtype not in (torch.bool,) + floats and not (any_float and mask.is_floating_point()):
        raise TypeError(f"attn_mask: expected dtype torch.bool, torch.float32 or {q.dtype} (that of q), "
                        f"got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"attn_mask: expected device {q.device} (the device of q), got {mask.device}")
    if mask.requires_grad or fwAD.unpack_dual(mask).tangent is not None:
        raise ValueError("attn_mask: a mask that requires grad or carries a forward tangent is not supported "
                         "by the kernels (detach it, or use flashjvp.sdpa, which differentiates it in math)")
    if mask.dim() > 4 or any(m not in (1, n) for m, n in zip(mask.shape[::-1], shape[::-1])):
        raise ValueError(f"attn_mask: expected a shape broadcastable to {shape} (B, Hq, Nq, Nk), "
                         f"got {tuple(mask.shape)}")
    return _plain(mask[(None,) * (4 - mask.dim())].expand(shape))


def _check_block_mask(block_mask, q, batch: int, h_q: int, n_q: int, n_k: int, others: dict) -> SparsePlan:
    """``block_mask`` (a FlexAttention ``BlockMask``) as the kernels read it (``_sparse.plan_of``:
    built once per mask and kept on it)."""
    from torch.nn.attention.flex_attention import BlockMask  # imported on first use: it costs import time

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a torch.nn.attention.flex_attention.BlockMask or None, "
                        f"got {type(block_mask).__name__}")
    named = [name for name, given in others.items() if given]
    if named:
        raise ValueError(f"block_mask: cannot be combined with {', '.join(named)} (express it in the "
                         f"mask_mod of the BlockMask instead)")
    if tuple(block_mask.seq_lengths) != (n_q, n_k):
        raise ValueError(f"block_mask: expected seq_lengths (Q_LEN, KV_LEN) = {(n_q, n_k)} (the sequence "
                         f"lengths of q and k), got {tuple(block_mask.seq_lengths)}")
    shape = tuple(block_mask.kv_num_blocks.shape)
    if len(shape) != 3 or shape[0] not in (1, batch) or shape[1] not in (1, h_q):
        raise ValueError(f"block_mask: expected a (B, H) of (1 or {batch}, 1 or {h_q}) (broadcastable to the "
                         f"batch and query heads of q), got {shape[:-1]}")
    if block_mask.kv_num_blocks.device != q.device:
        raise ValueError(f"block_mask: expected device {q.device} (the device of q), "
                         f"got {block_mask.kv_num_blocks.device}")
    block_m, block_n = block_mask.BLOCK_SIZE
    if not block_mask_tiles_ok(block_m, block_n):
        step = 16 if interpreting() else 32
        raise ValueError(f"block_mask: BLOCK_SIZE {(block_m, block_n)} is not served: the kernels' tiles must "
                         f"divide the mask's blocks, so both sizes must be multiples of {step} (the default "
                         f"BLOCK_SIZE=128 works); rebuild it with create_block_mask(..., BLOCK_SIZE=128)")
    if torch.compiler.is_compiling() and getattr(block_mask, "_flashjvp_plan", None) is None:
        raise ValueError("block_mask: under torch.compile the mask must have been prepared outside the compiled "
                         "function: call flashjvp.prepare_block_mask(block_mask) once after creating it")
    return plan_of(block_mask)


def check_inputs(q, k, v, tq=None, tk=None, tv=None, *, causal=False, scale=None,
                 layout="bhnd", allow_float64: bool = True, kv_lens=None, window=None,
                 attn_mask=None, align=None, default_align: str | None = None, block_mask=None,
                 sparse: SparsePlan | None = None) -> AttnArgs:
    """Validate shapes, dtypes, devices and options; return the normalised sizes.

    ``align`` names the diagonal of causal masking and of the window (see ``_norm_align``);
    ``default_align`` is the function's own convention where the call names none. ``block_mask``: a
    FlexAttention ``BlockMask``; ``sparse``: one already converted (the operators of ``_ops.py``).

    Raises ``TypeError`` for wrong types/dtypes and ``ValueError`` for wrong values or shapes,
    each naming the argument, what was expected and what was given.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    names = ("q", "k", "v")
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            want = "(B, H, N, D)" if layout == "bhnd" else "(B, N, H, D)"
            raise ValueError(f"{name}: expected a 4-d tensor {want} for layout={layout!r}, "
                             f"got shape {tuple(x.shape)}")
    allowed = _REF_DTYPES if allow_float64 else KERNEL_DTYPES
    if q.dtype not in allowed:
        raise TypeError(f"q: expected dtype in {[str(d) for d in allowed]}, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")
    b, h_q, n_q, d_qk = _dims(q, layout)
    bk, h_kv, n_k, d_k = _dims(k, layout)
    bv, h_v, n_v, d_v = _dims(v, layout)
    if bk != b or bv != b:
        raise ValueError(f"k, v: expected batch size {b} (that of q), got k: {bk}, v: {bv}")
    if h_v != h_kv:
        raise ValueError(f"v: expected {h_kv} heads (those of k), got {h_v}")
    if h_kv == 0 or h_q % h_kv != 0:
        raise ValueError(f"k: expected a number of heads dividing q's {h_q} heads, got {h_kv}")
    if n_v != n_k:
        raise ValueError(f"v: expected sequence length {n_k} (that of k), got {n_v}")
    if d_k != d_qk:
        raise ValueError(f"k: expected head dim {d_qk} (that of q), got {d_k}")
    for name, d in (("q", d_qk), ("v", d_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected head dim in 1..{MAX_HEAD_DIM}, got {d}")
    for name, n in (("q", n_q), ("k", n_k)):
        if n < 1:
            raise ValueError(f"{name}: expected sequence length >= 1, got {n}")
    if b < 1 or h_q < 1:
        raise ValueError(f"q: expected batch and heads >= 1, got shape {tuple(q.shape)}")
    for name, t, x in (("tq", tq, q), ("tk", tk, k), ("tv", tv, v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != x.shape:
            raise ValueError(f"{name}: expected shape {tuple(x.shape)} (that of {name[1]}), "
                             f"got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected dtype {x.dtype} (that of {name[1]}), got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (that of {name[1]}), "
                             f"got {t.device}")
    c = _norm_causal(causal)
    if block_mask is not None:
        sparse = _check_block_mask(block_mask, q, b, h_q, n_q, n_k, {
            "causal": c is not None, "window": window is not None, "attn_mask": attn_mask is not None,
            "kv_lens": kv_lens is not None, "align": align is not None})
    if sparse is not None:
        return AttnArgs(b, h_q, h_kv, n_q, n_k, d_qk, d_v, None, _norm_scale(scale, d_qk), layout, sparse=sparse)
    if kv_lens is None and window is None and attn_mask is None and align is None and default_align is None:
        return _plain_args((b, h_q, h_kv, n_q, n_k, d_qk, d_v, c, _norm_scale(scale, d_qk), layout))
    win = None if window is None else _norm_window(window)
    diag = _norm_align(causal, align, win, n_q, n_k, default_align)
    if c is not None:
        c = diag or c
    sizes = (b, h_q, h_kv, n_q, n_k, d_qk, d_v, c, _norm_scale(scale, d_qk), layout)
    if kv_lens is None and win is None and attn_mask is None:
        return _plain_args(sizes)
    return AttnArgs(*sizes, None if kv_lens is None else _check_kv_lens(kv_lens, b, q.device), win, None,
                    None if attn_mask is None else _check_mask(attn_mask, q, (b, h_q, n_q, n_k), allow_float64),
                    None if c is not None else diag)


# AttnArgs of the calls without options beyond causal and scale are kept in the plan cache by their
# sizes: building a frozen dataclass sets each field through object.__setattr__, as much host time
# as the rest of the checks, while a model repeats the same few shapes. Shared safely: AttnArgs is
# immutable.


def _plain_args(sizes: tuple) -> AttnArgs:
    if torch.compiler.is_compiling():  # Dynamo would guard on the cache's contents
        return AttnArgs(*sizes)
    key = ("sizes", sizes)
    try:
        a = PLANS.get(key)
    except TypeError:  # symbolic sizes (SymInt, e.g. under a ShapeEnv) cannot be hashed
        return AttnArgs(*sizes)
    if a is None:
        a = AttnArgs(*sizes)
        PLANS.put(key, a)
    return a


def _check_cu_seqlens(name: str, cu, max_len, max_name: str, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor of shape (B + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected shape (B + 1,) with B >= 1, got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu.device}")
    if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 0:
        raise TypeError(f"{max_name}: expected an int >= 0, got {max_len!r}")


def _check_offsets(name: str, host: list[int], total: int, max_len: int, max_name: str) -> None:
    """The values of one offsets tensor, read back to the host (``host``)."""
    lens = [e - s for s, e in zip(host, host[1:])]
    if host[0] != 0 or host[-1] != total or min(lens) < 0:
        raise ValueError(f"{name}: expected non-decreasing offsets from 0 to {total} (the packed length), "
                         f"got {host if len(host) <= 8 else host[:4] + ['...'] + host[-3:]}")
    if max(lens) > max_len:
        raise ValueError(f"{max_name}: expected at least the longest sequence, {max(lens)}, got {max_len}")


def check_varlen(q, k, v, tq, tk, tv, cu_q, cu_k, max_q, max_k, *, causal=False, scale=None,
                 window=None, align=None, allow_float64: bool = True, check_values: bool = True) -> AttnArgs:
    """Validate a packed batch (q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv),
    int32 offsets ``cu_q``/``cu_k`` of shape (B + 1,)) and return its sizes as ``AttnArgs`` of the
    (1, total, H, D) "bnhd" views, ``batch`` = B, ``n_q``/``n_k`` = the longest sequences.
    ``check_values`` reads the offsets back to the host (one synchronisation) to check them. Causal
    masking and windows are measured from each sequence's bottom-right diagonal unless ``causal`` or
    ``align`` names "top_left" (flash-attn's convention, which the packed API mirrors)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("tq", tq), ("tk", tk), ("tv", tv)):
        if x is None and name.startswith("t"):
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-d tensor (total, H, D) for packed sequences, "
                             f"got shape {tuple(x.shape)}")
    views = [None if x is None else x.unsqueeze(0) for x in (q, k, v, tq, tk, tv)]
    a = check_inputs(*views, causal=causal, scale=scale, layout="bnhd", allow_float64=allow_float64,
                     window=window, align=align, default_align="bottom_right")
    return varlen_args(a, q.device, cu_q, cu_k, max_q, max_k, check_values=check_values)


def varlen_args(a: AttnArgs, device, cu_q, cu_k, max_q, max_k, *, check_values: bool = True) -> AttnArgs:
    """``a`` (the checked (1, total, H, D) views of a packed batch) with its offsets checked and
    recorded: ``batch`` becomes the number of sequences, ``n_q``/``n_k`` the longest ones."""
    total_q, total_k = a.n_q, a.n_k
    checks = (("cu_seqlens_q", cu_q, total_q, max_q, "max_seqlen_q"),
              ("cu_seqlens_k", cu_k, total_k, max_k, "max_seqlen_k"))
    for name, cu, _, max_len, max_name in checks:
        _check_cu_seqlens(name, cu, max_len, max_name, device)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_q.shape)} (that of cu_seqlens_q), "
                         f"got {tuple(cu_k.shape)}")
    if check_values and not torch.compiler.is_compiling() \
            and not (cu_q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # one device-to-host copy for both (a wrong offset would silently skip rows); reading the
        # values back would break a compiled graph or a CUDA graph capture, so those skip it
        hosts = torch.stack((cu_q, cu_k)).tolist()
        for (name, _, total, max_len, max_name), host in zip(checks, hosts):
            _check_offsets(name, host, total, max_len, max_name)
    cu_q, cu_k = _plain(cu_q.contiguous()), _plain(cu_k.contiguous())
    return dataclasses.replace(a, batch=cu_q.shape[0] - 1, n_q=int(max_q), n_k=int(max_k),
                               varlen=Varlen(cu_q, cu_k, int(max_q), int(max_k), total_q, total_k))
