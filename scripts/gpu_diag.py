"""Isolate GPU-only mismatches: run variants each in a fresh process, print max errors."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CHILD = r'''
import sys, torch
sys.path.insert(0, "tests")
from helpers import make_qkv, jvp_refs, grad_refs, MEMORY_KINDS
import flashjvp
shape, kinds, layout, dtype, mode = eval(sys.argv[1])
dtype = getattr(torch, dtype)
torch.manual_seed(0)
kinds = tuple(kinds) if kinds else MEMORY_KINDS
def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    return ((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1)).item()
if mode == "fwd":
    q, k, v, tq, tk, tv = make_qkv(*shape, layout, dtype, kinds)
    out = flashjvp.attention_jvp(q, k, v, tq, tk, tv, layout=layout, return_lse=True)
    truth, _ = jvp_refs(q, k, v, tq, tk, tv, layout=layout)
    print(" ".join(f"{n}={rel(a, b):.1e}" for n, a, b in zip(("o", "to", "lse", "mu"), out, truth)))
else:
    q, k, v = make_qkv(*shape, layout, dtype, kinds, tangents=False)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    o = flashjvp.attention(*leaves, layout=layout)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    truth, _ = grad_refs(q, k, v, do, layout=layout)
    print(" ".join(f"{n}={rel(a, b):.1e}" for n, a, b in zip(("dq", "dk", "dv"), grads, truth)))
torch.cuda.synchronize()
'''

ROT = ("sliced", "strided", "contiguous", "swapped")
CONTIG = ("contiguous",)
VARIANTS = []
for mode in ("fwd", "bwd"):
    for shape in [(1, 3, 1, 37, 19, 72, 24), (1, 3, 3, 37, 19, 72, 24), (1, 4, 2, 37, 19, 72, 24),
                  (1, 3, 1, 37, 19, 64, 32), (1, 3, 1, 37, 19, 72, 72), (1, 1, 1, 37, 19, 72, 24),
                  (1, 3, 1, 64, 64, 64, 64), (1, 2, 2, 19, 53, 96, 72)]:
        for kinds in (CONTIG, ROT):
            for layout in ("bhnd", "bnhd"):
                VARIANTS.append((shape, kinds, layout, "float16", mode))



def run(var):
    r = subprocess.run([sys.executable, "-c", CHILD, repr(var)], capture_output=True, text=True, timeout=150)
    msg = r.stdout.strip() or ("ERR " + r.stderr.strip().splitlines()[-1][:150] if r.stderr.strip() else "no output")
    return f"{var[4]} {var[0]} {var[1][0][:6]} {var[2]} -> {msg}"


with ThreadPoolExecutor(8) as pool:
    for line in pool.map(run, VARIANTS):
        print(line, flush=True)
