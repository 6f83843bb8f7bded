"""Bad input: a ValueError/TypeError naming the argument, before any kernel runs."""

import pytest
import torch

import flashjvp
from flashjvp._launch import LaunchLog
from helpers import DEVICE


def _qkv(**over):
    base = dict(q=torch.randn(2, 4, 8, 16, device=DEVICE), k=torch.randn(2, 2, 6, 16, device=DEVICE),
                v=torch.randn(2, 2, 6, 8, device=DEVICE))
    base.update(over)
    return base


CASES = [
    ("ndim", dict(q=torch.randn(4, 8, 16)), {}, ValueError, r"q: expected a 4-d tensor"),
    ("not-tensor", dict(k=[1.0]), {}, TypeError, r"k: expected a torch.Tensor"),
    ("batch", dict(k=torch.randn(3, 2, 6, 16), v=torch.randn(3, 2, 6, 8)), {}, ValueError, r"expected batch size 2"),
    ("heads-kv", dict(v=torch.randn(2, 1, 6, 8)), {}, ValueError, r"v: expected 2 heads"),
    ("gqa", dict(k=torch.randn(2, 3, 6, 16), v=torch.randn(2, 3, 6, 8)), {}, ValueError, r"dividing q's 4 heads"),
    ("len-kv", dict(v=torch.randn(2, 2, 5, 8)), {}, ValueError, r"v: expected sequence length 6"),
    ("dqk", dict(k=torch.randn(2, 2, 6, 32)), {}, ValueError, r"k: expected head dim 16"),
    ("d>256", dict(q=torch.randn(2, 4, 8, 300), k=torch.randn(2, 2, 6, 300)), {}, ValueError, r"1\.\.256, got 300"),
    ("int", dict(q=torch.ones(2, 4, 8, 16, dtype=torch.int32)), {}, TypeError, r"q: expected dtype"),
    ("float64", dict(q=torch.randn(2, 4, 8, 16, dtype=torch.float64)), {}, TypeError, r"got torch.float64"),
    ("mixed", dict(v=torch.randn(2, 2, 6, 8).half()), {}, TypeError, r"v: expected dtype torch.float32"),
    ("layout", {}, dict(layout="nhd"), ValueError, r"layout: expected one of"),
    ("causal", {}, dict(causal="diagonal"), ValueError, r"causal: expected False, True"),
    ("scale-neg", {}, dict(scale=-1.0), ValueError, r"scale: expected a positive finite"),
    ("scale-nan", {}, dict(scale=float("nan")), ValueError, r"scale: expected a positive finite"),
    ("scale-type", {}, dict(scale="0.1"), TypeError, r"scale: expected a positive finite float or None, got str"),
    ("scale-bool", {}, dict(scale=True), TypeError, r"scale: expected a positive finite float or None, got bool"),
    ("causal-int", {}, dict(causal=1), ValueError, r"causal: expected False, True"),
    ("causal-zero", {}, dict(causal=0), ValueError, r"causal: expected False, True"),
    ("empty-q", dict(q=torch.randn(2, 4, 0, 16)), {}, ValueError, r"q: expected sequence length >= 1, got 0"),
    ("empty-kv", dict(k=torch.randn(2, 2, 0, 16), v=torch.randn(2, 2, 0, 8)), {}, ValueError,
     r"k: expected sequence length >= 1, got 0"),
]


@pytest.mark.parametrize("over, kw, exc, msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fn", ["attention", "attention_jvp"])
def test_bad_input_raises_before_launch(fn, over, kw, exc, msg):
    args = _qkv(**{n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in over.items()})
    with LaunchLog() as log, pytest.raises(exc, match=msg):
        getattr(flashjvp, fn)(args["q"], args["k"], args["v"], **kw)
    assert log.launches == []


TANGENT_CASES = [
    ("shape", dict(tq=torch.randn(2, 4, 8, 8)), ValueError, r"tq: expected shape \(2, 4, 8, 16\)"),
    ("dtype", dict(tk=torch.randn(2, 2, 6, 16).half()), TypeError, r"tk: expected dtype torch.float32"),
    ("type", dict(tv=3.0), TypeError, r"tv: expected a torch.Tensor or None"),
    ("device", dict(tq=torch.empty(2, 4, 8, 16, device="meta")), ValueError, r"tq: expected device"),
]


@pytest.mark.parametrize("tangent, exc, msg", [c[1:] for c in TANGENT_CASES], ids=[c[0] for c in TANGENT_CASES])
def test_bad_tangent_raises(tangent, exc, msg):
    args = _qkv()
    tangent = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) and not t.is_meta else t) for n, t in tangent.items()}
    with pytest.raises(exc, match=msg):
        flashjvp.attention_jvp(args["q"], args["k"], args["v"], **tangent)


@pytest.mark.gpu
def test_mixed_devices_raise():
    args = _qkv(v=torch.randn(2, 2, 6, 8))
    with pytest.raises(ValueError, match=r"v: expected device cuda"):
        flashjvp.attention(args["q"], args["k"], args["v"])
