"""Writes .exp/fwd_norescale.py, .exp/fwd_nosums.py and .exp/fwd_neither.py for bounds.py: copies
of src/flashjvp/_fwd.py WITHOUT (a) the per-block rescaling of acc_o and acc_t by alpha, (b) the
row sums l and r (cross-lane reductions), (c) both. Their results are WRONG: they only bound what
removing that work from the key loop could gain (e.g. by rescaling once per two key blocks, or
deferring the sums). Run from the repo root before bounds.py."""
from pathlib import Path

BASE = Path("src/flashjvp/_fwd.py").read_text()
RESCALE = [("acc_o = tl.dot(e.to(v.dtype), v, acc_o * alpha[:, None], input_precision=DOT_PREC)",
            "acc_o = tl.dot(e.to(v.dtype), v, acc_o, input_precision=DOT_PREC)"),
           ("acc_t = acc_t * alpha[:, None]  # (BLOCK_M, BLOCK_DV)", "acc_t = acc_t  # not rescaled")]
SUMS = [("        l_i = l_i * alpha + tl.sum(e, 1)\n", "        l_i = l_i * alpha + 1.0\n"),
        ("            r_i = r_i * alpha + tl.sum(hs, 1)\n", "")]


def variant(subs):
    src = BASE
    for old, new in subs:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return src


Path(".exp").mkdir(exist_ok=True)
for name, subs in (("norescale", RESCALE), ("nosums", SUMS), ("neither", RESCALE + SUMS)):
    Path(f".exp/fwd_{name}.py").write_text(variant(subs))
