"""The routing rule (``_route.choose``) on described calls and devices: no GPU needed.

The table states, for calls of ``sdpa``, ``attention`` and ``attention_jvp`` as a user makes them
(DiT and SiT blocks, long sequences, GQA, masks, tangents, odd head dims) on described devices
(H100 with PyTorch 2.11's cuDNN, A100, a CPU) under the process switches, which backend serves the
forward and the backward. Beside it: every ``AttnArgs`` field is either routed or declared an output
contract (so a new option cannot change routing unseen), the live description of a call, and the
routes the public functions take with ``_route.choose`` stubbed to a recording fake.
"""

import dataclasses

import pytest
import torch

import flashjvp
from flashjvp import _backends, _route
from flashjvp._route import CUDNN, FLASH, REF, TRITON, Call, Device, Route, Switches, choose, cudnn_supports
from flashjvp._validate import AttnArgs, check_inputs

BF, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H100 = Device("cuda", (9, 0), 91900, True, False)
H100_OLD_CUDNN = Device("cuda", (9, 0), 91500, True, False)  # cuDNN 9.15: PyTorch keeps flash first
RTX_5090 = Device("cuda", (12, 0), 91900, True, False)
A100 = Device("cuda", (8, 0), 91900, True, False)
NO_CUDNN_OPS = Device("cuda", (9, 0), 91900, False, False)
CPU_INTERP = Device("cpu", (0, 0), 0, False, True)
CPU = Device("cpu", (0, 0), 0, False, False)
AUTO = Switches()


def dit(**kw):
    """A DiT-XL/2 attention call at 256 px: B32, 16 heads of 72, 256 tokens, bf16."""
    return Call(**{**dict(dtype=BF, batch=32, h_q=16, h_kv=16, n_q=256, n_k=256, d_qk=72, d_v=72), **kw})


def long(**kw):
    """A long-sequence call: B2, 24 heads of 128, 4096 tokens, bf16."""
    return Call(**{**dict(dtype=BF, batch=2, h_q=24, h_kv=24, n_q=4096, n_k=4096, d_qk=128, d_v=128), **kw})


