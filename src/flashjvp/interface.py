"""Public entry points: ``attention`` and ``attention_jvp`` for (B, H, N, D) batches, and
``attention_varlen`` and ``attention_varlen_jvp`` for packed variable-length batches."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import temporarily_pop_interpreter_stack

from flashjvp._autograd import AttentionFunction, AttentionJVPFunction
from flashjvp._backends import route_of, run_fwd
from flashjvp._cudnn import strides_ok
from flashjvp._fwd import attn_fwd
from flashjvp._ops import attn_fwd_jvp_op, attn_fwd_op, options
from flashjvp._plan import checked_args, jvp_plan, plain_plan, signature
from flashjvp._policy import interpreting
from flashjvp._route import (
    CUDNN,
    FLASH,
    SIZE_PREDICATES,
    choose,
    device_of,
    option_names,
    representative,
    switch_values,
    switches,
    torch_choice,
)
from flashjvp._sparse import dense_mask
from flashjvp._validate import AttnArgs, bhnd_view, check_inputs, check_varlen
from flashjvp.ref import attention_jvp_ref, attention_ref, attention_varlen_jvp_ref, attention_varlen_ref

__all__ = ["attention", "attention_jvp", "attention_varlen", "attention_varlen_jvp"]

# PyTorch's SDPA, captured at import (flashjvp.sdpa's patch may rebind the public name).
_sdpa = torch._C._nn.scaled_dot_product_attention

# CPU fallback without the interpreter: query rows per block, so memory stays O(block * Nk).
_CPU_BLOCK_Q = 256


def _use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and interpreting())


def _transforms() -> list:
    """The active ``torch.func`` transforms, innermost last (empty outside them)."""
    return torch._C._functorch.get_interpreter_stack() or []


def _needs_math_path(stack: list) -> bool:
    """``torch.func.vmap`` (and so ``jacfwd``) and nested forward transforms run the math
    reference: the Triton launch is neither batchable nor differentiable to second order."""
    keys = [i.key() for i in stack]
    return TransformType.Vmap in keys or keys.count(TransformType.Jvp) > 1


def _plain(stack: list, *xs: torch.Tensor) -> bool:
    """No autograd graph to record, no forward-AD level and no ``torch.func`` transform: the
    launcher can run without an ``autograd.Function``, whose ``apply`` costs about as much
    Python as the rest of a call (it binds its arguments with ``inspect.Signature.bind``)."""
    return not (stack or _forward_ad_active() or _needs_grad(*xs))


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _has_tangent(x: torch.Tensor) -> bool:
    return fwAD.unpack_dual(x).tangent is not None


def _forward_ad_active() -> bool:
    """A forward-AD level is open (``torch.func.jvp`` opens one too). Unlike the functorch
    interpreter stack, Dynamo can read this while it traces."""
    return fwAD._current_level >= 0


def _cpu_block(q: torch.Tensor) -> int | None:
    return None if q.is_cuda else _CPU_BLOCK_Q


def _ref(q, k, v, tq, tk, tv, a: AttnArgs, *, jvp: bool):
    """The math reference for the call ``a`` on the kernels' 4-d tensors: ``o``, or
    ``(o, to, lse, mu)`` when ``jvp`` (the CPU fallback, and the path under vmap)."""
    kw = dict(causal=a.causal, scale=a.scale, window=a.window, align=a.diagonal)
    if a.varlen is not None:  # the (1, total, H, D) views back to the packed (total, H, D) tensors
        vl = a.varlen
        sq = [None if x is None else x.squeeze(0) for x in (q, k, v, tq, tk, tv)]
        packed = (vl.cu_q, vl.cu_k, vl.max_q, vl.max_k)
        if not jvp:
            return attention_varlen_ref(*sq[:3], *packed, **kw).unsqueeze(0)
        o, to, lse, mu = attention_varlen_jvp_ref(*sq[:3], *packed, *sq[3:], return_lse=True, **kw)
        return o.unsqueeze(0), to.unsqueeze(0), lse.unsqueeze(0), mu.unsqueeze(0)
    mask = a.mask if a.sparse is None else dense_mask(a.sparse)
    kw.update(layout=a.layout, block_q=_cpu_block(q), kv_lens=a.kv_lens, attn_mask=mask)
    if not jvp:
        return attention_ref(q, k, v, **kw)
    return attention_jvp_ref(q, k, v, tq, tk, tv, return_lse=True, **kw)


def _single_jvp_level(stack: list) -> int | None:
    """The level of the one ``torch.func.jvp`` transform when it is the only transform active."""
    if len(stack) == 1 and stack[0].key() == TransformType.Jvp:
        return stack[0].level()
    return None


def _attention_at_jvp_level(q, k, v, a: AttnArgs, level: int) -> torch.Tensor:
    """``attention`` inside one ``torch.func.jvp`` (and no other transform): its inputs' primals and
    tangents unwrapped from the transform's level, the fused kernel run on the plain tensors
    outside it (with reverse-mode autograd recorded where the plain tensors need it: the MeanFlow
    and sCM steps differentiate ``o`` and ``to``), and ``o`` wrapped back with ``to`` as its
    tangent. This is what functorch does for any ``autograd.Function`` with a ``jvp`` rule, less
    its generic machinery (a new Function class per call, pytree flattening, signature binding),
    which costs several times a short launch."""
    unwrap, wrap = torch._C._functorch._unwrap_for_grad, torch._C._functorch._wrap_for_grad
    dual = fwAD._current_level  # torch.func.jvp's forward-AD level (its public helpers cost microseconds)
    parts = [torch._VF._unpack_dual(x, level=dual) for x in (q, k, v)]
    q0, k0, v0 = (unwrap(p, level) for p, _ in parts)
    tq, tk, tv = (None if t is None else unwrap(t, level) for _, t in parts)
    with temporarily_pop_interpreter_stack():
        grad = _needs_grad(q0, k0, v0, tq, tk, tv)
        tangents = tq is not None or tk is not None or tv is not None
        route = _route(q0, k0, v0, a, tangents, grad)
        if not tangents:
            o = (AttentionFunction.apply(q0, k0, v0, a, False, route) if grad else
                 run_fwd(q0, k0, v0, a, route.fwd, need_lse=False))[0]
            return wrap(o, level)
        if grad:
            o, to, _, _ = AttentionJVPFunction.apply(q0, k0, v0, tq, tk, tv, a, True, route)
        else:
            o, to, _, _ = attn_fwd(q0, k0, v0, tq, tk, tv, a)
    return torch._VF._make_dual(wrap(o, level), wrap(to, level), level=dual)


def _route(q, k, v, a: AttnArgs, tangents: bool, grad: bool):
    """The route of a call served outside an eager plan: flashjvp's autograd runs its backward."""
    return route_of(q, k, v, a, tangents=tangents, grad=grad, in_function=True)


