"""``attn_implementation="fjvp"`` for Hugging Face transformers models.

:func:`register` adds flashjvp to transformers' ``AttentionInterface`` (the attention function)
and ``AttentionMaskInterface`` (the mask builder, transformers' own ``sdpa_mask``), after which
``AutoModel.from_config(config, attn_implementation="fjvp")`` or
``model.set_attn_implementation("fjvp")`` runs every attention layer on flashjvp's kernels:
fused forward + JVP under ``torch.func.jvp`` / ``forward_ad``, Triton backward.

The name is ``"fjvp"``, not ``"flashjvp"``: transformers treats every implementation whose name
contains ``"flash"`` as a flash-attn kernel to import (``is_flash_attention_requested``), and
refuses the model when none is found (seen with transformers 5.23).

transformers builds exactly the boolean mask it would build for ``"sdpa"`` (causal, padding,
packed sequences, sliding windows, model-specific patterns), so the result is always SDPA's. The
mask is then read once per forward (not per layer) to find the cheaper equivalent form:

* no mask (plain causal or full attention): ``flashjvp.attention`` with ``causal``;
* key padding (a 2-d ``attention_mask``, left or right padded): ``flashjvp.attention`` with
  ``kv_lens`` (right padding: padding blocks skipped) or a (B, 1, 1, Nk) key mask;
* packed sequences (several sequences in one row, marked by ``position_ids`` that restart at 0,
  as ``DataCollatorWithFlattening`` produces): ``flashjvp.attention_varlen``;
* flash-attention style ``cu_seq_lens_q`` / ``cu_seq_lens_k`` keyword arguments (batch 1):
  ``flashjvp.attention_varlen`` directly, with the module's ``sliding_window``;
* any other mask (sliding windows, image-token patterns, float masks): ``flashjvp.sdpa`` with
  the mask, read tile by tile by the kernels.

A fast path is taken only where the mask equals what that path computes (checked exactly), so
the choice never changes the result. The check is skipped under ``torch.compile`` and inside
``torch.func.vmap`` (the mask then goes to ``flashjvp.sdpa`` as it is). Dropout > 0 (training
mode with ``attention_dropout``) runs flashjvp.sdpa's math fallback, which warns once.
"""

from __future__ import annotations

import weakref

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flashjvp.integrations.transformers needs transformers "
                      "(pip install 'flashjvp[transformers]')") from e

import flashjvp
from flashjvp._validate import _plain as unwrap

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fjvp"

# id(mask) -> (weakref to the mask, weakref to position_ids or None, plan): one structure check
# per forward, since a model hands the same mask tensor to all of its layers.
_plans: dict[int, tuple] = {}
_MAX_PLANS = 16


