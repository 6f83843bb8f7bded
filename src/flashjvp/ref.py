"""Plain PyTorch math attention: the reference every kernel is tested against.

``attention_ref`` is also the CPU fallback (when Triton's interpreter is off) and the path taken
under ``torch.func.vmap``, so it supports every feature of :func:`flashjvp.attention` and every
PyTorch transform (it is made of differentiable ``torch`` ops only).

Visibility: query row ``i`` sees key ``j`` iff all of

* ``j < kv_lens[b]`` (key padding, when ``kv_lens`` is given);
* ``j <= i + off + window_right`` when ``window_right >= 0`` (causal attention is ``window_right = 0``,
  whatever the window's right side);
* ``j >= i + off - window_left`` when ``window_left >= 0``;
* ``attn_mask[b, h, i, j]`` when a boolean ``attn_mask`` is given (a float one is added to the scaled logits);

with ``off = Nk - Nq`` for bottom-right alignment and ``0`` for top-left. The dense forms align top-left
unless ``causal="bottom_right"`` or ``align="bottom_right"``, and refuse a window with ``Nq != Nk`` that
names no alignment; the packed variable-length forms (flash-attn's convention) align bottom-right unless
``causal="top_left"`` or ``align="top_left"``, and apply the rule to each sequence with its own lengths
(docs/semantics.md). A row that sees no key gives ``o = 0``, ``lse = -inf``, ``mu = 0`` and zero gradients.
"""

from __future__ import annotations

import torch

from flashjvp._validate import AttnArgs, bhnd_view, check_inputs, check_varlen

__all__ = ["attention_ref", "attention_jvp_ref", "attention_varlen_ref", "attention_varlen_jvp_ref"]


def _jvp_with_lse(fn, q, k, v, tq, tk, tv, return_lse: bool):
    """``torch.func.jvp`` of ``fn(q, k, v) -> (o, lse)`` with missing tangents as zeros: ``(o, to)``
    or ``(o, to, lse, mu)``, ``mu = 0`` where ``lse = -inf``."""
    tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in ((q, tq), (k, tk), (v, tv)))
    (o, lse), (to, mu) = torch.func.jvp(fn, (q, k, v), tangents)
    mu = torch.where(torch.isinf(lse), torch.zeros_like(mu), mu)
    return (o, to, lse, mu) if return_lse else (o, to)


def _visible(a: AttnArgs, row0: int, rows: int, device) -> torch.Tensor | None:
    """Bool mask of visible keys for query rows row0 .. row0+rows-1, broadcastable to
    (B, H, rows, Nk), or None when every key is visible (see the module docstring for the rule)."""
    j = torch.arange(a.n_k, device=device)[None, :]
    diag = torch.arange(row0, row0 + rows, device=device)[:, None] + a.causal_offset  # (rows, 1)
    mask = None
    if a.window_right >= 0:
        mask = j <= diag + a.window_right  # (rows, Nk)
    if a.window_left >= 0:
        left = j >= diag - a.window_left
        mask = left if mask is None else mask & left
    if a.kv_lens is not None:
        keep = (j < a.kv_lens.to(device).long()[:, None])[:, None, None, :]  # (B, 1, 1, Nk)
        mask = keep if mask is None else mask & keep
    return mask