# (id, call, device, switches, expected forward, expected backward)
TABLE = [
    # sdpa / attention plain calls: what PyTorch's SDPA runs
    ("dit-plain-inference", dit(), H100, AUTO, CUDNN, None),
    ("dit-plain-train", dit(grad=True), H100, AUTO, CUDNN, CUDNN),
    ("dit-causal", dit(causal="top_left", grad=True), H100, AUTO, CUDNN, CUDNN),
    ("long-d128-train", long(grad=True), H100, AUTO, CUDNN, CUDNN),
    ("sit-512px", dit(batch=8, n_q=1024, n_k=1024, grad=True), H100, AUTO, CUDNN, CUDNN),
    ("d256-sdpa-picks-cudnn", long(d_qk=256, d_v=256, grad=True), H100, AUTO, CUDNN, CUDNN),
    ("d256-old-cudnn-flash", long(d_qk=256, d_v=256, grad=True), H100_OLD_CUDNN, AUTO, FLASH, FLASH),
    ("old-cudnn-flash-first", dit(grad=True), H100_OLD_CUDNN, AUTO, FLASH, FLASH),
    ("a100-flash", dit(grad=True), A100, AUTO, FLASH, FLASH),
    ("fp16", dit(dtype=FP16, grad=True), H100, AUTO, CUDNN, CUDNN),
    ("cross-attention", dit(n_q=257, n_k=512, grad=True), H100, AUTO, CUDNN, CUDNN),
    ("cross-causal-top-left", dit(n_q=300, n_k=512, causal="top_left", grad=True), H100, AUTO, CUDNN, CUDNN),
    # SDPA does not express these as they are; flashjvp's own rule
    ("gqa-cudnn-listed", long(h_kv=6, grad=True), H100, AUTO, CUDNN, CUDNN),
    ("bottom-right-nq-ne-nk", dit(n_q=300, n_k=512, causal="bottom_right", grad=True), H100, AUTO, TRITON,
     TRITON),
    ("bottom-right-nq-eq-nk", dit(causal="bottom_right", grad=True), H100, AUTO, CUDNN, CUDNN),
    ("d36-sdpa-pads-for-flash", dit(d_qk=36, d_v=36, grad=True), H100, AUTO, TRITON, TRITON),
    ("sm120-d200-train-efficient", long(d_qk=200, d_v=200, grad=True), RTX_5090, AUTO, TRITON, TRITON),
    ("sm120-d200-inference-flash", long(d_qk=200, d_v=200), RTX_5090, AUTO, FLASH, None),
    ("dqk-ne-dv", long(d_v=64, grad=True), H100, AUTO, TRITON, TRITON),
    ("fp32", dit(dtype=FP32, grad=True), H100, AUTO, TRITON, TRITON),
    ("unaddressable", dit(addressable=False, grad=True), H100, AUTO, TRITON, TRITON),
    ("nk1-cudnn-refuses", dit(n_k=1), H100, AUTO, FLASH, None),
    ("mask", dit(options=frozenset({"mask"}), grad=True), H100, AUTO, TRITON, TRITON),
    ("kv-lens", dit(options=frozenset({"kv_lens"}), grad=True), H100, AUTO, TRITON, TRITON),
    ("window", long(options=frozenset({"window"}), grad=True), H100, AUTO, TRITON, TRITON),
    ("varlen", long(options=frozenset({"varlen"}), grad=True), H100, AUTO, TRITON, TRITON),
    ("block-mask", long(options=frozenset({"block_mask"}), grad=True), H100, AUTO, TRITON, TRITON),
    ("no-cudnn-ops", dit(grad=True), NO_CUDNN_OPS, AUTO, TRITON, TRITON),
    # tangents: the fused forward+JVP kernel; the plain backward of its o on cuDNN (MeanFlow)
    ("dit-jvp", dit(tangents=True), H100, AUTO, TRITON, None),
    ("dit-jvp-train", dit(tangents=True, grad=True), H100, AUTO, TRITON, CUDNN),
    ("long-jvp-train", long(tangents=True, grad=True), H100, AUTO, TRITON, CUDNN),
    ("jvp-mask-train", dit(tangents=True, grad=True, options=frozenset({"mask"})), H100, AUTO, TRITON, TRITON),
    ("jvp-deterministic", dit(tangents=True, grad=True), H100, Switches(deterministic=True), TRITON, TRITON),
    # inside flashjvp's autograd (Function paths, compiled operators): never PyTorch's flash operator
    ("own-backward-a100", dit(grad=True, own_backward=True), A100, AUTO, TRITON, TRITON),
    ("own-backward-h100", dit(grad=True, own_backward=True), H100, AUTO, CUDNN, CUDNN),
    # switches
    ("never", dit(grad=True), H100, Switches(mode="never"), TRITON, TRITON),
    ("always-fp16", dit(dtype=FP16, grad=True), H100, Switches(mode="always"), CUDNN, CUDNN),
    ("always-unsupported", dit(d_qk=36, d_v=36, grad=True), H100, Switches(mode="always"), TRITON, TRITON),
    ("always-gqa-unlisted-d36", long(h_kv=6, d_qk=40, d_v=40, grad=True), H100, Switches(mode="always"),
     CUDNN, CUDNN),
    ("cudnn-sdp-off", dit(grad=True), H100, Switches(cudnn_sdp=False), FLASH, FLASH),
    ("cudnn-and-flash-off", dit(grad=True), H100, Switches(cudnn_sdp=False, flash_sdp=False), TRITON, TRITON),
    ("flash-off", dit(grad=True), H100, Switches(flash_sdp=False), CUDNN, CUDNN),
    ("priority-flash-first", dit(grad=True), H100,
     Switches(priority=("flash", "cudnn", "efficient", "math")), FLASH, FLASH),
    ("priority-math-first", dit(grad=True), H100, Switches(priority=("math", "flash", "efficient", "cudnn")),
     TRITON, TRITON),
    ("deterministic", dit(grad=True), H100, Switches(deterministic=True), FLASH, FLASH),
    ("deterministic-inference", dit(), H100, Switches(deterministic=True), FLASH, None),
    ("cudnn-deprioritized", dit(grad=True), H100, Switches(cudnn_deprioritized=True), FLASH, FLASH),
    ("deterministic-always", dit(grad=True), H100, Switches(mode="always", deterministic=True), CUDNN, TRITON),
    ("avoid-recompile", dit(grad=True), H100, Switches(avoid_recompile=True), TRITON, TRITON),
    ("refused-fwd", dit(grad=True), H100, Switches(refused=frozenset({"fwd"})), TRITON, CUDNN),
    ("refused-bwd", dit(grad=True), H100, Switches(refused=frozenset({"bwd"})), CUDNN, TRITON),
    # CPU: the interpreter runs the kernels; without it, the math reference
    ("cpu-interpreter", dit(grad=True), CPU_INTERP, AUTO, TRITON, TRITON),
    ("cpu", dit(grad=True), CPU, AUTO, REF, REF),
    ("cpu-jvp", dit(tangents=True), CPU, AUTO, REF, None),
]


