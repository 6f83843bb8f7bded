"""Launch policy, in one place: environment switches, tile lists and their filters, when the
forward moves tiles through Hopper's tensor descriptors (TMA), and when it splits its last wave.

Environment switches (read at each call; ``FLASHJVP_POISON`` once, at import):

=====================  ========  ==============================================================
variable               default   meaning
=====================  ========  ==============================================================
FLASHJVP_TMA           auto      ``auto``: TMA where it is faster (``use_tma``); ``0`` never;
                                 ``1`` wherever the descriptors can address the tensors
FLASHJVP_TAIL_SPLIT    1         ``0``: never split the last wave into key shards
FLASHJVP_AUTOTUNE      1         ``0``: the first fitting tile of each list, no autotuning
FLASHJVP_POISON        0         ``1``: fill every output buffer with NaN first (a test aid)
=====================  ========  ==============================================================
"""

from __future__ import annotations

import functools
import os

import torch
import triton

# --------------------------------------------------------------------------- environment


# Names already encoded for os.environ's own store.
_ENV_KEYS: dict = {}


def env(name: str, default: str) -> str:
    """``os.environ.get(name, default)`` for switches read on every call. ``os.environ.get`` of an
    unset variable raises and catches a KeyError inside, which costs as much as several of a short
    call's argument checks; this looks the encoded name up in the dict behind ``os.environ``,
    which every change made through ``os.environ`` (``monkeypatch.setenv`` included) updates."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is not dict:  # not CPython's os._Environ: its public interface
        return environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = environ.encodekey(name)
    raw = data.get(key)
    return default if raw is None else environ.decodevalue(raw)


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through ``TRITON_INTERPRET=1``."""
    return env("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    return env("FLASHJVP_AUTOTUNE", "1") != "0"


def poisoning() -> bool:
    return env("FLASHJVP_POISON", "0") == "1"


TMA_MODES = ("auto", "0", "1")


def tma_mode() -> str:
    mode = env("FLASHJVP_TMA", "auto")
    if mode not in TMA_MODES:
        raise ValueError(f"FLASHJVP_TMA: expected one of {list(TMA_MODES)}, got {mode!r}")
    return mode


def tail_split_enabled() -> bool:
    return env("FLASHJVP_TAIL_SPLIT", "1") != "0"


_CUDNN_MODES = {"auto": "auto", "": "auto", "0": "never", "never": "never", "1": "always", "always": "always"}


def cudnn_mode() -> str:
    """``FLASHJVP_CUDNN``, read at each call: ``"auto"`` (default: eager plain calls run the
    backend PyTorch's SDPA picks, ``_plan.py``; elsewhere PyTorch's cuDNN attention for the plain
    forward and backward where it is supported and listed faster, ``_cudnn.py``),
    ``"never"`` (``0``) or ``"always"`` (``1``: wherever supported); case and surrounding spaces
    are ignored."""
    raw = env("FLASHJVP_CUDNN", "auto")
    mode = _CUDNN_MODES.get(raw)  # the usual spellings as they are, without normalising them
    if mode is None:
        value = raw.strip().lower()
        mode = _CUDNN_MODES.get(value)
        if mode is None:
            raise ValueError(f"FLASHJVP_CUDNN: expected one of ['auto', '0', '1', 'never', 'always'], "
                             f"got {value!r}")
    return mode


# --------------------------------------------------------------------------- sizes


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()  # triton.next_power_of_2 costs microseconds a call


def head_blocks(d_qk: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_DQK, BLOCK_DV): one width for both, the next power of two of the larger head dim
    (at least 16, ``tl.dot``'s minimum). Triton 3.6 miscompiled tiles with BLOCK_DQK != BLOCK_DV
    on sm_90 (wrong tangents and gradients, illegal addresses), so the narrower is padded."""
    b = max(16, next_power_of_2(max(d_qk, d_v)))
    return b, b


def length_bucket(n: int) -> int:
    """Autotune key for a sequence length: powers of two from 64 to 16384, so that a new length
    reuses the config tuned for its bucket instead of tuning again."""
    return min(16384, max(64, next_power_of_2(n)))


# --------------------------------------------------------------------------- tiles
# Rows are (BLOCK_M, BLOCK_N, num_warps, num_stages); the first that fits is the default
# (FLASHJVP_AUTOTUNE=0). The interpreter runs one small tile.

FWD_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3),
             (64, 32, 4, 4), (128, 128, 8, 2), (64, 128, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2),
             (32, 16, 4, 1)]
# Forward+JVP of 16-bit inputs at head dim 64 on the pointer path: the autotuner's timing noise
# picked slower tiles when given the whole list, so it chooses among the three fastest only.
# 128x128 stays out of every other case: with tangents its fp32 tiles spill at larger head dims.
FWD_JVP_D64_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
BWD_TILES = [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3),
             (128, 128, 8, 2), (32, 32, 4, 2), (16, 32, 4, 1)]
# Backward of forward+JVP (second order): four accumulators per key block, so narrower tiles.
BWD_JVP_TILES = [(64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 1), (16, 16, 4, 1)]
INTERPRETER_TILE = (16, 16, 4, 1)
# Widest key block of any forward tile: N_K % MAX_BLOCK_N == 0 lets the kernel skip the masked
# loop for the key tail (KEY_TAIL) whichever tile runs.
MAX_BLOCK_N = max(t[1] for t in FWD_TILES + FWD_JVP_D64_TILES)
# Row-block heights any forward launch may use (the tail-split scratch is sized for all).
BLOCK_MS = sorted({t[0] for t in FWD_TILES + FWD_JVP_D64_TILES + [INTERPRETER_TILE]})
# Shared memory and registers a tile may claim (Hopper: 227 KiB of shared memory per SM,
# 255 registers per thread of which the fp32 accumulators may take about half).
_SMEM_BYTES = 200 * 1024
_ACC_REGS = 128


def tile_configs(tiles) -> list:
    """``triton.Config`` candidates from tile rows; the interpreter's one tile on the CPU."""
    if interpreting():
        tiles = [INTERPRETER_TILE]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def tile_of(config) -> tuple[int, int, int, int]:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def keep_fitting(configs, fits) -> list:
    """The configs ``fits`` accepts (the last one if none does); only the first without autotuning."""
    kept = [c for c in configs if fits(c)] or configs[-1:]
    return kept if autotuning() else kept[:1]


def divides_blocks(bm: int, bn: int, block_m: int, block_n: int) -> bool:
    """Whether a (bm, bn) tile serves a block mask of (block_m, block_n) blocks: each mask block
    is a whole number of tiles."""
    return block_m % bm == 0 and block_n % bn == 0


def sparse_tiles(configs, args) -> list:
    """With a block mask (SPARSE) only the tiles that divide its blocks; all otherwise."""
    if not args.get("SPARSE"):
        return configs
    bm, bn = args["SP_BM"], args["SP_BN"]
    return [c for c in configs if divides_blocks(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], bm, bn)]


def block_mask_tiles_ok(block_m: int, block_n: int) -> bool:
    """Whether every kernel (forward, both backwards) has a tile dividing a block mask's blocks."""
    lists = [[INTERPRETER_TILE]] if interpreting() else [FWD_TILES, BWD_TILES, BWD_JVP_TILES]
    return all(any(divides_blocks(t[0], t[1], block_m, block_n) for t in tiles) for tiles in lists)


def prune_fwd_configs(configs, named_args, **kwargs):
    """Forward tiles whose pipelined K/V (and tK/tV) buffers fit in shared memory and whose fp32
    accumulators fit in registers (with a block mask: of the tiles dividing its blocks)."""
    args = {**named_args, **kwargs}  # constexprs arrive as keyword arguments
    configs = sparse_tiles(configs, args)
    dqk, dv = args["BLOCK_DQK"], args["BLOCK_DV"]
    elt = args["Q"].element_size()  # q is a tensor on both paths
    n_tan_kv = int(args["HAS_TK"]) * dqk + int(args["HAS_TV"]) * dv
    jvp = args["HAS_TQ"] or args["HAS_TK"] or args["HAS_TV"]
    d64_jvp = jvp and elt == 2 and dqk == dv == 64 and not args["TMA"]

    d64_jvp = d64_jvp and any(tile_of(c) in FWD_JVP_D64_TILES for c in configs)

    def fits(c):
        bm, bn, warps, stages = tile_of(c)
        if d64_jvp:
            return (bm, bn, warps, stages) in FWD_JVP_D64_TILES
        smem = stages * bn * (dqk + dv + n_tan_kv) * elt + bm * dqk * elt * (2 if jvp else 1)
        acc_regs = bm * dv * (2 if jvp else 1) // (32 * warps)  # fp32 accumulators per thread
        return smem <= _SMEM_BYTES and acc_regs <= _ACC_REGS and not (jvp and bn > 64)

    return keep_fitting(configs, fits)


def prune_bwd_configs(configs, named_args, **kwargs):
    """Backward tiles whose streamed tiles fit in shared memory and whose fp32 accumulators (dK
    and dV per key block, dQ per query block) fit in registers."""
    args = {**named_args, **kwargs}
    configs = sparse_tiles(configs, args)
    d = args["BLOCK_DQK"] + args["BLOCK_DV"]
    elt = args["Q"].element_size()

    def fits(c):
        bm, bn, warps, stages = tile_of(c)
        smem = (stages + 1) * max(bm, bn) * d * elt
        return smem <= _SMEM_BYTES and max(bm, bn) * d // (32 * warps) <= _ACC_REGS

    return keep_fitting(configs, fits)


def prune_bwd_jvp_configs(configs, named_args, **kwargs):
    """Second-order backward tiles: dK, dtK, dV, dtV (or dQ, dtQ) and the key block's k, v, tk,
    tv tiles per program must fit in registers; the streamed q-side tiles in shared memory."""
    args = {**named_args, **kwargs}
    configs = sparse_tiles(configs, args)
    d = args["BLOCK_DQK"] + args["BLOCK_DV"]
    elt = args["Q"].element_size()

    def fits(c):
        bm, bn, warps, stages = tile_of(c)
        smem = (stages + 1) * max(bm, bn) * 2 * d * elt
        return smem <= _SMEM_BYTES and max(bm, bn) * 2 * d // (32 * warps) <= _ACC_REGS

    return keep_fitting(configs, fits)


# --------------------------------------------------------------------------- TMA


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def use_tma(tensors, *, kv_tangents: bool, head_dims: tuple[int, int], n_k: int) -> bool:
    """Whether the forward loads its tiles through tensor descriptors (``tensors``: the launch's
    inputs, ``None`` skipped, q first). ``auto`` takes them where they beat pointer loads on an
    H200: forward+JVP with a key or value tangent, 16-bit inputs, head dims (128, 128) and at least
    1024 keys, on Hopper. With tq alone the pointer path is faster (the extra tK/tV streams are
    what the TMA engine relieves)."""
    mode = tma_mode()
    if mode == "0":
        return False
    if mode == "auto":  # the cheap tests first: tma_usable reads every tensor's strides
        q = tensors[0]
        if not (kv_tangents and head_dims == (128, 128) and n_k >= 1024 and q.element_size() == 2
                and q.is_cuda and _is_hopper(q.device.index)):
            return False
    return tma_usable(tensors)


def tma_usable(tensors) -> bool:
    """Whether descriptors can address every tensor (``None`` skipped): unit stride along the head
    dim, 16-byte aligned base and other strides (TMA's rules). Either storage order works:
    (B, N, H, D) storage gives a descriptor whose head stride is below its sequence stride."""
    for x in tensors:
        if x is None:
            continue
        elt = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st * elt % 16 for st in x.stride()[:-1]):
            return False
    return True


