"""A/B on the H200: D=64 forward+JVP tiles, and causal row blocks launched heaviest first."""
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".exp")
import fwd_rev  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp import _common, _fwd  # noqa: E402

BASE = _fwd._attn_fwd_kernel
FULL = list(BASE.configs)


def use(kernel, configs):
    kernel.configs = configs
    kernel.cache.clear()
    _common._TUNED.clear()
    _fwd._attn_fwd_kernel = kernel


def cfg(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": False}, num_warps=w, num_stages=s)


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
tiles = [cfg(*t) for t in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (64, 64, 4, 3),
                           (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 8, 4)]]
for causal in (False, True):
    x = [torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    fn = lambda x=x, causal=causal: flashjvp.attention_jvp(*x, causal=causal)  # noqa: E731
    use(BASE, FULL)
    o_ref, to_ref = fn()
    picked = [c for c in BASE.cache.values()]
    print(f"causal={causal} autotuned {picked} -> {triton.testing.do_bench(fn, return_mode='median'):.4f} ms",
          flush=True)
    for c in tiles:
        for name, kern in (("base", BASE), ("rev", fwd_rev._attn_fwd_kernel)) if causal else (("base", BASE),):
            try:
                use(kern, [c])
                o, to = fn()
                diff = max((o - o_ref).abs().max().item(), (to - to_ref).abs().max().item())
                t = triton.testing.do_bench(fn, return_mode="median")
                tflops = 1.6492674e12 / (2 if causal else 1) / t * 1e-9
                print(f"  {name} BM{c.kwargs['BLOCK_M']} BN{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}: "
                      f"{t:.4f} ms {tflops:.0f} TFLOP/s (max diff vs autotuned {diff:.3g})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {c}: {type(e).__name__} {str(e)[:100]}", flush=True)
use(BASE, FULL)