@pytest.mark.parametrize("case", TABLE, ids=[row[0] for row in TABLE])
def test_routing_table(case):
    name, call, dev, sw, fwd, bwd = case
    route = choose(call, dev, sw)
    assert (route.fwd, route.bwd) == (fwd, bwd), f"{name}: {route} (expected fwd={fwd}, bwd={bwd})"
    assert route.why


def test_routing_ids_are_unique():
    names = [row[0] for row in TABLE]
    assert len(names) == len(set(names))


def test_flash_never_serves_a_backward_flashjvp_runs():
    """Wherever PyTorch would pick flash attention, a call whose backward flashjvp's autograd runs
    gets Triton or cuDNN: run_fwd and run_bwd have no flash path."""
    for _, call, dev, sw, _, _ in TABLE:
        route = choose(dataclasses.replace(call, own_backward=True), dev, sw)
        assert FLASH not in (route.fwd, route.bwd), route


def test_cudnn_support_rules():
    assert cudnn_supports(dit(), H100, AUTO, backward=False)
    assert cudnn_supports(long(h_kv=1, causal="top_left"), H100, AUTO, backward=True)  # MQA, causal
    for d in (8, 32, 40, 72, 96, 128, 256):
        assert cudnn_supports(dit(d_qk=d, d_v=d), H100, AUTO, backward=True), d
    for d in (36, 100, 264):
        assert not cudnn_supports(dit(d_qk=d, d_v=d), H100, AUTO, backward=False), d
    assert not cudnn_supports(long(d_qk=256, d_v=256), Device(cudnn_version=90900), AUTO, backward=False)  # 128
    assert not cudnn_supports(dit(d_v=64), H100, AUTO, backward=False)
    assert not cudnn_supports(dit(dtype=FP32), H100, AUTO, backward=False)
    assert not cudnn_supports(dit(n_k=1), H100, AUTO, backward=False)
    assert not cudnn_supports(dit(batch=65536), H100, AUTO, backward=False)
    assert not cudnn_supports(dit(h_q=65536, h_kv=65536), H100, AUTO, backward=False)
    assert not cudnn_supports(dit(n_q=300, causal="bottom_right"), H100, AUTO, backward=False)
    assert cudnn_supports(dit(causal="bottom_right"), H100, AUTO, backward=False)  # Nq == Nk: top-left too
    assert not cudnn_supports(dit(), A100, AUTO, backward=False)  # Hopper only (where it was tested)
    assert not cudnn_supports(dit(), Device(cudnn_version=80900), AUTO, backward=False)
    assert not cudnn_supports(dit(), NO_CUDNN_OPS, AUTO, backward=False)
    assert not cudnn_supports(dit(), CPU_INTERP, AUTO, backward=False)
    assert not cudnn_supports(dit(), H100, Switches(avoid_recompile=True), backward=False)
    det = Switches(deterministic=True)
    assert cudnn_supports(dit(), H100, det, backward=False) and not cudnn_supports(dit(), H100, det, backward=True)