# The kernel paths of ``attention`` and ``attention_jvp`` outside a graph: eager calls, and the
# calls a compiled graph leaves to them (forward-mode AD, see _ops.py). Opaque to Dynamo, so that
# a frame it falls back on never has the launchers' Python traced.
@torch.compiler.disable
def _attention_kernels(q, k, v, a: AttnArgs) -> torch.Tensor:
    stack = _transforms()
    if (level := _single_jvp_level(stack)) is not None:
        return _attention_at_jvp_level(q, k, v, a, level)
    if _needs_math_path(stack):
        return _ref(q, k, v, None, None, None, a, jvp=False)
    if _plain(stack, q, k, v):  # no backward can follow: the lse is not needed
        return run_fwd(q, k, v, a, _route(q, k, v, a, False, False).fwd, need_lse=False)[0]
    defer = _has_tangent(q) or _has_tangent(k) or _has_tangent(v)
    return AttentionFunction.apply(q, k, v, a, defer, _route(q, k, v, a, defer, True))[0]


@torch.compiler.disable
def _attention_jvp_kernels(q, k, v, tq, tk, tv, a: AttnArgs, return_lse: bool):
    stack = _transforms()
    if _needs_math_path(stack):
        return _ref(q, k, v, tq, tk, tv, a, jvp=True)
    if _plain(stack, q, k, v, tq, tk, tv):
        return attn_fwd(q, k, v, tq, tk, tv, a, store_mu=return_lse)
    route = _route(q, k, v, a, True, True)
    return AttentionJVPFunction.apply(q, k, v, tq, tk, tv, a, True, route)  # mu: for the backward


