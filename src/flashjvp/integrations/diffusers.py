"""flashjvp in diffusers models: an attention backend for diffusers' attention dispatcher and an
attention processor for the older ``Attention`` blocks.

* :func:`register_backend` adds the backend ``"flashjvp"`` to diffusers' attention dispatcher,
  so that ``model.set_attention_backend("flashjvp")`` or ``with attention_backend("flashjvp"):``
  runs flashjvp in every processor that dispatches (Flux, Wan, QwenImage, HunyuanVideo, LTX, ...).
  It is registered as supporting context parallelism: under ``model.enable_parallelism(config=
  ContextParallelConfig(...))`` each call runs :mod:`flashjvp.distributed` on the config's device
  meshes (Ulysses, ring, or both), with tangents (:func:`enable_context_parallel_jvp` gives
  diffusers' output gather the forward-mode rule it lacks).
* :class:`FlashJVPAttnProcessor` is ``AttnProcessor2_0`` (the processor of ``Attention`` blocks
  that call ``F.scaled_dot_product_attention`` themselves: DiT, PixArt, UNet transformer blocks)
  with its SDPA call routed to :func:`flashjvp.sdpa`.
* :func:`apply` does both for a model: the backend where its processors dispatch, the processor
  where they are ``AttnProcessor2_0``.

Limitation of diffusers' registry (0.42): ``set_attention_backend`` accepts only members of the
enum ``AttentionBackendName``, which has no hook for new members, so :func:`register_backend`
adds the member ``FLASHJVP = "flashjvp"`` to that enum in place (the lookup tables
``_member_map_`` and ``_value2member_map_`` that ``Enum`` itself reads). If a diffusers release
changes that enum or the registry's ``register`` decorator, :func:`register_backend` raises a
``RuntimeError`` naming what it did not find, rather than registering half-way.
"""

from __future__ import annotations

import types
import warnings
from types import FunctionType

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    from diffusers.models import attention_dispatch
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flashjvp.integrations.diffusers needs diffusers (pip install 'flashjvp[diffusers]')") from e

import flashjvp

__all__ = ["register_backend", "FlashJVPAttnProcessor", "apply", "enable_context_parallel_jvp", "BACKEND"]

BACKEND = "flashjvp"


def _add_enum_member(enum_cls, name: str, value: str):
    """``enum_cls(value)``, adding the member ``name = value`` first if the enum lacks it."""
    if value in enum_cls._value2member_map_:
        return enum_cls(value)
    for attr in ("_member_map_", "_value2member_map_", "_member_names_"):
        if not hasattr(enum_cls, attr):
            raise RuntimeError(f"flashjvp: diffusers' {enum_cls.__name__} has no {attr}; cannot add the "
                               f"attention backend {value!r} to this version of diffusers")
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member._sort_order_ = len(enum_cls._member_names_)
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_names_.append(name)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    return member


def register_backend() -> str:
    """Register flashjvp in diffusers' attention dispatcher as ``"flashjvp"``, with context
    parallelism; returns the name. Idempotent. See the module docstring for how the name is
    added to ``AttentionBackendName``, and :func:`enable_context_parallel_jvp` (called here) for
    the forward-mode rule of diffusers' context-parallel output gather."""
    registry = attention_dispatch._AttentionBackendRegistry
    member = _add_enum_member(attention_dispatch.AttentionBackendName, BACKEND.upper(), BACKEND)
    if registry._backends.get(member) is not _flashjvp_attention:
        registry.register(member, constraints=[], supports_context_parallel=True)(_flashjvp_attention)
    enable_context_parallel_jvp()
    return BACKEND


class _AllGather(torch.autograd.Function):
    """diffusers' ``AllGatherFunction`` (the context-parallel output gather: every rank's shard
    concatenated along ``dim``; the gradient is this rank's chunk) with a forward-mode rule: the
    tangent is gathered the same way."""

    @staticmethod
    def forward(tensor, dim, group):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.group = inputs

    @staticmethod
    def jvp(ctx, tangent, *_):
        return _AllGather.apply(tangent, ctx.dim, ctx.group)

    @staticmethod
    def backward(ctx, grad):
        chunks = grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)
        return chunks[dist.get_rank(ctx.group)], None, None


def enable_context_parallel_jvp() -> None:
    """Give diffusers' context-parallel output gather a forward-mode rule, so that
    ``torch.func.jvp`` runs through a model under ``enable_parallelism``.

    diffusers (0.42) gathers a context-parallel model's output with
    ``diffusers.hooks.context_parallel.AllGatherFunction``, an ``autograd.Function`` without
    ``setup_context`` or ``jvp``: under ``torch.func.jvp`` it raises, whatever the attention
    backend. This replaces that module attribute (read by ``EquipartitionSharder.unshard`` at
    each call) by :class:`_AllGather`, which computes the same forward and backward. Idempotent;
    a diffusers without that attribute is left alone (its gather may then need the same fix).
    """
    from diffusers.hooks import context_parallel

    if hasattr(context_parallel, "AllGatherFunction"):
        context_parallel.AllGatherFunction = _AllGather


