"""Plain PyTorch math attention: the reference every kernel is tested against.

``attention_ref`` is also the CPU fallback (when Triton's interpreter is off) and the path taken
under ``torch.func.vmap``, so it supports every feature of :func:`flashjvp.attention` and every
PyTorch transform (it is made of differentiable ``torch`` ops only).
"""

from __future__ import annotations

import torch

from flashjvp._validate import AttnArgs, check_inputs

__all__ = ["attention_ref", "attention_jvp_ref"]


def _to_bhnd(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    return x.transpose(1, 2) if (x is not None and layout == "bnhd") else x


def _visible(a: AttnArgs, row0: int, rows: int, device) -> torch.Tensor | None:
    """Bool mask of visible keys for query rows row0 .. row0+rows-1, broadcastable to
    (B, H, rows, Nk), or None when every key is visible."""
    j = torch.arange(a.n_k, device=device)
    mask = None
    if a.causal is not None:
        i = torch.arange(row0, row0 + rows, device=device)[:, None]
        mask = j[None, :] <= i + a.causal_offset  # (rows, Nk)
    if a.kv_lens is not None:
        keep = (j[None, :] < a.kv_lens.to(device).long()[:, None])[:, None, None, :]  # (B, 1, 1, Nk)
        mask = keep if mask is None else mask & keep
    return mask


def _block_lse_attention(q, k, v, a: AttnArgs, row0: int):
    """Math attention for one block of query rows; q (B,Hq,rows,D), k/v (B,Hq,Nk,D)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * a.scale
    mask = _visible(a, row0, q.shape[-2], q.device)
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
):
    """Attention in PyTorch math, in the dtype of the inputs; same contract as ``flashjvp.attention``.

    Rows that see no key give ``o = 0`` and ``lse = -inf``. ``kv_lens`` (B,): keys
    ``j >= kv_lens[b]`` are padding, seen by no query of batch element ``b``. ``block_q`` processes the query rows in
    blocks of that many, so memory stays O(block_q * Nk) per head instead of O(Nq * Nk).
    Returns ``o`` in the layout of ``q``, or ``(o, lse)`` with ``lse`` (B, Hq, Nq) float32.
    Differentiable in every mode (reverse, forward, vmap).
    """
    a = check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, kv_lens=kv_lens)
    qb, kb, vb = (_to_bhnd(x, layout) for x in (q, k, v))
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
    o = _to_bhnd(o, layout)
    return (o, lse) if return_lse else o


def attention_jvp_ref(
    q, k, v, tq=None, tk=None, tv=None, *, causal=False, scale=None, layout="bhnd",
    return_lse=False, block_q=None, kv_lens=None,
):
    """``(o, to)`` (or ``(o, to, lse, mu)``) from ``torch.func.jvp`` of :func:`attention_ref`.

    Missing tangents are zero. Computed in the dtype of the inputs.
    """
    tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in ((q, tq), (k, tk), (v, tv)))

    def fn(q_, k_, v_):
        return attention_ref(q_, k_, v_, causal=causal, scale=scale, layout=layout,
                             return_lse=True, block_q=block_q, kv_lens=kv_lens)

    (o, lse), (to, mu) = torch.func.jvp(fn, (q, k, v), tangents)
    mu = torch.where(torch.isinf(lse), torch.zeros_like(mu), mu)
    return (o, to, lse, mu) if return_lse else (o, to)