def _level_opened_outside() -> bool:
    """Whether the forward-AD level was already open when Dynamo began the frame it traces (dual
    tensors passed in, or ``torch.func.jvp`` of a compiled function): their tangents are then
    invisible to the trace. True where Dynamo's state cannot be read (the safe answer)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().output.dual_level >= 0
    except Exception:  # noqa: BLE001 - private state of another PyTorch version
        return True


@torch.compiler.assume_constant_result
def _dual_in_graph() -> bool:
    """Whether ``attention`` traced with a forward-AD level open can write its forward-mode rule
    into the graph: the level was opened inside the traced function (``torch.func.jvp`` or a
    ``forward_ad`` dual level there) and is the only transform a tangent can come from (neither
    ``vmap`` nor a second ``jvp`` around it). Evaluated while Dynamo traces, which runs the
    transforms the function contains and guards on the dual level and the transforms around it."""
    return not _level_opened_outside() and not _needs_math_path(_transforms())


def _attention_dual(q, k, v, a: AttnArgs) -> torch.Tensor:
    """``attention`` traced by Dynamo with one forward-AD level open: the forward-mode rule written
    out in the graph, so that the fused ``fwd_jvp`` operator runs inside it. The operators have no
    forward-mode rule of their own (PyTorch has no way to register one), so they are called on the
    primals and tangents taken apart with ``unpack_dual``, and ``o`` is put together with ``to``
    by ``make_dual``; their ``register_autograd`` rules differentiate both (MeanFlow, sCM)."""
    (q0, tq), (k0, tk), (v0, tv) = (fwAD.unpack_dual(x) for x in (q, k, v))
    if tq is None and tk is None and tv is None:  # nothing to carry at this level
        return attn_fwd_op(q0, k0, v0, *options(a))[0]
    o, to, _, _ = attn_fwd_jvp_op(q0, k0, v0, tq, tk, tv, *options(a))
    return fwAD.make_dual(o, to)


def _traced_call(q, k, v, a: AttnArgs) -> tuple:
    """What routing reads of a plain call Dynamo traces, as constants (``_sdpa_in_graph``'s argument).
    Sizes and strides may be symbolic (dynamic shapes), so only the predicates the rule reads of
    them are taken (``_route.SIZE_PREDICATES``), each a guard of the graph."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    options = option_names(a)
    sizes = tuple(_bit(test(a)) for test in SIZE_PREDICATES)
    addressable = _bit(strides_ok(q, pointer=False) and strides_ok(k, pointer=False) and strides_ok(v, pointer=False))
    return q.dtype, a.causal, options, sizes, addressable, grad, q.device.type, q.device.index


def _bit(value) -> bool:
    """A Python bool of a possibly symbolic condition (Dynamo guards on it)."""
    return True if value else False  # noqa: SIM210


@torch.compiler.assume_constant_result
def _sdpa_in_graph(traced: tuple) -> bool:
    """Whether the rule routes a traced plain call to the backend PyTorch's SDPA itself would pick
    (cuDNN or flash attention): evaluated once while Dynamo traces, like SDPA's own choice, on a
    call with the traced one's predicates (``_route.representative``)."""
    dtype, causal, options, sizes, addressable, grad, device_type, device_index = traced
    call = representative(dtype, causal, frozenset(options), sizes, addressable, grad)
    dev = device_of(torch.device(device_type, device_index) if device_index is not None else torch.device(device_type))
    sw = switches(switch_values())
    route = choose(call, dev, sw)  # FLASHJVP_CUDNN=always/never: flashjvp's own operators, as in eager
    return sw.mode == "auto" and route.fwd in (CUDNN, FLASH) and route.fwd == torch_choice(call, dev, sw)


def _torch_sdpa(q, k, v, a: AttnArgs) -> torch.Tensor:
    """``o`` of PyTorch's SDPA for a plain call (traced into the graph): ``o`` in q's order of
    dimensions where ``a.out_like_q`` (sdpa's contract), else contiguous in the call's layout."""
    qb, kb, vb = bhnd_view(q, a.layout), bhnd_view(k, a.layout), bhnd_view(v, a.layout)
    o = bhnd_view(_sdpa(qb, kb, vb, is_causal=a.causal is not None, scale=a.scale), a.layout)
    return o if a.out_like_q else o.contiguous()


def _attention(q, k, v, a: AttnArgs) -> torch.Tensor:
    """``attention`` on validated 4-d tensors (packed batches: their (1, total, H, D) views)."""
    if not _use_kernels(q):
        return _ref(q, k, v, None, None, None, a, jvp=False)
    # In a graph, a plain call that PyTorch's SDPA would serve with cuDNN or flash attention (the
    # rule's answer for the traced sizes and strides) is PyTorch's SDPA, so the compiled step does
    # the same graph work as F.scaled_dot_product_attention; other plain calls are flashjvp's
    # operator, which runs the route of the real tensors (_ops.py).
    if torch.compiler.is_compiling() and not _forward_ad_active():
        if _sdpa_in_graph(_traced_call(q, k, v, a)):
            return _torch_sdpa(q, k, v, a)
        return attn_fwd_op(q, k, v, *options(a))[0]
    if torch.compiler.is_compiling() and _dual_in_graph():  # a forward-AD level open: its rule in the graph
        return _attention_dual(q, k, v, a)
    return _attention_kernels(q, k, v, a)


def _attention_jvp(q, k, v, tq, tk, tv, a: AttnArgs, return_lse: bool):
    """``attention_jvp`` on validated 4-d tensors: ``(o, to, lse, mu)``, zeros for a missing
    ``to``; ``mu`` is None unless ``return_lse``."""
    if not _use_kernels(q):
        o, to, lse, mu = _ref(q, k, v, tq, tk, tv, a, jvp=True)
    elif torch.compiler.is_compiling() and not _forward_ad_active():  # in the graph (_ops.py)
        o, to, lse, mu = attn_fwd_jvp_op(q, k, v, tq, tk, tv, *options(a))
    else:
        o, to, lse, mu = _attention_jvp_kernels(q, k, v, tq, tk, tv, a, return_lse)
    if to is None:  # no tangent at all
        to = torch.zeros_like(o)
    if return_lse and mu is None:
        mu = torch.zeros_like(lse)
    return o, to, lse, mu


def attention(q, k, v, *, causal=False, scale=None, layout="bhnd", kv_lens=None, window=None, attn_mask=None,
              align=None, block_mask=None):
    """Scaled dot-product attention ``softmax(scale * q @ k^T) @ v`` (FlashAttention).

    Args:
        q: (B, Hq, Nq, Dqk) for ``layout="bhnd"``, (B, Nq, Hq, Dqk) for ``"bnhd"``.
        k: (B, Hkv, Nk, Dqk) / (B, Nk, Hkv, Dqk); ``Hq % Hkv == 0`` (GQA/MQA: query head ``h``
            uses kv head ``h // (Hq // Hkv)``).
        v: (B, Hkv, Nk, Dv) / (B, Nk, Hkv, Dv).
            Any strides (each tensor its own); float16, bfloat16 or float32, all the same dtype;
            ``1 <= Dqk, Dv <= 256``; any ``Nq, Nk >= 1``.
        causal: ``False``; ``True`` or ``"top_left"`` (PyTorch SDPA: query i sees keys j <= i);
            ``"bottom_right"`` (flash-attn: query i sees keys j <= i + Nk - Nq). A row that sees
            no key gives zeros.
        scale: softmax scale, default ``Dqk ** -0.5``.
        layout: ``"bhnd"`` or ``"bnhd"``; the output uses the same one.
        kv_lens: key padding, an integer (B,) tensor on q's device: batch element ``b`` has
            ``kv_lens[b]`` valid keys, the rest of its keys and values are padding that no query
            sees (values outside [0, Nk] are clamped). Causal alignment counts all Nk keys.
        window: sliding window ``(left, right)`` (flash-attn's ``window_size``; -1 = unbounded):
            query i sees keys ``i + d - left <= j <= i + d + right``, where the diagonal ``d`` is
            ``Nk - Nq`` for bottom-right alignment and 0 for top-left. With ``causal`` the right
            side is 0. Key blocks outside every row's window are skipped.
        attn_mask: a bool (True = attend) or float (added to the scaled logits; float32 or q's
            dtype) tensor broadcastable to (B, Hq, Nq, Nk), as in PyTorch SDPA; read tile by tile,
            never expanded (a (B, 1, 1, Nk) mask costs one key vector per tile). It takes no
            gradient and no tangent (one that requires grad is refused).
        align: the diagonal ``causal`` and ``window`` are measured from, ``"top_left"`` or
            ``"bottom_right"``; ``None``: the one ``causal`` names, else top-left. A window with
            ``Nq != Nk`` must name one (``align`` or a ``causal`` string): PyTorch and flash-attn
            differ there, so ``ValueError`` rather than a guess (docs/semantics.md).
        block_mask: a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``,
            its (B, H) 1 or those of q, Q_LEN = Nq, KV_LEN = Nk, block sizes multiples of 32; 128 is
            the default): full blocks run unmasked, empty ones are skipped, partial ones apply its
            ``mask_mod`` (evaluated once per mask into a bitmask per partial block, kept on the mask).
            Not combined with ``causal``, ``window``, ``attn_mask`` or ``kv_lens``; see
            docs/block_sparse.md and ``flashjvp.block_masks``.

    Returns:
        o: (B, Hq, Nq, Dv) / (B, Nq, Hq, Dv), dtype of q.

    Differentiable (Triton backward) and forward-differentiable: under ``torch.func.jvp`` or
    ``torch.autograd.forward_ad`` ``o`` and its tangent come from one fused kernel launch.
    """
    if kv_lens is None and window is None and attn_mask is None and block_mask is None:  # plain calls: a cached plan
        plan = plain_plan(q, k, v, causal, scale, layout,
                          lambda: check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False,
                                               align=align), tag=align)
        if plan is not None and (o := plan(q, k, v)) is not None:
            return o
        a = checked_args(lambda: ("attention", signature(q, k, v), causal, scale, layout, align),
                         lambda: check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False,
                                              align=align))
        return _attention(q, k, v, a)
    a = check_inputs(q, k, v, causal=causal, scale=scale, layout=layout, allow_float64=False, kv_lens=kv_lens,
                     window=window, attn_mask=attn_mask, align=align, block_mask=block_mask)
    return _attention(q, k, v, a)


