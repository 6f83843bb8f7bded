"""Block masks (``block_mask=``, FlexAttention's ``BlockMask``): forward+JVP, backward and the
second-order backward against the float64 reference given the same mask dense (``attn_mask``), on
masks from ``create_block_mask`` and from ``flashjvp.block_masks``; GQA, B/H broadcast, both
layouts, mixed memory layouts, fully masked rows, torch.compile, and the errors."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

import flashjvp
from flashjvp import block_masks
from flashjvp._launch import LaunchLog
from helpers import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_GPU,
    assert_close,
    check_second_order,
    grad_refs,
    jvp_refs,
    make_qkv,
)

# The interpreter runs 16 x 16 tiles: masks of 16- or 32-blocks; the GPU uses FlexAttention's 128.
BLOCK = 128 if ON_GPU else 16


def _frame_causal(frame):
    return lambda b, h, q, k: k // frame <= q // frame


def _dense(bm, nq, nk):
    """The bool (B or 1, H or 1, Nq, Nk) mask of ``bm``'s mask_mod (FlexAttention's create_mask)."""
    b, h = bm.kv_num_blocks.shape[:2]
    return create_mask(bm.mask_mod, b, h, nq, nk, device=DEVICE)


def _plan_dense(bm):
    """The bool (B or 1, H or 1, Nq, Nk) mask the kernels' plan of ``bm`` stands for."""
    return flashjvp._sparse.dense_mask(flashjvp._sparse.plan_of(bm))


