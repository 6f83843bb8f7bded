"""Host-side launch helpers: output buffers, strides, alignment, the tuned-launch fast path and
``LaunchLog``, which lets a caller (tests, the benchmark) see which kernels ran with which tile."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import torch
import triton

from flashjvp._policy import poisoning
from flashjvp._sparse import list_strides

try:  # the launcher interface of compiled kernels that Launcher calls (Triton 3.4 and later)
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # older Triton: every launch goes through the JIT
    _knobs = _driver = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel's name, its tile config and the launch's flags."""

    kernel: str
    config: dict
    flags: dict


class LaunchLog:
    """Records every flashjvp kernel launch made inside a ``with`` block (this process, any
    thread): ``log.launches`` lists :class:`Launch` records, ``log.count(name)`` counts them."""

    _active: list[list[Launch]] = []

    def __enter__(self) -> LaunchLog:
        self.launches: list[Launch] = []
        LaunchLog._active.append(self.launches)
        return self

    def __exit__(self, *exc) -> bool:
        active = LaunchLog._active
        del active[next(i for i, log in enumerate(active) if log is self.launches)]  # this log, not an equal one
        return False

    def count(self, kernel: str, **flags) -> int:
        """Launches of ``kernel`` whose flags include ``flags``."""
        return sum(r.kernel == kernel and all(r.flags.get(k) == v for k, v in flags.items())
                   for r in self.launches)


def record_launch(kernel: str, config: dict, **flags) -> None:
    for log in LaunchLog._active:
        log.append(Launch(kernel, config, flags))


# Configs the autotuner picked, per (kernel, dtype, key values): see launch_tuned.
_TUNED: dict = {}


def _heuristic_flags(kernel, kwargs) -> tuple:
    """``(jit_function, flags)``: the ``@triton.jit`` function under ``kernel``'s Autotuner and the
    values its ``@triton.heuristics`` rules (if any) give for ``kwargs``."""
    inner, flags = kernel.fn, {}
    rules = getattr(inner, "values", None)
    if rules is not None:
        flags = {name: rule(kwargs) for name, rule in rules.items()}
        inner = inner.fn
    return inner, flags


def _tuned_launch(kernel, grid, args, kwargs):
    """Launch an ``@triton.autotune`` kernel through the configs cache (see :func:`launch_tuned`);
    returns ``(config, flags, compiled, jit)``: the config it ran with, the heuristics' flags, what
    the JIT launch returned (the compiled kernel on a GPU, None in the interpreter) and the
    ``@triton.jit`` function."""
    key = (kernel, args[0].dtype, *[kwargs[k] for k in kernel.keys])
    config = _TUNED.get(key)
    inner, flags = _heuristic_flags(kernel, kwargs)
    if config is None:
        compiled = kernel[grid](*args, **kwargs)
        config = _TUNED[key] = kernel.best_config.all_kwargs()
    else:
        compiled = inner[grid](*args, **kwargs, **flags, **config)
    if LaunchLog._active:
        record_launch(kernel.base_fn.__name__, config, **kwargs)
    return config, flags, compiled, inner


def launch_tuned(kernel, grid, *args, **kwargs) -> dict:
    """Launch an ``@triton.autotune`` kernel; returns the config it ran with. Triton's Autotuner
    rebuilds its cache key from all of a launch's ~60 arguments on every call, which costs more
    host time than a short kernel runs. Here the key is read from the keyword arguments that the
    kernel's ``key`` names (the launchers pass all of them by keyword) and the dtype of the first
    argument (a tensor on every path; the others have its dtype or float32); the first call for a
    key tunes through the Autotuner, later ones launch the picked config directly. ``kernel`` is
    ``@triton.autotune`` over an optional ``@triton.heuristics`` whose rules read keyword
    arguments only."""
    return _tuned_launch(kernel, grid, args, kwargs)[0]


def launcher_interface(compiled) -> bool:
    """Whether :class:`Launcher` can repeat a launch of ``compiled`` (what the JIT launch returned).
    Launcher calls Triton's private ``compiled.run`` positionally, as Triton's own JIT launch does (3.6
    and 3.9 alike): ``run(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)``. Being private, it may change in any release; where it is absent (None from the
    interpreter, a Triton without ``knobs``) or its launcher takes other parameters, no plan is made and
    every call launches through the JIT, the public path: more host time per call, never a wrong launch."""
    if _knobs is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata",
                                                                  "launch_metadata")):
        return False
    return _known_launcher(type(compiled.run))