def attention_jvp(q, k, v, tq=None, tk=None, tv=None, *, causal=False, scale=None,
                  layout="bhnd", return_lse=False, kv_lens=None, window=None, attn_mask=None, align=None,
                  block_mask=None):
    """Attention and its forward-mode derivative in one fused kernel launch.

    Args:
        q, k, v, causal, scale, layout, kv_lens, window, attn_mask, align, block_mask: as in :func:`attention`.
        tq, tk, tv: tangents with the shapes and dtypes of q, k, v (strides may differ);
            ``None`` means zero, and the matrix products it would feed are skipped.
        return_lse: also return ``lse`` and its tangent ``mu``.

    Returns:
        ``(o, to)``, or ``(o, to, lse, mu)`` with ``lse, mu`` (B, Hq, Nq) float32
        (``lse = -inf``, ``mu = 0`` for rows that see no key). ``o`` and ``to`` have o's layout.

    Every output is differentiable with respect to q, k, v and the given tangents (Triton
    backward kernels; through ``to``, ``lse`` or ``mu`` this is the second-order backward).
    """
    if kv_lens is None and window is None and attn_mask is None and block_mask is None:  # a cached plan
        plan = jvp_plan(q, k, v, tq, tk, tv, causal, scale, layout, align, return_lse,
                        lambda: check_inputs(q, k, v, tq, tk, tv, causal=causal, scale=scale, layout=layout,
                                             allow_float64=False, align=align))
        if plan is not None:
            o, to, lse, mu = plan(q, k, v, tq, tk, tv)
            return (o, to, lse, mu) if return_lse else (o, to)
        a = checked_args(lambda: ("attention_jvp", signature(q, k, v, tq, tk, tv), causal, scale, layout, align),
                         lambda: check_inputs(q, k, v, tq, tk, tv, causal=causal, scale=scale, layout=layout,
                                              allow_float64=False, align=align))
        o, to, lse, mu = _attention_jvp(q, k, v, tq, tk, tv, a, return_lse)
        return (o, to, lse, mu) if return_lse else (o, to)
    a = check_inputs(q, k, v, tq, tk, tv, causal=causal, scale=scale, layout=layout,
                     allow_float64=False, kv_lens=kv_lens, window=window, attn_mask=attn_mask, align=align,
                     block_mask=block_mask)
    o, to, lse, mu = _attention_jvp(q, k, v, tq, tk, tv, a, return_lse)
    return (o, to, lse, mu) if return_lse else (o, to)