# --------------------------------------------------------------------------- the description


def test_every_attnargs_field_is_routed_or_an_output_contract():
    """A field added to AttnArgs must be declared: read by routing (``call_of``) or an output
    contract that never changes the kernel. The out_like_q field once silently sent every sdpa call
    to Triton."""
    fields = {f.name for f in dataclasses.fields(AttnArgs)}
    assert fields == set(_route.ROUTED_FIELDS) | set(_route.OUTPUT_FIELDS), fields ^ (
        set(_route.ROUTED_FIELDS) | set(_route.OUTPUT_FIELDS))
    assert not set(_route.ROUTED_FIELDS) & set(_route.OUTPUT_FIELDS)


def _args(**kw):
    q, k, v = (torch.randn(2, 4, 64, 72) for _ in range(3))
    return check_inputs(q, k, v, **kw)


def test_output_contracts_do_not_change_the_call():
    a = _args()
    base = _route.call_of(a, BF, addressable=True, tangents=False, grad=True, own_backward=False)
    for changed in (dataclasses.replace(a, out_like_q=True), dataclasses.replace(a, layout="bnhd"),
                    dataclasses.replace(a, scale=0.5)):
        assert _route.call_of(changed, BF, addressable=True, tangents=False, grad=True, own_backward=False) == base


def test_routed_fields_change_the_call():
    a = _args()
    base = _route.call_of(a, BF, addressable=True, tangents=False, grad=True, own_backward=False)
    mask = torch.zeros(2, 4, 64, 64, dtype=torch.bool)
    changes = dict(batch=3, h_q=8, h_kv=2, n_q=65, n_k=65, d_qk=64, d_v=64, causal="top_left",
                   kv_lens=torch.ones(2, dtype=torch.int32), window=(8, 8), mask=mask, varlen=object(),
                   sparse=object())
    assert set(changes) == set(_route.ROUTED_FIELDS)
    for name, value in changes.items():
        call = _route.call_of(dataclasses.replace(a, **{name: value}), BF, addressable=True, tangents=False,
                              grad=True, own_backward=False)
        assert call != base, name


def test_describe_a_live_call():
    """The live description on this machine: CPU tensors, the switches as set."""
    q, k, v = (torch.randn(2, 4, 64, 72) for _ in range(3))
    call, dev, sw = _route.describe(q, k, v, check_inputs(q, k, v), tangents=True, grad=False)
    assert call == Call(torch.float32, 2, 4, 4, 64, 64, 72, 72, None, frozenset(), False, True, False)
    assert dev.type == "cpu"
    assert isinstance(sw, Switches) and sw.mode in ("auto", "never", "always")


def test_switches_of_the_process(monkeypatch):
    monkeypatch.setenv("FLASHJVP_CUDNN", "always")
    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")
    sw = _route.switches(_route.switch_values())
    assert sw.mode == "always" and sw.avoid_recompile
    assert set(sw.priority) <= {"flash", "efficient", "math", "cudnn"} and "cudnn" in sw.priority
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        sw = _route.switches(_route.switch_values())
        assert not (sw.cudnn_sdp or sw.flash_sdp or sw.efficient_sdp) and sw.math_sdp


def test_route_of_is_cached_per_signature_and_switches(monkeypatch):
    """route_of asks the rule once per signature; a switch change is a new signature."""
    asked = []
    real = _route.choose

    def spy(*args):
        asked.append(args[0])
        return real(*args)

    monkeypatch.setattr(_backends, "choose", spy)
    q, k, v = (torch.randn(2, 4, 64, 72) for _ in range(3))
    a = check_inputs(q, k, v)
    for _ in range(3):
        assert _backends.route_of(q, k, v, a, grad=True) == Route(TRITON, TRITON, "CPU tensors, Triton's interpreter")
    assert len(asked) == 1
    monkeypatch.setenv("FLASHJVP_CUDNN", "always" if _route.cudnn_mode() != "always" else "never")
    _backends.route_of(q, k, v, a, grad=True)
    assert len(asked) == 2