def register(name: str = NAME) -> str:
    """Register flashjvp as transformers attention implementation ``name`` (default ``"fjvp"``)
    and return the name. Idempotent; tested with transformers 5.23.

    Usage::

        name = flashjvp.integrations.transformers.register()
        model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: name must be a non-empty str, got {name!r}")
    if "flash" in name or "sdpa" in name or "flex" in name:
        raise ValueError(f"register: name must not contain 'flash', 'sdpa' or 'flex' (transformers gives those "
                         f"substrings special meaning), got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _int(x) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _window(module, causal) -> tuple[int, int] | None:
    """The module's sliding window as flashjvp's ``window`` (transformers: a query sees the last
    ``sliding_window`` keys, itself included; both sides for bidirectional layers)."""
    sw = getattr(module, "sliding_window", None)
    if sw is None:
        return None
    return (sw - 1, 0) if causal else (sw - 1, sw - 1)


def _varlen(query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, window):
    """Packed attention on (B=1, H, total, D) tensors given their offsets; (1, total, H, Dv)."""
    if query.shape[0] != 1:
        raise ValueError("flashjvp attention: cu_seq_lens_q/cu_seq_lens_k describe one packed row, "
                         f"so the batch size must be 1, got {query.shape[0]}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (total, H, D) views
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_q if cu_k is None else cu_k.to(device=q.device, dtype=torch.int32)
    max_q = _int(max_q) if max_q is not None else _int((cu_q[1:] - cu_q[:-1]).max())
    max_k = _int(max_k) if max_k is not None else _int((cu_k[1:] - cu_k[:-1]).max())
    o = flashjvp.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal="bottom_right" if causal else False,
                                  scale=scale, window=window)
    return o.unsqueeze(0)


def _unwrapped(x):
    """A bool mask or integer positions without ``torch.func``'s grad/jvp wrappers (which wrap
    every tensor made inside them; these have no derivative), or None for anything else,
    vmap-batched tensors included."""
    if not isinstance(x, torch.Tensor):
        return None
    x = unwrap(x)
    return None if torch._C._functorch.is_functorch_wrapped_tensor(x) else x


def _padding_plan(m: torch.Tensor, nq: int, nk: int, batch: int):
    """For a (Bm, Nq, Nk) bool mask: ``("padding", causal, kv_lens, key_mask)`` where the mask is
    ``keep[b, j]`` (and bottom-right causal), else None."""
    keep = m.any(dim=1)  # (Bm, Nk): the keys some query sees
    tri = torch.ones(nq, nk, dtype=torch.bool, device=m.device).tril(nk - nq)
    if torch.equal(m, keep[:, None, :] & tri):
        causal = "bottom_right"
    elif torch.equal(m, keep[:, None, :].expand_as(m)):
        causal = False
    else:
        return None
    lens = keep.sum(dim=-1)
    if torch.equal(keep, torch.arange(nk, device=m.device) < lens[:, None]):  # right padding
        if bool((lens == nk).all()):
            return ("padding", causal, None, None)
        return ("padding", causal, lens.expand(batch).to(torch.int32).contiguous(), None)
    return ("padding", causal, None, keep[:, None, None, :])


def _packed_plan(m: torch.Tensor, position_ids: torch.Tensor, n: int, batch: int):
    """``("packed", cu_seqlens, max_seqlen)`` where the mask is causal attention within each run
    of ``position_ids`` that counts up by one (transformers' packed-sequence rule), else None."""
    pos = position_ids.to(m.device).expand(batch, n)
    seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # (B, N) sequence index
    if not bool((seq[:, -1] > 0).any()):
        return None  # one sequence per row
    tri = torch.ones(n, n, dtype=torch.bool, device=m.device).tril()
    if not torch.equal(m.expand(batch, n, n), (seq[:, :, None] == seq[:, None, :]) & tri):
        return None
    starts = torch.diff(seq, prepend=seq[:, :1] - 1, dim=-1) != 0  # (B, N): first token of a sequence
    idx = starts.flatten().nonzero().flatten()
    cu = torch.cat((idx, torch.tensor([batch * n], device=m.device))).to(torch.int32)
    return ("packed", cu, _int((cu[1:] - cu[:-1]).max()))


def _plan(mask, position_ids, nq: int, nk: int, batch: int):
    """How to run a 4-d mask: a padding or packed plan, or ``("dense",)``. Cached per mask."""
    key, mask, position_ids = id(mask), _unwrapped(mask), _unwrapped(position_ids)
    if (mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
            or mask.shape[0] not in (1, batch) or mask.shape[2:] != (nq, nk) or torch.compiler.is_compiling()
            or (mask.is_cuda and torch.cuda.is_current_stream_capturing())):
        return ("dense",)
    hit = _plans.get(key)
    if hit is not None and hit[0]() is mask and (hit[1] is None or hit[1]() is position_ids):
        return hit[2]
    m = mask[:, 0]
    plan = _padding_plan(m, nq, nk, batch)
    if plan is None and position_ids is not None and nq == nk and position_ids.shape[-1] == nq:
        plan = _packed_plan(m, position_ids, nq, batch)
    plan = plan or ("dense",)
    while len(_plans) >= _MAX_PLANS:
        _plans.pop(next(iter(_plans)))
    pos_ref = weakref.ref(position_ids) if plan[0] == "packed" else None
    _plans[key] = (weakref.ref(mask), pos_ref, plan)
    return plan


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function signature (that of ``sdpa_attention_forward``).

    Args:
        module: the attention layer (read: ``is_causal``, ``sliding_window``).
        query: (B, Hq, Nq, D); key: (B, Hkv, Nk, D); value: (B, Hkv, Nk, Dv); ``Hq % Hkv == 0``
            (GQA runs natively, without repeating the keys and values).
        attention_mask: None or the mask ``AttentionMaskInterface`` built (``sdpa_mask``: bool
            (B or 1, 1, Nq, Nk), True = attend), or a 4-d float/bool mask given by the caller.
        dropout: attention dropout probability (> 0: math fallback).
        scaling: softmax scale, default ``D ** -0.5``.
        is_causal: overrides ``module.is_causal`` (default True).
        kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k`` (packed batch
            of one row), ``position_ids`` (B or 1, N); other keys are ignored as in SDPA's path.

    Returns:
        ``(attn_output, None)`` with attn_output (B, Nq, Hq, Dv) contiguous.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError(f"flashjvp attention: softcap={kwargs['softcap']!r} is not supported (expected None)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashjvp attention: position_bias is not supported (expected None); "
                         "use attn_implementation='sdpa' for models with an additive position bias")
    if kwargs.get("cache") is not None:
        raise ValueError("flashjvp attention: paged attention caches are not supported (expected cache=None)")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, _, nq, _ = query.shape
    nk = key.shape[2]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if dropout:
            raise ValueError(f"flashjvp attention: dropout={dropout} is not supported with cu_seq_lens_q/k "
                             "(expected 0.0; put the model in eval mode or set attention_dropout=0)")
        if cu_q is None:
            raise ValueError("flashjvp attention: cu_seq_lens_k was given without cu_seq_lens_q")
        o = _varlen(query, key, value, cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"),
                    is_causal, scaling, _window(module, is_causal))
        return o.contiguous(), None

    if attention_mask is None:
        causal = nq > 1 and bool(is_causal)  # one query row: it sees every cached key
        if causal and nk > nq:  # prefill of an empty static cache: the keys past Nq are unused
            key, value = key[:, :, :nq], value[:, :, :nq]
        plan = ("padding", causal, None, None) if not dropout else ("dense",)
    else:
        plan = ("dense",) if dropout else _plan(attention_mask, kwargs.get("position_ids"), nq, nk, batch)

    qb, kb, vb = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, D) views
    if plan[0] == "padding":
        _, causal, kv_lens, key_mask = plan
        if key_mask is not None and key_mask.shape[0] != batch:
            key_mask = key_mask.expand(batch, -1, -1, -1)
        o = flashjvp.attention(qb, kb, vb, causal=causal, scale=scaling, layout="bnhd", kv_lens=kv_lens,
                               attn_mask=key_mask)
    elif plan[0] == "packed":
        _, cu, max_len = plan
        hq, hkv = query.shape[1], key.shape[1]
        packed = [x.reshape(batch * nq, h, x.shape[-1]) for x, h in ((qb, hq), (kb, hkv), (vb, hkv))]
        o = flashjvp.attention_varlen(*packed, cu, cu, max_len, max_len, causal=True, scale=scaling)
        o = o.reshape(batch, nq, hq, value.shape[-1])
    else:
        causal = attention_mask is None and nq > 1 and bool(is_causal)
        o = flashjvp.sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
                          scale=scaling, enable_gqa=query.shape[1] != key.shape[1]).transpose(1, 2)
    return o.contiguous(), None
