"""Block masks for ``block_mask=`` (docs/block_sparse.md): FlexAttention ``BlockMask`` objects
built with ``torch.nn.attention.flex_attention.create_block_mask``, for the masks video and
packed-sequence training needs. Any ``create_block_mask`` output is accepted as it is; these
helpers only spell the common ``mask_mod`` functions and prepare the masks for the kernels.

Token positions count from 0; ``frame(i) = i // frame_len``.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from flashjvp._sparse import plan_of

__all__ = ["prepare_block_mask", "frame_causal", "teacher_forcing", "document"]

DEFAULT_BLOCK = 128


def prepare_block_mask(block_mask: BlockMask) -> BlockMask:
    """Convert ``block_mask`` for the kernels now (its block lists and the bitmasks of its partial
    blocks, evaluated once from its ``mask_mod``) and keep the result on the mask; returns the
    same mask. The first ``attention`` call with a mask does this by itself; under
    ``torch.compile`` it must have happened before (the conversion reads data-dependent sizes)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a torch.nn.attention.flex_attention.BlockMask, "
                        f"got {type(block_mask).__name__}")
    plan_of(block_mask)
    return block_mask


def _check_len(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _build(mask_mod, n_q: int, n_k: int, batch, heads, device, block_size) -> BlockMask:
    bm = create_block_mask(mask_mod, batch, heads, n_q, n_k, device=device, BLOCK_SIZE=block_size)
    return prepare_block_mask(bm)


def frame_causal(n: int, frame_len: int, *, batch: int | None = None, heads: int | None = None,
                 device="cuda", block_size: int | tuple[int, int] = DEFAULT_BLOCK) -> BlockMask:
    """Block-causal attention by frames of ``frame_len`` tokens over ``n`` tokens (queries and
    keys): token ``i`` sees token ``j`` iff ``frame(j) <= frame(i)`` (every token of its own frame
    and of all earlier frames). ``frame_len`` need not be a multiple of the block size, nor
    ``n`` of ``frame_len`` (the last frame is then shorter). ``batch``/``heads``: None broadcasts
    the one mask over every batch element / head."""
    n, f = _check_len("n", n), _check_len("frame_len", frame_len)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx // f <= q_idx // f

    return _build(mask_mod, n, n, batch, heads, device, block_size)


def teacher_forcing(n_frames: int, frame_len: int, *, batch: int | None = None, heads: int | None = None,
                    device="cuda", block_size: int | tuple[int, int] = DEFAULT_BLOCK) -> BlockMask:
    """Teacher forcing for autoregressive video diffusion over ``2 * n_frames * frame_len`` tokens:
    the clean (context) frames 0 .. T-1 first, then the noisy frames 0 .. T-1 (``T = n_frames``),
    each ``frame_len`` tokens. With ``t`` a token's frame index within its half:

    * a clean token of frame ``t`` sees the clean tokens of frames ``<= t`` (frame-causal context);
    * a noisy token of frame ``t`` sees the clean tokens of frames ``< t`` (the true past, not its
      own clean frame) and the noisy tokens of its own frame ``t`` (bidirectionally), nothing else.
    """
    t, f = _check_len("n_frames", n_frames), _check_len("frame_len", frame_len)
    half = t * f

    def mask_mod(b, h, q_idx, kv_idx):
        q_noisy, k_noisy = q_idx >= half, kv_idx >= half
        qf, kf = (q_idx % half) // f, (kv_idx % half) // f
        clean_ctx = ~k_noisy & torch.where(q_noisy, kf < qf, kf <= qf)
        own_noisy = q_noisy & k_noisy & (kf == qf)
        return clean_ctx | own_noisy

    return _build(mask_mod, 2 * half, 2 * half, batch, heads, device, block_size)


def document(cu_seqlens: torch.Tensor, *, n: int | None = None, causal: bool = False, batch: int | None = None,
             heads: int | None = None, block_size: int | tuple[int, int] = DEFAULT_BLOCK) -> BlockMask:
    """Packed documents: ``cu_seqlens`` (D + 1,) integer offsets (flash-attn's convention) put
    document ``d`` at tokens ``cu_seqlens[d] : cu_seqlens[d + 1]``; token ``i`` sees token ``j``
    iff both are in the same document (and ``j <= i`` when ``causal``). ``n``: the sequence length,
    default ``cu_seqlens[-1]``; tokens past the last document see nothing (a row that sees no key
    gives zeros). The mask lives on ``cu_seqlens``' device."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 \
            or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens: expected an integer (D + 1,) tensor with D >= 1, got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else tuple(cu_seqlens.shape)}")
    offsets = cu_seqlens.long()
    total = int(offsets[-1])
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0, got {offsets.tolist()[:8]}")
    n = total if n is None else _check_len("n", n)
    if n < total:
        raise ValueError(f"n: expected at least cu_seqlens[-1] = {total}, got {n}")
    pos = torch.arange(n, device=offsets.device)
    doc = torch.searchsorted(offsets, pos, right=True) - 1  # (n,) document of each token; D past the end
    n_docs = offsets.shape[0] - 1

    def mask_mod(b, h, q_idx, kv_idx):
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] < n_docs)
        return same & (kv_idx <= q_idx) if causal else same

    return _build(mask_mod, n, n, batch, heads, offsets.device, block_size)