# --------------------------------------------------------------------------- the public functions


@pytest.mark.parametrize("fn", ["sdpa", "attention", "attention_jvp", "attention-in-jvp", "attention-grad"])
def test_public_functions_route_once_with_their_description(monkeypatch, fn):
    """Each public function asks the rule with what it is: tangents for attention_jvp and inside
    torch.func.jvp, grad where a backward can follow, and asks once for repeated calls."""
    asked = []
    real = _route.choose

    def spy(call, dev, sw):
        asked.append(call)
        return real(call, dev, sw)

    monkeypatch.setattr(_backends, "choose", spy)
    q, k, v = (torch.randn(1, 2, 37, 40) for _ in range(3))
    for _ in range(2):
        if fn == "sdpa":
            flashjvp.sdpa(q, k, v)
        elif fn == "attention":
            flashjvp.attention(q, k, v)
        elif fn == "attention_jvp":
            flashjvp.attention_jvp(q, k, v, q, None, None)
        elif fn == "attention-in-jvp":
            torch.func.jvp(lambda x: flashjvp.attention(x, k, v), (q,), (q,))
        else:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            flashjvp.attention(*leaves).sum().backward()
    assert len({(c.tangents, c.grad) for c in asked}) <= 1, asked
    if asked:
        call = asked[0]
        assert call.tangents == (fn in ("attention_jvp", "attention-in-jvp")), call
        assert call.grad == (fn == "attention-grad"), call
        assert (call.n_q, call.d_qk) == (37, 40)
    assert len(asked) <= 1


# --------------------------------------------------------------------------- compiled plain calls