@functools.cache
def _known_launcher(cls) -> bool:
    """Whether the launcher class ``cls`` (what ``CompiledKernel.run`` is an instance of: the driver's
    ``CudaLauncher``, ``HIPLauncher``) is called as Launcher calls it: ``gridX, gridY, gridZ, stream,
    function`` as its first parameters, then ``*args`` (Triton 3.6 takes the metadata and hooks in it)
    or four more positional parameters and ``*args`` (Triton 3.9), and no required keyword. Per
    class, not per launch: the launch paths without a plan would pay for the signature on every call."""
    try:
        params = list(inspect.signature(cls.__call__).parameters.values())[1:]  # without self
    except (AttributeError, TypeError, ValueError):  # no Python signature: not a launcher Launcher knows
        return False
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        return False
    star = kinds.index(inspect.Parameter.VAR_POSITIONAL)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (star in (5, 9) and all(k in positional for k in kinds[:star])
            and [p.name for p in params[:5]] == ["gridX", "gridY", "gridZ", "stream", "function"]
            and all(p.kind is inspect.Parameter.VAR_KEYWORD or p.default is not inspect.Parameter.empty
                    for p in params[star + 1:]))


class Launcher:
    """A launch plan: one compiled Triton kernel with its grid, its config and every argument
    after the leading tensors fixed. Calling it with new leading tensors (same dtypes, 16-byte
    alignment and strides as the launch it was made from: the caller's cache key) launches the
    same kernel through Triton's C launcher directly, skipping what a JIT launch does per call
    with ~70 arguments (binding them, specializing each, building the cache key)."""

    __slots__ = ("kernel", "grid", "tail", "name", "config", "flags")

    def __init__(self, kernel, grid, tail, name, config, flags):
        self.kernel, self.grid, self.tail = kernel, grid, tail
        self.name, self.config, self.flags = name, config, flags

    def __call__(self, *tensors) -> None:
        k, hooks = self.kernel, _knobs.runtime
        stream = _driver.active.get_current_stream(_driver.active.get_current_device())
        enter = hooks.launch_enter_hook
        meta = None if enter is None else k.launch_metadata(self.grid, stream, *tensors, *self.tail)
        k.run(*self.grid, stream, k.function, k.packed_metadata, meta, enter, hooks.launch_exit_hook,
              *tensors, *self.tail)
        if LaunchLog._active:
            record_launch(self.name, self.config, **self.flags)


def plan_tuned(kernel, grid, n_tensors: int, *args, **kwargs) -> tuple[dict, Launcher | None]:
    """:func:`launch_tuned`, also returning a :class:`Launcher` that repeats this launch for new
    values of the first ``n_tensors`` arguments (None where no compiled kernel came back: the
    interpreter, or a Triton without the launcher interface used here: see :func:`launcher_interface`)."""
    config, flags, compiled, jit = _tuned_launch(kernel, grid, args, kwargs)
    if not launcher_interface(compiled):
        return config, None
    names = jit.arg_names
    values = {**dict(zip(names, args)), **kwargs, **flags, **config}
    full = [values[n] for n in names]
    g = tuple(grid(values) if callable(grid) else grid)
    g = g + (1,) * (3 - len(g))
    return config, Launcher(compiled, g, tuple(full[n_tensors:]), kernel.base_fn.__name__, config, kwargs)


class PlanCache(dict):
    """Plans by call signature (sizes, strides, dtypes, flags, alignment, switches), bounded: a
    program with very many distinct shapes starts over rather than grow without end."""

    MAX = 4096

    def put(self, key, plan) -> None:
        if len(self) >= self.MAX:
            self.clear()
        self[key] = plan


# The one plan cache of the host layer. Its keys start with what they are for: "plain" (an eager
# plain call's plan, _plan.py), "jvp" (attention_jvp's), "route" (a call's route, _backends.py),
# "args" (the operators' AttnArgs, _ops.py), "fwd" / "bwd" (Triton launch plans).
PLANS = PlanCache()


def aligned16(*xs) -> bool:
    """Whether every given tensor's data pointer is 16-byte aligned (what Triton specializes
    pointer arguments on, so a plan is valid only for the alignment it was made with)."""
    bits = 0
    for x in xs:
        if x is not None:
            bits |= x.data_ptr()
    return bits % 16 == 0


# FLASHJVP_POISON, read once: buffers are made on every call.
_POISON = poisoning()


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(float("nan")) if _POISON else x


