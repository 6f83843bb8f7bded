"""Constants and small helpers shared by the Triton kernels and their launchers."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl

# The kernels work in base 2 (exp2/log2 are single instructions): exp(x) == exp2(x * LOG2E),
# log(x) == log2(x) * LN2. Host code uses the floats, kernels the constexpr twins.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(LN2)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """``FLASHJVP_AUTOTUNE=0`` replaces the autotune lists by one fixed config per kernel
    (fast start-up: the test suites compile many shapes)."""
    return os.environ.get("FLASHJVP_AUTOTUNE", "1") != "0"


def tile_configs(tiles, **flags) -> list:
    """Autotune candidates from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` rows, the default
    (kept with FLASHJVP_AUTOTUNE=0) first; one small tile in Triton's interpreter. ``flags``:
    further constexprs every one of these configs sets (e.g. ``WS=False``)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, **flags}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **flags}, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles]


def keep_fitting(configs, fits) -> list:
    """The configs ``fits`` accepts (the last one if none does); only the first without autotuning."""
    kept = [c for c in configs if fits(c)] or configs[-1:]
    return kept if autotuning() else kept[:1]


# Configs the autotuner picked, per (kernel, dtype, key values): see launch_tuned.
_TUNED: dict = {}
# The config each kernel (by name) was last launched with; the benchmark records it per row.
last_config: dict[str, dict] = {}


def launch_tuned(kernel, grid, *args, **kwargs) -> None:
    """Launch an ``@triton.autotune`` kernel. Triton's Autotuner rebuilds its cache key from all
    of a launch's ~60 arguments on every call (a list-membership test per argument): about
    0.15 ms of Python per launch on the CPU machine, and on the H200 the forward at
    B8 H16 N1024 D72 took 0.34 ms per call against 0.17 ms of GPU time. Here the key is read
    from the keyword arguments the kernel's ``key`` names (the launchers pass all of them by
    keyword) and the dtype of the first tensor (every other tensor of a launch has that dtype
    or a fixed float32; the first argument is a tensor on every path); the first call for a key
    tunes through the Autotuner, later ones launch the picked config directly. ``kernel`` is
    ``@triton.autotune`` over ``@triton.heuristics`` whose rules read keyword arguments only."""
    key = (kernel, args[0].dtype, *[kwargs[k] for k in kernel.keys])
    config = _TUNED.get(key)
    if config is None:
        kernel[grid](*args, **kwargs)
        _TUNED[key] = last_config[kernel.base_fn.__name__] = kernel.best_config.all_kwargs()
        return
    last_config[kernel.base_fn.__name__] = config
    # The kernel's @triton.heuristics read keyword arguments only; evaluated here on ``kwargs``
    # instead of Triton's dict of all ~70 arguments per heuristic.
    heuristics = kernel.fn
    flags = {name: rule(kwargs) for name, rule in heuristics.values.items()}
    heuristics.fn[grid](*args, **kwargs, **flags, **config)


_TMA_MODES = {"auto", "0", "1", "ws"}
# FLASHJVP_TMA when unset: "auto", the TMA path without warp specialization where it measured
# faster (use_tma). Its warp-specialized 128x64 tile was faster still (1.82 ms against 2.17 without
# and 2.29 on pointers at B2 H24 N4096 D128: runs/2026-12-03t-fwd_jvp-d128.json, sweep-2026-12-03x.txt)
# and was the default from 596f685 until a longer soak found it leaving a whole 128-row block of
# o, to, lse and mu unwritten in 4 of 4889 and 1 of 10836 calls at that shape, where the same
# tile without specialization failed in none of 9666 (runs/ws-soak-2026-12-03w.txt, -x.txt).
# Triton 3.6's warp-specialized tiles did this in every form tried (benchmarks/NOTES.md, fourth
# to seventh sessions): a silent wrong answer, so they run only under "ws", which warns.
TMA_DEFAULT = "auto"
_TMA_WARNING = ("FLASHJVP_TMA=ws: the warp-specialized tiles (Triton 3.6) have left whole row blocks "
                "of the outputs unwritten (5 of 15725 calls at B2 H24 N4096 D128 on an H200, "
                "benchmarks/NOTES.md); use them for experiments only")
_tma_warned = False


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def use_tma(tensors, *, kv_tangents: bool, head_dims: tuple[int, int], n_k: int) -> int:
    """How the forward kernel moves its tiles: 0 through pointers; 1 through tensor descriptors
    (TMA); 2 through descriptors with warp-specialized tiles among the autotune candidates.
    ``FLASHJVP_TMA`` (unset: ``TMA_DEFAULT``, ``auto``): ``0`` never; ``auto`` (1) where the H200
    measured it faster: forward+JVP with a key or value tangent (not tq alone, slower there) of
    16-bit inputs with head dims (``head_dims``: Dqk, Dv) of 128 (not timed at 256) and at least
    1024 keys, on a Hopper GPU; ``1`` wherever the tensors allow it (slower where ``auto`` says
    no); ``ws`` (2) likewise, with the warp-specialized tiles (experimental, warns once: see
    ``TMA_DEFAULT``). ``tensors``: the launch's inputs (``None`` skipped), the first a query
    (``tma_usable``)."""
    mode = os.environ.get("FLASHJVP_TMA", TMA_DEFAULT)
    if mode not in _TMA_MODES:
        raise ValueError(f"FLASHJVP_TMA must be one of {sorted(_TMA_MODES)}, got {mode!r}")
    if mode == "0":
        return 0
    if mode == "auto":  # the cheap tests first: tma_usable reads every tensor's strides (host time)
        q = tensors[0]
        if not (kv_tangents and head_dims == (128, 128) and n_k >= 1024 and q.element_size() == 2 and q.is_cuda
                and _hopper(q.device.index)):
            return 0
    if not tma_usable(tensors):
        return 0
    if mode != "ws":
        return 1
    global _tma_warned
    if not _tma_warned:
        _tma_warned = True
        warnings.warn(_TMA_WARNING, RuntimeWarning, stacklevel=4)
    return 2


def tma_usable(tensors) -> bool:
    """Whether tensor descriptors (host-made 4-D ones over a (B, H, N, D) view for k, v, tk, tv;
    built in the kernel for q, tq) can address every tensor (``None`` skipped): unit stride along
    the head dim, 16-byte aligned base and other strides in bytes (TMA's rules). Either storage
    order: sequence-major storage ((B, N, H, D), flash-attn's) gives a descriptor whose head
    stride is below its sequence stride; on the H200 that passed the GPU tests and ran as fast as
    the other order (runs/seq-major-2026-12-03w.txt)."""
    for x in tensors:
        if x is None:
            continue
        elt = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * elt % 16 for st in x.stride()[:-1]):
            return False
    return True


def ensure_tma_allocator() -> None:
    """Kernels that build tensor descriptors on the device need scratch memory from Triton's
    allocator; set one backed by PyTorch's caching allocator unless the program has set its own."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()  # triton.next_power_of_2 costs ~4 us a call


def head_block(d: int) -> int:
    """Tile width for a head dim: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, _next_power_of_2(d))


def head_blocks(d_qk: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_DQK, BLOCK_DV) for the kernels: one width for both. On the H200 (Triton 3.6) tiles
    with BLOCK_DQK != BLOCK_DV gave wrong tangents/gradients and illegal memory accesses (seen
    with (128, 32) and (64, 32); correct in the interpreter), so the narrower one is padded
    (masked) to the wider. See benchmarks/NOTES.md."""
    b = max(head_block(d_qk), head_block(d_v))
    return b, b


def length_bucket(n: int) -> int:
    """Autotune key for a sequence length: powers of two from 64 to 16384, so a new length in
    the same bucket reuses the tuned config instead of re-running the autotuner."""
    return min(16384, max(64, _next_power_of_2(n)))


def vector_align(strides, *dims: int) -> int:
    """8 when every batch/head/sequence stride (``strides_bhnd`` tuples) and head dim is a
    multiple of 8 elements, else 1. Passed to the kernels as ``ALIGN``: Triton only infers
    that an integer argument is a multiple of 16, so D = 40, 72 or 136 and their strides would
    otherwise compile to one 2-byte load per element instead of 16-byte vectors."""
    g = math.gcd(*dims)  # gcds, not a generator over ~30 values: small shapes are launch-bound
    for st in strides:
        g = math.gcd(g, st[0], st[1], st[2])
    return 8 if g % 8 == 0 else 1


def strides_bhnd(x: torch.Tensor | None, layout: str) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of a tensor given in ``layout``; zeros for ``None``."""
    if x is None:
        return (0, 0, 0, 0)
    s = x.stride()
    return s if layout == "bhnd" else (s[0], s[2], s[1], s[3])


# Debug aid used by the tests: FLASHJVP_POISON=1 fills every buffer a kernel must write with NaN,
# so an element the kernel leaves unwritten fails the comparison instead of passing by luck.
POISON = os.environ.get("FLASHJVP_POISON", "0") == "1"


def _poison(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(float("nan")) if POISON else x


def new_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer the kernels overwrite completely (NaN-filled under FLASHJVP_POISON=1)."""
    return _poison(torch.empty(shape, dtype=dtype, device=device))


def buffer_like(x: torch.Tensor) -> torch.Tensor:
    """``new_buffer`` with ``x``'s shape, dtype and (dense) strides, as autograd expects for grads."""
    return _poison(torch.empty_like(x))


def empty_out(batch: int, heads: int, n: int, d: int, layout: str, like: torch.Tensor):
    """Attention output buffer in ``layout``, contiguous."""
    shape = (batch, heads, n, d) if layout == "bhnd" else (batch, n, heads, d)
    return new_buffer(shape, like.dtype, like.device)


def lse_buffer(a_batch: int, heads: int, n: int, device) -> torch.Tensor:
    """Per-row float32 statistics (lse, mu, delta): (B, H, N), contiguous."""
    return new_buffer((a_batch, heads, n), torch.float32, device)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs follow ``torch.backends.cuda.matmul.allow_tf32`` (PyTorch's rule);
    half inputs use the tensor cores' native precision."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def launch_device(x: torch.Tensor):
    """Context making ``x``'s GPU the current device for a launch (a no-op on the CPU)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@triton.jit
def aligned(x, ALIGN: tl.constexpr):
    """``x`` rounded down to a multiple of ALIGN: the same value where the host checked
    (``vector_align``), written so that Triton's alignment analysis sees the multiple
    (``tl.multiple_of`` on a scalar argument is dropped in Triton 3.6)."""
    return (x // ALIGN) * ALIGN


@triton.jit
def aligned3(a, b, c, ALIGN: tl.constexpr):
    """``aligned`` for the (batch, head, sequence) strides of one tensor."""
    return aligned(a, ALIGN), aligned(b, ALIGN), aligned(c, ALIGN)


@triton.jit
def load_tile(ptrs, mask0, mask1, MASK0: tl.constexpr, MASK1: tl.constexpr):
    """Load a 2-d tile, masking rows (``mask0``) and/or columns (``mask1``) only where asked,
    so interior tiles compile to unmasked loads. Masked elements read as zero."""
    if MASK0 and MASK1:
        x = tl.load(ptrs, mask=mask0[:, None] & mask1[None, :], other=0.0)
    elif MASK0:
        x = tl.load(ptrs, mask=mask0[:, None], other=0.0)
    elif MASK1:
        x = tl.load(ptrs, mask=mask1[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def key_range(m0, N_K, causal_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key blocks for query rows [m0, m0 + BLOCK_M): ``[0, full_end)`` are visible to every row
    (no mask needed), ``[full_end, hi)`` need the bounds/causal mask."""
    full_end = (N_K // BLOCK_N) * BLOCK_N
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, tl.maximum(m0 + BLOCK_M + causal_off, 0))
        full_end = tl.minimum(full_end, (tl.maximum(m0 + causal_off + 1, 0) // BLOCK_N) * BLOCK_N)
    return full_end, hi