def _mods(nq, nk):
    """mask_mods by name; 'holes' has rows that see no key, per head and batch element; 'stripes'
    leaves every third key block out, so that full blocks are not consecutive (the kernels' block
    lists; frame-causal's and band's full blocks are consecutive: the unmasked loops run without
    the list)."""
    def holes(b, h, q, k):
        return ((q + 2 * k + b + h) % 5 != 0) & (q % 7 != 3) & (k <= q + 4)

    def stripes(b, h, q, k):
        return ((k // BLOCK) % 3 != 1) & (k <= q + BLOCK // 2)

    def band(b, h, q, k):  # consecutive full blocks that start past the first
        return (k <= q) & (q - k < 3 * BLOCK + 5)
    return {"frame-causal": _frame_causal(13), "holes": holes, "stripes": stripes, "band": band}


# (B, Hq, Hkv, Nq, Nk, Dqk, Dv, layout, mask, (mask B, mask H), BLOCK_SIZE)
CASES = [
    pytest.param((1, 2, 2, 50, 50, 32, 32, "bhnd", "frame-causal", (None, None), BLOCK), id="frame13-50"),
    pytest.param((2, 4, 2, 37, 45, 40, 24, "bnhd", "holes", (2, 4), (BLOCK, 2 * BLOCK)), id="gqa-holes-37x45-bnhd"),
    pytest.param((1, 2, 1, 6 * BLOCK + 3, 7 * BLOCK + 5, 32, 32, "bnhd", "stripes", (None, None), BLOCK),
                 id="gqa-stripes"),
    pytest.param((1, 2, 2, 7 * BLOCK + 1, 7 * BLOCK + 1, 24, 24, "bhnd", "band", (None, None), BLOCK), id="band"),
]
if ON_GPU:
    CASES += [
        pytest.param((2, 8, 2, 1999, 1999, 128, 128, "bnhd", "frame-causal", (None, None), 128), id="gqa-1999-d128"),
        pytest.param((1, 4, 4, 1000, 3000, 64, 64, "bhnd", "holes", (1, 4), (128, 64)), id="xattn-1000x3000-d64"),
        pytest.param((1, 4, 4, 4000, 4000, 128, 128, "bhnd", "frame-causal", (1, None), 64), id="4000-d128-b64"),
        pytest.param((2, 4, 2, 1500, 1700, 64, 64, "bnhd", "stripes", (None, None), 128), id="gqa-stripes-1500x1700"),
        pytest.param((1, 4, 4, 2100, 2100, 96, 96, "bhnd", "band", (None, None), 128), id="band-2100-d96"),
    ]


def _inputs(case, dtype, tangents=True):
    b, hq, hkv, nq, nk, dqk, dv, layout, name, (mb, mh), block = case
    mod = _mods(nq, nk)[name]
    bm = create_block_mask(mod, mb, mh, nq, nk, device=DEVICE, BLOCK_SIZE=block)
    xs = make_qkv(b, hq, hkv, nq, nk, dqk, dv, layout, dtype, tangents=tangents)
    return xs, bm, dict(layout=layout), _dense(bm, nq, nk)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_forward_and_jvp(case, dtype):
    xs, bm, kw, dense = _inputs(case, dtype)
    with LaunchLog() as log:
        out = flashjvp.attention_jvp(*xs, return_lse=True, block_mask=bm, **kw)
    assert log.count("_attn_fwd_kernel", SPARSE=True) == 1
    truth, lowp = jvp_refs(*xs, attn_mask=dense, **kw)
    for name, got, t, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, t, lp, dtype)
    o = flashjvp.attention(*xs[:3], block_mask=bm, **kw)
    assert_close("o (forward only)", o, truth[0], lowp[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("case", CASES)
def test_backward(case, dtype):
    if not ON_GPU and dtype != torch.float32:
        pytest.skip("interpreter: float32 only (time)")
    xs, bm, kw, dense = _inputs(case, dtype, tangents=False)
    leaves = [x.detach().requires_grad_() for x in xs]
    o = flashjvp.attention(*leaves, block_mask=bm, **kw)
    do = torch.randn_like(o)
    with LaunchLog() as log:
        o.backward(do)
    assert log.count("_attn_bwd_dkdv_kernel", SPARSE=True) == 1
    truth, lowp = grad_refs(*xs, do, attn_mask=dense, **kw)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, dtype)


@pytest.mark.parametrize("case", CASES[:2])
def test_second_order(case):
    xs, bm, kw, dense = _inputs(case, torch.float32)
    with LaunchLog() as log:
        check_second_order(xs, fn=lambda *a, **k: flashjvp.attention_jvp(*a, block_mask=bm, **k),
                           ref=lambda *a, **k: flashjvp.attention_jvp_ref(*a, attn_mask=dense.to(a[0].device), **k),
                           **kw)
    assert log.count("_attn_bwd_jvp_dkdv_kernel", SPARSE=True) == 1


def test_func_jvp_and_fully_masked_rows():
    """Under torch.func.jvp (one fused launch); rows and whole query blocks that see no key give
    o = to = 0, lse = -inf, mu = 0, never NaN (outputs start as NaN under FLASHJVP_POISON)."""
    nq = nk = 3 * BLOCK

    def mod(b, h, q, k):  # query block 1 sees nothing, query 5 sees nothing, the rest: keys <= q
        return (q // BLOCK != 1) & (q != 5) & (k <= q)

    bm = create_block_mask(mod, None, None, nq, nk, device=DEVICE, BLOCK_SIZE=BLOCK)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 2, nq, nk, 16, 16, "bhnd", torch.float32)
    dense = _dense(bm, nq, nk)
    with LaunchLog() as log:
        o, to = torch.func.jvp(lambda q, k, v: flashjvp.attention(q, k, v, block_mask=bm), (q, k, v), (tq, tk, tv))
    assert log.count("_attn_fwd_kernel", SPARSE=True, HAS_TQ=True) == 1
    truth, lowp = jvp_refs(q, k, v, tq, tk, tv, attn_mask=dense)
    assert_close("o", o, truth[0], lowp[0], torch.float32)
    assert_close("to", to, truth[1], lowp[1], torch.float32)
    assert torch.equal(o[:, :, BLOCK:2 * BLOCK], torch.zeros_like(o[:, :, BLOCK:2 * BLOCK]))
    _, _, lse, mu = flashjvp.attention_jvp(q, k, v, tq, tk, tv, block_mask=bm, return_lse=True)
    assert torch.isinf(lse[:, :, 5]).all() and (mu[:, :, 5] == 0).all()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    flashjvp.attention(*leaves, block_mask=bm).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("helper", ["frame_causal", "teacher_forcing", "document"])
def test_helpers(helper):
    """The helpers' masks: their documented rule, and attention with them matches the dense rule."""
    if helper == "frame_causal":
        n = 45
        bm = block_masks.frame_causal(n, 7, device=DEVICE, block_size=BLOCK)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        rule = j // 7 <= i // 7
    elif helper == "teacher_forcing":
        t, f = 3, 6
        n = 2 * t * f
        bm = block_masks.teacher_forcing(t, f, device=DEVICE, block_size=BLOCK)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        qi, kj, fi, fj = i >= t * f, j >= t * f, (i % (t * f)) // f, (j % (t * f)) // f
        rule = (~kj & torch.where(qi, fj < fi, fj <= fi)) | (qi & kj & (fi == fj))
    else:
        n = 40
        cu = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32, device=DEVICE)
        bm = block_masks.document(cu, n=n, causal=True, block_size=BLOCK)
        doc = torch.tensor([0] * 5 + [2] * 17 + [3] * 9 + [9] * 9)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        rule = (doc[:, None] == doc[None, :]) & (doc[:, None] < 4) & (j <= i)
    rule = rule.to(DEVICE)
    assert torch.equal(_plan_dense(bm)[0, 0], rule)
    assert getattr(bm, "_flashjvp_plan", None) is not None  # prepared
    xs = make_qkv(1, 2, 2, n, n, 16, 16, "bhnd", torch.float32)
    out = flashjvp.attention_jvp(*xs, block_mask=bm, return_lse=True)
    truth, lowp = jvp_refs(*xs, attn_mask=rule)
    for name, got, ref, lp in zip(("o", "to", "lse", "mu"), out, truth, lowp):
        assert_close(name, got, ref, lp, torch.float32)


def test_plan_memory_and_cache():
    """The plan is built once per mask and kept on it; its bitmask holds the partial blocks only."""
    n, f = 6 * BLOCK + 5, BLOCK + 3
    bm = create_block_mask(_frame_causal(f), None, None, n, n, device=DEVICE, BLOCK_SIZE=BLOCK)
    plan = flashjvp._sparse.plan_of(bm)
    assert flashjvp._sparse.plan_of(bm) is plan
    n_partial = int(bm.kv_num_blocks.sum())
    assert plan.bits.shape == (n_partial + 1, BLOCK, -(-BLOCK // 32))
    i = torch.arange(n)
    assert abs(plan.visible - (i[None] // f <= i[:, None] // f).double().mean().item()) < 1e-9


@pytest.mark.parametrize(("name", "runs"), [("frame-causal", True), ("band", True), ("stripes", False)])
def test_plan_runs(name, runs):
    """``runs`` (the unmasked loops skip the block list) only where every row's and column's full
    blocks are consecutive."""
    n = 6 * BLOCK + 3
    bm = create_block_mask(_mods(n, n)[name], None, None, n, n, device=DEVICE, BLOCK_SIZE=BLOCK)
    plan = flashjvp._sparse.plan_of(bm)
    assert plan.runs is runs
    assert int(bm.full_kv_num_blocks.sum()) > 0  # the case has full blocks to run over


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) through the custom operators, forward and backward, with a
    prepared mask (as the helpers return)."""
    torch._dynamo.reset()
    n = 3 * BLOCK - 5
    bm = block_masks.frame_causal(n, BLOCK // 2 + 3, device=DEVICE, block_size=BLOCK)
    q, k, v = make_qkv(1, 2, 2, n, n, 16, 16, "bhnd", torch.float32, tangents=False)
    backend = "inductor" if ON_GPU else "aot_eager"
    fn = torch.compile(lambda q, k, v: flashjvp.attention(q, k, v, block_mask=bm), backend=backend, fullgraph=True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    do = torch.randn_like(o)
    o.backward(do)
    dense = _dense(bm, n, n)
    truth, lowp = grad_refs(q, k, v, do, attn_mask=dense)
    ref = flashjvp.attention_ref(q.double(), k.double(), v.double(), attn_mask=dense)
    assert_close("o", o, ref, flashjvp.attention_ref(q, k, v, attn_mask=dense), torch.float32)
    for name, x, t, lp in zip(("dq", "dk", "dv"), leaves, truth, lowp):
        assert_close(name, x.grad, t, lp, torch.float32)
    torch._dynamo.reset()


def test_errors():
    n = 2 * BLOCK
    q, k, v = make_qkv(2, 4, 2, n, n, 16, 16, "bhnd", torch.float32, tangents=False)
    bm = create_block_mask(_frame_causal(5), None, None, n, n, device=DEVICE, BLOCK_SIZE=BLOCK)
    with pytest.raises(TypeError, match="^block_mask: expected a torch.nn.attention.flex_attention.BlockMask"):
        flashjvp.attention(q, k, v, block_mask=torch.ones(n, n, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"^block_mask: expected seq_lengths \(Q_LEN, KV_LEN\) = \({n - 1}, {n}\)"):
        flashjvp.attention(q[:, :, 1:], k, v, block_mask=bm)
    wrong_heads = create_block_mask(_frame_causal(5), 2, 3, n, n, device=DEVICE, BLOCK_SIZE=BLOCK)
    with pytest.raises(ValueError, match=r"^block_mask: expected a \(B, H\) of \(1 or 2, 1 or 4\).*got \(2, 3\)"):
        flashjvp.attention(q, k, v, block_mask=wrong_heads)
    with pytest.raises(ValueError, match="^block_mask: cannot be combined with causal"):
        flashjvp.attention(q, k, v, block_mask=bm, causal=True)
    with pytest.raises(ValueError, match="^block_mask: cannot be combined with attn_mask, kv_lens"):
        flashjvp.attention_jvp(q, k, v, block_mask=bm, attn_mask=torch.ones(n, n, dtype=torch.bool, device=DEVICE),
                               kv_lens=torch.tensor([3, 4], device=DEVICE))
    odd = create_block_mask(_frame_causal(5), None, None, n, n, device=DEVICE, BLOCK_SIZE=(BLOCK, 24))
    with pytest.raises(ValueError, match=r"^block_mask: BLOCK_SIZE \(\d+, 24\) is not served"):
        flashjvp.attention(q, k, v, block_mask=odd)
    with pytest.raises(ValueError, match="^cu_seqlens: expected an integer"):
        block_masks.document(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="^frame_len: expected an int >= 1"):
        block_masks.frame_causal(10, 0, device=DEVICE)


def test_opcheck():
    """The custom operators' contracts (schema, fake shapes, autograd registration) with a block mask."""
    from flashjvp._ops import attn_fwd_jvp_op, attn_fwd_op, options
    from flashjvp._validate import check_inputs

    n = 2 * BLOCK - 3
    bm = block_masks.frame_causal(n, BLOCK // 2 + 1, device=DEVICE, block_size=BLOCK)
    q, k, v, tq, tk, tv = make_qkv(1, 2, 1, n, n, 16, 16, "bhnd", torch.float32, kinds=("contiguous",))
    opts = options(check_inputs(q, k, v, allow_float64=False, block_mask=bm))
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(attn_fwd_op, (*leaves, *opts), test_utils=("test_schema", "test_faketensor",
                                                                      "test_autograd_registration"))
    torch.library.opcheck(attn_fwd_jvp_op, (*leaves, tq, tk, tv, *opts),
                          test_utils=("test_schema", "test_faketensor"))