def new_buffer(shape, dtype: torch.dtype, device, strides=None) -> torch.Tensor:
    """An output buffer the kernels overwrite completely (NaN-filled under FLASHJVP_POISON=1),
    contiguous unless ``strides`` are given."""
    if strides is None:
        return _poisoned(torch.empty(shape, dtype=dtype, device=device))
    return _poisoned(torch.empty_strided(shape, strides, dtype=dtype, device=device))


def buffer_like(x: torch.Tensor) -> torch.Tensor:
    """``new_buffer`` with ``x``'s shape, dtype and (dense) strides, as autograd expects for grads."""
    return _poisoned(torch.empty_like(x))


def out_shape(batch: int, heads: int, n: int, d: int, layout: str) -> tuple[int, int, int, int]:
    return (batch, heads, n, d) if layout == "bhnd" else (batch, n, heads, d)


def out_strides(a, q: torch.Tensor) -> tuple[int, ...] | None:
    """Strides of the call's outputs ``o`` and ``to``: with ``a.out_like_q`` dense in q's order of
    dimensions, as PyTorch's SDPA allocates them; None: contiguous in the call's layout (also
    for packed batches, and for a q whose head dim is not its innermost, unit-stride dimension)."""
    if not a.out_like_q or a.varlen is not None or q.stride(-1) != 1 or 0 in q.stride():
        return None
    return matching_layout_strides(q, out_shape(a.batch, a.h_q, a.n_q, a.d_v, a.layout))


def matching_layout_strides(q: torch.Tensor, shape) -> tuple[int, ...]:
    """Dense strides for ``shape`` with q's dimension order (smallest stride innermost; ties keep
    the dimension order): PyTorch's ``alloc_with_matching_layout`` for cuDNN's output ``o``."""
    order = sorted(range(q.dim()), key=lambda i: q.stride(i))  # stable: ties keep dim order
    strides, acc = [0] * len(shape), 1
    for i in order:
        strides[i] = acc
        acc *= shape[i]
    return tuple(strides)


def out_buffer(a, like: torch.Tensor) -> torch.Tensor:
    """The attention output of the call ``a`` (an ``AttnArgs``), with ``out_strides`` (by default
    contiguous in its layout); for packed sequences the (1, total_q, Hq, Dv) view of the packed
    output."""
    shape = ((1, a.varlen.total_q, a.h_q, a.d_v) if a.varlen is not None
             else out_shape(a.batch, a.h_q, a.n_q, a.d_v, a.layout))
    return new_buffer(shape, like.dtype, like.device, out_strides(a, like))


def stat_buffer(a, device) -> torch.Tensor:
    """Per-row float32 statistics (lse, mu, delta) of the call ``a``: (B, Hq, Nq); (1, Hq, total_q)
    for packed sequences."""
    shape = (1, a.h_q, a.varlen.total_q) if a.varlen is not None else (a.batch, a.h_q, a.n_q)
    return new_buffer(shape, torch.float32, device)


def stat_strides(a) -> tuple[int, int]:
    """(batch, head) strides of ``stat_buffer``; for packed sequences the batch stride is 0 (a
    sequence's rows are found from its offset)."""
    if a.varlen is not None:
        return 0, a.varlen.total_q
    return a.h_q * a.n_q, a.n_q


def seq_strides(x: torch.Tensor | None, a) -> tuple[int, int, int, int]:
    """``strides_bhnd`` for the kernels: batch stride 0 for packed sequences, whose (1, total, H, D)
    views are indexed by sequence offsets instead."""
    if a.varlen is None:
        return strides_bhnd(x, a.layout)
    return (0, *strides_bhnd(x, a.layout)[1:])


def all_seq_strides(xs, a) -> list[tuple[int, int, int, int]]:
    """``seq_strides`` of each of a launch's tensors ``xs`` (``None`` allowed), in one call: a
    launch passes about eight, and short calls are bound by this host code."""
    if a.varlen is None and a.layout == "bhnd":
        return [(0, 0, 0, 0) if x is None else x.stride() for x in xs]
    return [seq_strides(x, a) for x in xs]


# mask_args of the calls without a window, packed batch or mask, by causal alignment (most calls:
# shared, not rebuilt per launch; the launchers only read them)
_PLAIN_MASKS = {c: ((int(c == "bottom_right"), 0, 0),
                    dict(RIGHT=c is not None, LEFT=False, VARLEN=False, HAS_MASK=False, MASK_BOOL=False,
                         MASK_ROWS=False, SPARSE=False, SP_BM=0, SP_BN=0))
                for c in (None, "top_left", "bottom_right")}