def _graphs(fn, *args):
    """Compile ``fn`` with fullgraph=True and a backend that records the FX graphs it is given."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, graphs


def _targets(graphs) -> set:
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@pytest.mark.parametrize("fn", ["sdpa", "attention-bnhd"])
def test_compiled_plain_call_is_pytorchs_sdpa_where_the_rule_says_so(monkeypatch, fn):
    """On a (described) H100 a compiled plain call that PyTorch's SDPA serves with cuDNN is SDPA in
    the graph (no flashjvp operator, no flashjvp Python per step); on this CPU it is flashjvp's
    operator. Values match the reference either way."""
    q, k, v = (torch.randn(2, 4, 37, 40) for _ in range(3))
    call = (lambda q, k, v: flashjvp.sdpa(q, k, v, is_causal=True)) if fn == "sdpa" else \
        (lambda q, k, v: flashjvp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                            layout="bnhd").transpose(1, 2))
    ref = flashjvp.attention_ref(q, k, v, causal=True)
    out, graphs = _graphs(call, q, k, v)
    assert "flashjvp.fwd.default" in _targets(graphs) and "scaled_dot_product_attention" not in str(_targets(graphs))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    monkeypatch.setattr(flashjvp.interface, "device_of", lambda device: H100)
    monkeypatch.setenv("FLASHJVP_CUDNN", "auto")
    for dtype in (BF, FP16):  # what PyTorch's cuDNN attention takes
        qh, kh, vh = (x.to(dtype) for x in (q, k, v))
        out, graphs = _graphs(call, qh, kh, vh)
        targets = _targets(graphs)
        assert not any("flashjvp" in t for t in targets), targets
        assert any("scaled_dot_product_attention" in t for t in targets), targets
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    out, graphs = _graphs(call, q, k, v)  # float32: PyTorch would pick its efficient kernel; flashjvp's
    assert "flashjvp.fwd.default" in _targets(graphs)
    monkeypatch.setenv("FLASHJVP_CUDNN", "always")  # flashjvp's own cuDNN call, through its operator
    out, graphs = _graphs(call, q.to(BF), k.to(BF), v.to(BF))
    assert "flashjvp.fwd.default" in _targets(graphs)


@pytest.mark.parametrize("mask", ["bool", "additive"])
def test_masks_compile_with_fullgraph(mask):
    """sdpa with a bool or an additive float mask compiles to one graph (Hugging Face models pass
    additive masks: a graph break there would be one per layer)."""
    q, k, v = (torch.randn(1, 2, 19, 16) for _ in range(3))
    m = torch.rand(1, 1, 19, 19) > 0.3 if mask == "bool" else torch.randn(1, 1, 19, 19)
    m[..., 0] = True if mask == "bool" else 0.0
    out, graphs = _graphs(lambda q, k, v, m: flashjvp.sdpa(q, k, v, attn_mask=m), q, k, v, m)
    assert len(graphs) == 1
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m),
                               atol=2e-5, rtol=1e-4)


def test_traced_calls_route_as_the_calls_they_stand_for():
    """A compiled graph routes on the size predicates of a call (its sizes may be symbolic): the
    representative call with the same predicates gets the same route, for every plain call of the
    table."""
    for name, call, dev, sw, _, _ in TABLE:
        if call.tangents or call.own_backward:
            continue
        sizes = tuple(test(call) for test in _route.SIZE_PREDICATES)
        rep = _route.representative(call.dtype, call.causal, call.options, sizes, call.addressable, call.grad)
        assert (choose(rep, dev, sw).fwd, choose(rep, dev, sw).bwd) == (choose(call, dev, sw).fwd,
                                                                choose(call, dev, sw).bwd), (name, rep)
        assert _route.torch_choice(rep, dev, sw) == _route.torch_choice(call, dev, sw), (name, rep)


def test_sdpa_calls_route_as_attention_calls():
    """sdpa marks its outputs to follow q's order of dimensions (``out_like_q``): the same call, the
    same route. (Routing once read that field as an option cuDNN lacks and sent every sdpa call to
    Triton.)"""
    from flashjvp.sdpa import _plan_args

    q, k, v = (torch.randn(2, 16, 256, 72).to(BF) for _ in range(3))
    a_sdpa, a_attention = _plan_args(q, k, v, False, None, False), check_inputs(q, k, v)
    assert a_sdpa.out_like_q and not a_attention.out_like_q
    calls = [_route.call_of(a, BF, addressable=True, tangents=False, grad=True, own_backward=False)
             for a in (a_sdpa, a_attention)]
    assert calls[0] == calls[1]
    assert choose(calls[0], H100, AUTO).fwd == CUDNN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "offset-3"])
def test_compiled_sdpa_path_on_the_gpu(monkeypatch, offset):
    """FLASHJVP_CUDNN=auto on the GPU: a compiled DiT-style plain training step through flashjvp.sdpa
    is SDPA in the graph, with values and gradients of the float64 reference, also for q, k, v at a
    storage offset that is not 16-byte aligned (which the traced graph cannot see)."""
    from helpers import assert_close, grad_refs

    monkeypatch.setenv("FLASHJVP_CUDNN", "auto")
    b, h, n, d = 4, 16, 256, 72
    flat = torch.randn(3 * b * n * h * d + offset, device="cuda", dtype=BF)[offset:]
    qkv = flat.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    q, k, v = (x.detach().requires_grad_() for x in qkv)
    _, graphs = _graphs(lambda q, k, v: flashjvp.sdpa(q, k, v), q, k, v)
    assert any("scaled_dot_product_attention" in t for t in _targets(graphs)), _targets(graphs)
    torch._dynamo.reset()
    out = torch.compile(lambda q, k, v: flashjvp.sdpa(q, k, v), fullgraph=True)(q, k, v)  # Inductor
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    o64 = flashjvp.attention_ref(*(x.detach().double() for x in (q, k, v)))
    assert_close("o", out, o64, flashjvp.attention_ref(q.detach(), k.detach(), v.detach()), BF)
    g64, g_lp = grad_refs(q.detach(), k.detach(), v.detach(), do)
    for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), grads, g64, g_lp):
        assert_close(name, g, ref, ref_lp, BF)