def _unsqueeze(*xs):
    return [None if x is None else x.unsqueeze(0) for x in xs]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, scale=None, window=None, align=None):
    """Attention over a packed batch of variable-length sequences (flash-attn's
    ``flash_attn_varlen_func`` convention).

    Args:
        q: (total_q, Hq, Dqk), the queries of all sequences one after another.
        k: (total_k, Hkv, Dqk); v: (total_k, Hkv, Dv). Strides, dtypes, heads and GQA as in
            :func:`attention`.
        cu_seqlens_q, cu_seqlens_k: int32 (B + 1,) offsets on q's device: sequence ``b`` has the
            query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and the keys
            ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; sequences of length 0 are allowed. They are read
            back once per call to check them (not under torch.compile or CUDA graph capture).
        max_seqlen_q, max_seqlen_k: ints, at least the longest query / key sequence.
        causal, scale, window: as in :func:`attention`, per sequence, but aligned as flash-attn
            aligns them: ``causal=True`` and windows are measured from each sequence's bottom-right
            diagonal (query i sees keys j <= i + nk - nq), using its own lengths.
        align: ``None`` or ``"bottom_right"`` (flash-attn's convention), or ``"top_left"``
            (PyTorch's; as ``causal="top_left"``) for causal masking and windows.

    Returns:
        o: (total_q, Hq, Dv), dtype of q; rows of a sequence without keys are zeros.

    Differentiable and forward-differentiable like :func:`attention`.
    """
    a = check_varlen(q, k, v, None, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=causal, scale=scale, window=window, align=align, allow_float64=False)
    return _attention(*_unsqueeze(q, k, v), a).squeeze(0)


def attention_varlen_jvp(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         tq=None, tk=None, tv=None, *, causal=False, scale=None, window=None, return_lse=False,
                         align=None):
    """:func:`attention_varlen` and its forward-mode derivative in one fused kernel launch.

    Args:
        as :func:`attention_varlen`; tq, tk, tv: tangents shaped like q, k, v, or None (zero).

    Returns:
        ``(o, to)``, or ``(o, to, lse, mu)`` with ``lse, mu`` (Hq, total_q) float32.
        Every output is differentiable, as in :func:`attention_jvp`.
    """
    a = check_varlen(q, k, v, tq, tk, tv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=causal, scale=scale, window=window, align=align, allow_float64=False)
    o, to, lse, mu = _attention_jvp(*_unsqueeze(q, k, v, tq, tk, tv), a, return_lse)
    if return_lse:
        return o.squeeze(0), to.squeeze(0), lse.squeeze(0), mu.squeeze(0)
    return o.squeeze(0), to.squeeze(0)
