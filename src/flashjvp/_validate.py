"""Argument checking shared by the kernels and the reference: clear errors before any launch."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REF_DTYPES = KERNEL_DTYPES + (torch.float64,)
_CAUSAL = {False: None, None: None, True: "top_left", "top_left": "top_left",
           "bottom_right": "bottom_right"}
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

    @property
    def groups(self) -> int:
        return self.h_q // self.h_kv

    @property
    def causal_offset(self) -> int:
        """With causal masking, query ``i`` sees key ``j`` iff ``j <= i + causal_offset``."""
        return self.n_k - self.n_q if self.causal == "bottom_right" else 0


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


def _norm_scale(scale, d_qk: int) -> float:
    if scale is None:
        return d_qk ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a positive finite float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite float or None, got {scale}")
    return scale


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
    return kv_lens.to(torch.int32).contiguous()


def check_inputs(q, k, v, tq=None, tk=None, tv=None, *, causal=False, scale=None,
                 layout="bhnd", allow_float64: bool = True, kv_lens=None) -> AttnArgs:
    """Validate shapes, dtypes, devices and options; return the normalised sizes.

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
    return AttnArgs(b, h_q, h_kv, n_q, n_k, d_qk, d_v, _norm_causal(causal),
                    _norm_scale(scale, d_qk), layout, _check_kv_lens(kv_lens, b, q.device))