def _flashjvp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                        scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                        _parallel_config=None) -> torch.Tensor:
    """diffusers' backend signature. query (B, Nq, Hq, D), key (B, Nk, Hkv, D), value
    (B, Nk, Hkv, Dv) (the dispatcher's layout; ``Hq % Hkv == 0``); attn_mask None, or bool/float
    broadcastable to (B, Hq, Nq, Nk) as in SDPA. Returns (B, Nq, Hq, Dv). Under context
    parallelism the tensors are this rank's sequence shards and so is the result."""
    if return_lse:
        raise ValueError("flashjvp attention backend: return_lse=True is not supported (expected False)")
    if _parallel_config is not None and getattr(_parallel_config, "context_parallel_config", None) is not None:
        return _context_parallel(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 _parallel_config.context_parallel_config)
    if attn_mask is None and not dropout_p:
        return flashjvp.attention(query, key, value, causal=is_causal, scale=scale, layout="bnhd")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out = flashjvp.sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa or q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def _context_parallel(query, key, value, attn_mask, dropout_p, is_causal, scale, cp):
    """diffusers' ``ContextParallelConfig`` onto :mod:`flashjvp.distributed`: Ulysses over
    ``cp._ulysses_mesh``, ring over ``cp._ring_mesh``, or, with both degrees > 1, Ulysses's
    all-to-all over the Ulysses group around a ring over the ring group (diffusers' "unified"
    layout: the flattened (ring, ulysses) mesh holds consecutive sequence shards)."""
    from flashjvp import distributed as fd

    if attn_mask is not None:
        raise ValueError("flashjvp attention backend: attn_mask is not supported under context parallelism "
                         f"(expected None, got a tensor of shape {tuple(attn_mask.shape)})")
    if dropout_p:
        raise ValueError(f"flashjvp attention backend: dropout_p={dropout_p} is not supported under context "
                         "parallelism (expected 0.0)")
    if is_causal and cp.ring_degree > 1:
        raise ValueError("flashjvp attention backend: causal ring attention needs zig-zag shards "
                         "(flashjvp.distributed.zigzag_shard), which diffusers' sequence split does not make; "
                         "expected is_causal=False or ring_degree=1")
    for flag in ("ulysses_anything", "ring_anything"):
        if getattr(cp, flag, False):
            raise ValueError(f"flashjvp attention backend: ContextParallelConfig({flag}=True) (uneven shards) is "
                             "not supported (expected False): flashjvp.distributed needs equal shards")
    kw = dict(causal=is_causal, scale=scale, layout="bnhd")
    if cp.ring_degree == 1:
        return fd.ulysses_attention(query, key, value, group=cp._ulysses_mesh.get_group(), **kw)
    ring = cp._ring_mesh.get_group()
    if cp.ulysses_degree == 1:
        return fd.ring_attention(query, key, value, group=ring, **kw)
    ulysses = cp._ulysses_mesh.get_group()
    fd._check(query, key, value, (None, None, None), ulysses, "bnhd")
    q, k, v = (fd._Exchange.apply(x, ulysses, True) for x in (query, key, value))
    return fd._Exchange.apply(fd.ring_attention(q, k, v, group=ring, **kw), ulysses, False)


def _functional_with_flashjvp() -> types.ModuleType:
    """A module with the contents of ``torch.nn.functional``, its ``scaled_dot_product_attention``
    being :func:`flashjvp.sdpa`: the ``F`` that :class:`FlashJVPAttnProcessor`'s code sees."""
    functional = types.ModuleType("flashjvp.integrations.diffusers.F")
    functional.__dict__.update({k: v for k, v in vars(F).items() if not k.startswith("__")})
    functional.scaled_dot_product_attention = flashjvp.sdpa
    return functional


class FlashJVPAttnProcessor(AttnProcessor2_0):
    """diffusers' ``AttnProcessor2_0`` with its ``F.scaled_dot_product_attention`` call run by
    :func:`flashjvp.sdpa` (fused forward + JVP, Triton backward; masks in the kernels).

    Same call signature: ``(attn, hidden_states (B, N, C) or (B, C, H, W),
    encoder_hidden_states=None (B, M, C'), attention_mask=None, temb=None)``; returns a tensor
    of hidden_states' shape. Set it with ``model.set_attn_processor(FlashJVPAttnProcessor())``.

    Its ``__call__`` is ``AttnProcessor2_0.__call__``'s own code run with a ``F`` whose SDPA is
    :func:`flashjvp.sdpa`, not wrapped in :func:`flashjvp.patch_sdpa`: a ``TorchFunctionMode``
    would add Python to every torch call of the processor (its projections, reshapes, norms).
    """

    __call__ = FunctionType(AttnProcessor2_0.__call__.__code__,
                            {**AttnProcessor2_0.__call__.__globals__, "F": _functional_with_flashjvp()},
                            "__call__", AttnProcessor2_0.__call__.__defaults__,
                            AttnProcessor2_0.__call__.__closure__)
    __call__.__kwdefaults__ = AttnProcessor2_0.__call__.__kwdefaults__


def apply(model: torch.nn.Module) -> torch.nn.Module:
    """Run every attention layer of a diffusers ``model`` on flashjvp, in place; returns the model.

    Processors that dispatch (they have ``_attention_backend``) get the ``"flashjvp"`` backend
    (:func:`register_backend`; context parallelism included), ``AttnProcessor2_0`` is replaced by
    :class:`FlashJVPAttnProcessor`. Any other processor is left as it is, with a warning naming
    its class (wrap the call in :func:`flashjvp.patch_sdpa` if it calls PyTorch's SDPA).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"apply: model must be a torch.nn.Module, got {type(model).__name__}")
    dispatch_backend = attention_dispatch.AttentionBackendName(register_backend())
    other = set()
    for module in model.modules():
        if not isinstance(module, (Attention, AttentionModuleMixin)):
            continue
        processor = getattr(module, "processor", None)
        if hasattr(processor, "_attention_backend"):
            processor._attention_backend = dispatch_backend
        elif type(processor) is AttnProcessor2_0:
            module.set_processor(FlashJVPAttnProcessor())
        elif not isinstance(processor, FlashJVPAttnProcessor):
            other.add(type(processor).__name__)
    if other:
        warnings.warn(f"flashjvp.integrations.diffusers.apply: left the attention processors {sorted(other)} "
                      "unchanged (neither dispatching nor AttnProcessor2_0)", stacklevel=2)
    return model
