"""Upper bounds for trimming the key loop: the forward+JVP kernel with and without the per-block
rescaling of acc_o / acc_t and the row sums l, r (.exp/fwd_*.py from make_fwd_bounds.py; those
variants give WRONG results, timing only), tiles forced to the autotuner's usual picks, two rounds.
Run from the repo root with PYTHONPATH=src after make_fwd_bounds.py."""
import importlib
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".exp")
import flashjvp  # noqa: E402
from flashjvp import _common, _fwd  # noqa: E402

KERNELS = {"base": _fwd._attn_fwd_kernel}
for name in ("norescale", "nosums", "neither"):
    KERNELS[name] = importlib.import_module(f"fwd_{name}")._attn_fwd_kernel


def force(kernel, tile):
    bm, bn, w, s = tile
    kernel.configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": False}, num_warps=w, num_stages=s)]
    kernel.cache.clear()
    _common._TUNED.clear()
    _fwd._attn_fwd_kernel = kernel


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
g = torch.Generator(device="cuda").manual_seed(0)
cases = [("xattn tq", (1, 40, 32760, 512, 128), 4, (128, 64, 8, 3)),
         ("xattn all", (1, 40, 32760, 512, 128), 6, (128, 64, 8, 2)),
         ("d64 all", (4, 32, 4096, 4096, 64), 6, (128, 128, 8, 2))]
for label, (b, h, nq, nk, d), n_args, tile in cases:
    x = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (nq, nk, nk, nq, nk, nk)]
    fn = lambda x=x, n_args=n_args: flashjvp.attention_jvp(*x[:n_args])  # noqa: E731
    for rnd in range(2):
        line = []
        for name, kernel in KERNELS.items():
            force(kernel, tile)
            fn()
            line.append(f"{name} {triton.testing.do_bench(fn, warmup=25, rep=200, return_mode='median'):.4f}")
        print(f"{label} {tile} round {rnd}: " + ", ".join(line) + " ms", flush=True)
