"""Lazy rescaling of the unmasked key loop (kernel flag LAZY_RESCALE) against rescaling every
block, tiles forced, outputs compared with the exact-rescale run. Run from the repo root with
PYTHONPATH=src on the GPU."""
import os
import sys

import torch
import triton
import triton.testing

import flashjvp

sys.path.insert(0, "scripts")
from tile_sweep import _force  # noqa: E402

os.environ["FLASHJVP_TMA"] = "0"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
xa = [torch.randn(1, 40, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32760, 512, 512, 32760, 512, 512)]
d64 = [torch.randn(4, 32, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
cases = [("xattn q", xa[:4], False, (128, 64, 8, 3)), ("xattn qkv", xa, False, (128, 64, 8, 2)),
         ("d64 qkv", d64, False, (128, 128, 8, 2)), ("d64 qkv causal", d64, True, (128, 128, 8, 2))]
for label, args, causal, t in cases:
    fn = lambda args=args, causal=causal: flashjvp.attention_jvp(*args, causal=causal)  # noqa: E731
    base = None
    for lazy in (False, True):
        _force([triton.Config({"BLOCK_M": t[0], "BLOCK_N": t[1], "WS": False, "LAZY_RESCALE": lazy},
                              num_warps=t[2], num_stages=t[3])])
        try:
            o, to = fn()
            torch.cuda.synchronize()
            if base is None:
                base = (o.clone(), to.clone())
            diff = max((o - base[0]).abs().max().item(), (to - base[1]).abs().max().item())
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            print(f"{label} {t} lazy={lazy}: {ms:.4f} ms  max|diff| vs exact {diff:.3g}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{label} {t} lazy={lazy}: {type(e).__name__} {str(e)[:200]}", flush=True)