# --------------------------------------------------------------------------- tail split
# A non-causal program over many keys runs about one per SM at a time, all for the same time, so
# a last wave holding only a few programs leaves most SMs idle. Those programs then run as key
# shards instead (the forward kernel's SPLIT mode), merged exactly by a second launch.

# A shard runs at least this many keys: shorter ones would spend more on the merge than they save.
SPLIT_MIN_KEYS = 512
# Key-length buckets from which launches split. With fewer keys each program is short, the last
# wave ragged rather than idle, and splitting measured no faster.
SPLIT_MIN_BUCKET = 16384


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Programs of the long-key tiles a device runs at once: one per SM; 0 off the GPU."""
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 0


def split_slots(q: torch.Tensor, *, causal: bool, n_k_bucket: int) -> int:
    """SMs to fill when the launch may split, else 0: never causal (row blocks differ in work),
    never below ``SPLIT_MIN_BUCKET``, never with ``FLASHJVP_TAIL_SPLIT=0``. Depends on the key
    bucket, not the length, so that it is constant per autotune key."""
    if causal or n_k_bucket < SPLIT_MIN_BUCKET or not tail_split_enabled():
        return 0
    return sm_count(q.device)


def split_plan(n_blocks: int, slots: int, n_k: int, *, block_m: int = 1,
               capacity: int | None = None) -> tuple[int, int]:
    """``(n_full, shards)`` for ``n_blocks`` row-block programs on ``slots`` SMs: the first
    ``n_full`` run whole, each later one as ``shards`` key shards (``shards == 1``: no split).
    Only a last wave at most half full splits. A split whose shards need more than ``capacity``
    scratch rows (``block_m`` each; None: unbounded) is dropped. The kernel recovers the plan
    from its grid size (``split_decode``)."""
    tail = n_blocks % slots if slots else 0
    if tail == 0 or 2 * tail > slots:
        return n_blocks, 1
    shards = min(slots // tail, n_k // SPLIT_MIN_KEYS)
    if shards < 2 or (capacity is not None and tail * shards * block_m > capacity):
        return n_blocks, 1
    return n_blocks - tail, shards


def split_grid(n_blocks: int, slots: int, n_k: int, *, block_m: int, capacity: int) -> int:
    """Programs launched for ``split_plan``: full blocks plus ``shards`` per tail block."""
    n_full, shards = split_plan(n_blocks, slots, n_k, block_m=block_m, capacity=capacity)
    return n_full + (n_blocks - n_full) * shards