def _block_lse_attention(q, k, v, a: AttnArgs, row0: int):
    """Math attention for one block of query rows; q (B,Hq,rows,D), k/v (B,Hq,Nk,D)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * a.scale
    mask = _visible(a, row0, q.shape[-2], q.device)
    if a.mask is not None:  # (B, Hq, Nq, Nk) view: bool (True = attend) or float (added to the logits)
        user = a.mask[:, :, row0 : row0 + q.shape[-2]]
        if user.dtype == torch.bool:
            mask = user if mask is None else mask & user
        else:
            s = s + user.to(s.dtype)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    l_sum = e.sum(dim=-1, keepdim=True)
    empty = l_sum == 0
    l_safe = torch.where(empty, torch.ones_like(l_sum), l_sum)
    p = e / l_safe
    o = torch.matmul(p.to(v.dtype), v)
    lse = torch.where(empty, torch.full_like(l_sum, float("-inf")), m + torch.log(l_safe))
    return o, lse.squeeze(-1).float()


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    layout: str = "bhnd",
    return_lse: bool = False,
    block_q: int | None = None,
    kv_lens: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    attn_mask: torch.Tensor | None = None,
    align: str | None = None,
):
    """Attention in PyTorch math, in the dtype of the inputs; same contract as ``flashjvp.attention``.

    q (B, Hq, Nq, Dqk), k (B, Hkv, Nk, Dqk), v (B, Hkv, Nk, Dv) for ``layout="bhnd"`` ((B, N, H, D) for
    ``"bnhd"``), ``Hq % Hkv == 0``. Rows that see no key give ``o = 0`` and ``lse = -inf``. ``kv_lens`` (B,):
    keys ``j >= kv_lens[b]`` are padding, seen by no query of batch element ``b``. ``window = (left, right)``:
    query ``i`` sees keys ``i + off - left <= j <= i + off + right`` (``-1``: that side unbounded; causal
    sets ``right = 0``; ``off`` as in the module docstring). ``attn_mask`` broadcastable to (B, Hq, Nq, Nk)
    (logical order, whatever the layout), not requiring grad: bool (``True`` = attend) or float32 / q's dtype
    (added to the scaled logits). ``align`` as in ``flashjvp.attention``. ``block_q`` processes the query
    rows in blocks of that many, so memory stays O(block_q * Nk) per head instead of O(Nq * Nk).
    Returns ``o`` (B, Hq, Nq, Dv) in the layout of ``q``, or ``(o, lse)`` with ``lse`` (B, Hq, Nq) float32.
    Differentiable in every mode (reverse, forward, vmap).
    """
    a = check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, kv_lens=kv_lens, window=window,
                     attn_mask=attn_mask, align=align)
    qb, kb, vb = (bhnd_view(x, layout) for x in (q, k, v))
    if a.groups > 1:
        kb = kb.repeat_interleave(a.groups, dim=1)
        vb = vb.repeat_interleave(a.groups, dim=1)
    step = a.n_q if block_q is None else max(1, int(block_q))
    outs, lses = [], []
    for row0 in range(0, a.n_q, step):
        o, lse = _block_lse_attention(qb[:, :, row0 : row0 + step], kb, vb, a, row0)
        outs.append(o)
        lses.append(lse)
    o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    o = bhnd_view(o, layout)
    return (o, lse) if return_lse else o


def attention_jvp_ref(
    q, k, v, tq=None, tk=None, tv=None, *, causal=False, scale=None, layout="bhnd",
    return_lse=False, block_q=None, kv_lens=None, window=None, attn_mask=None, align=None,
):
    """``(o, to)`` (or ``(o, to, lse, mu)``) from ``torch.func.jvp`` of :func:`attention_ref`.

    Shapes as in :func:`attention_ref`; ``to`` has the shape of ``o``, ``mu`` that of ``lse`` (B, Hq, Nq)
    (``mu = 0`` where ``lse = -inf``). Missing tangents are zero. Computed in the dtype of the inputs.
    """

    def fn(q_, k_, v_):
        return attention_ref(q_, k_, v_, causal=causal, scale=scale, layout=layout,
                             return_lse=True, block_q=block_q, kv_lens=kv_lens, window=window, attn_mask=attn_mask,
                             align=align)

    return _jvp_with_lse(fn, q, k, v, tq, tk, tv, return_lse)


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    align: str | None = None,
):
    """Attention over a packed batch of variable-length sequences (flash-attn's varlen convention).

    q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv); ``cu_seqlens_q`` / ``cu_seqlens_k``
    int32 (B + 1,) offsets: sequence ``b`` is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``, no longer than ``max_seqlen_q`` / ``max_seqlen_k``. Each sequence
    is :func:`attention_ref` on its own (causal alignment and window use its own lengths: ``off = n_k - n_q``,
    flash-attn's bottom-right diagonal, unless ``causal="top_left"`` or ``align="top_left"``); a sequence
    with no key gives zero rows and ``lse = -inf``, one with no query gives nothing. Returns ``o``
    (total_q, Hq, Dv), or ``(o, lse)`` with ``lse`` (Hq, total_q) float32.
    Differentiable (reverse and forward mode).
    """
    a = check_varlen(q, k, v, None, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=causal, scale=scale, window=window, align=align, allow_float64=True)
    cu_q, cu_k = a.varlen.cu_q.tolist(), a.varlen.cu_k.tolist()
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zero rows, lse = -inf (still a function of q, so transforms see it)
            outs.append(q[q0:q1, :, :1].expand(-1, -1, a.d_v) * 0)
            lses.append(torch.full((a.h_q, q1 - q0), float("-inf"), device=q.device, dtype=torch.float32))
            continue
        o, lse = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=a.causal, scale=a.scale,
                               layout="bnhd", return_lse=True, block_q=block_q, window=window, align=a.diagonal)
        outs.append(o[0])
        lses.append(lse[0])
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=1) if len(lses) > 1 else lses[0]
    return (o, lse) if return_lse else o


def attention_varlen_jvp_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tq=None, tk=None, tv=None, *,
    causal=False, scale=None, window=None, return_lse=False, block_q=None, align=None,
):
    """``(o, to)`` (or ``(o, to, lse, mu)``) from ``torch.func.jvp`` of :func:`attention_varlen_ref`.

    o, to (total_q, Hq, Dv); lse, mu (Hq, total_q) float32 (``mu = 0`` where ``lse = -inf``).
    Missing tangents are zero. Computed in the dtype of the inputs.
    """
    check_varlen(q, k, v, tq, tk, tv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                 causal=causal, scale=scale, window=window, align=align, allow_float64=True)

    def fn(q_, k_, v_):
        return attention_varlen_ref(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal=causal, scale=scale, window=window, return_lse=True, block_q=block_q,
                                    align=align)

    return _jvp_with_lse(fn, q, k, v, tq, tk, tv, return_lse)