def mask_args(a) -> tuple[tuple[int, int, int], dict]:
    """The kernels' runtime masking arguments ``(bottom_right, win_r, win_l)`` and their flags:
    RIGHT (causal or a window's right side), LEFT (a window's left side), VARLEN, and for an
    attention mask HAS_MASK, MASK_BOOL and MASK_ROWS (whether it differs between query rows), and
    for a block mask SPARSE with its block sizes SP_BM, SP_BN (``_sparse.SparsePlan``)."""
    if a.window is None and a.varlen is None and a.mask is None and a.sparse is None:
        return _PLAIN_MASKS[a.causal]
    right, left = a.window_right, a.window_left
    m = a.mask
    flags = dict(RIGHT=right >= 0, LEFT=left >= 0, VARLEN=a.varlen is not None, HAS_MASK=m is not None,
                 MASK_BOOL=m is not None and m.dtype == torch.bool,
                 MASK_ROWS=m is not None and m.stride(2) != 0, SPARSE=a.sparse is not None,
                 SP_BM=0 if a.sparse is None else a.sparse.block_m, SP_BN=0 if a.sparse is None else a.sparse.block_n)
    return (int(a.diagonal == "bottom_right"), max(right, 0), max(left, 0)), flags


def aux_tensors(a, stand_in: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels' KV_LENS, CU_Q, CU_K, MASK, SP_ROW, SP_COL and SP_BITS pointers (``stand_in``
    where absent: never read)."""
    kv = stand_in if a.kv_lens is None else a.kv_lens
    mask = stand_in if a.mask is None else a.mask.view(torch.uint8) if a.mask.dtype == torch.bool else a.mask
    sp = (stand_in,) * 3 if a.sparse is None else (a.sparse.row, a.sparse.col, a.sparse.bits)
    if a.varlen is None:
        return kv, stand_in, stand_in, mask, *sp
    return kv, a.varlen.cu_q, a.varlen.cu_k, mask, *sp


_NO_MASK_STRIDES = (0,) * 10


def mask_strides(a) -> tuple[int, ...]:
    """(batch, head, query, key) strides of the attention mask (0 along broadcast dims), then the
    (batch, head, block) strides of the block mask's row and column lists (``_sparse``)."""
    if a.mask is None and a.sparse is None:
        return _NO_MASK_STRIDES
    m = (0, 0, 0, 0) if a.mask is None else a.mask.stride()
    sp = (0,) * 6 if a.sparse is None else (*list_strides(a.sparse.row), *list_strides(a.sparse.col))
    return (*m, *sp)


def strides_bhnd(x: torch.Tensor | None, layout: str) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides of a tensor given in ``layout``; zeros for ``None``."""
    if x is None:
        return (0, 0, 0, 0)
    s = x.stride()
    return s if layout == "bhnd" else (s[0], s[2], s[1], s[3])


def vector_align(strides, *dims: int) -> int:
    """8 when every batch/head/sequence stride (``strides_bhnd`` tuples) and head dim is a
    multiple of 8 elements, else 1. Passed to the kernels as ``ALIGN``: Triton only infers that
    an integer argument is a multiple of 16, so D = 40, 72 or 136 and their strides would
    otherwise compile to one 2-byte load per element instead of 16-byte vectors."""
    g = math.gcd(*dims)  # gcds, not a generator over ~30 values: small shapes are launch-bound
    for st in strides:
        g = math.gcd(g, st[0], st[1], st[2])
    return 8 if g % 8 == 0 else 1


def c_getter(name: str, public):
    """PyTorch's C getter ``torch._C.<name>`` (a few tens of nanoseconds) where this PyTorch has
    it, else ``public``: the ``torch.backends`` properties that plan keys read on every call cost
    several times the rest of a key."""
    return getattr(torch._C, name, None) or public


allow_tf32 = c_getter("_get_cublas_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs follow ``torch.backends.cuda.matmul.allow_tf32`` (PyTorch's rule);
    half inputs use the tensor cores' native precision."""
    if dtype == torch.float32 and not allow_tf32():
        return "ieee"
    return "tf32"


def launch_device(x: torch.Tensor):
    """Context making ``x``'s GPU the current device for a launch (a no-op on the CPU)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def ensure_tma_allocator() -> None:
    """Kernels that build tensor descriptors on the device need scratch memory from Triton's
    allocator; set one backed by PyTorch's caching allocator unless the program has set its own."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
