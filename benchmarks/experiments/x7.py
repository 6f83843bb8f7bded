"""tq-only vs all-tangent video cross-attention (B1 H40 Nq32760 Nk512 D128): defaults, then forced tiles for tq-only."""
import os
import sys

import torch
import triton
import triton.testing

import flashjvp
from flashjvp import _common, _fwd

sys.path.insert(0, "scripts")
from tile_sweep import _force  # noqa: E402

FULL = list(_fwd._attn_fwd_kernel.configs)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
x = [torch.randn(1, 40, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32760, 512, 512, 32760, 512, 512)]
for _round in range(2):
    for label, args in (("qkv", x), ("q", x[:4])):
        fn = lambda args=args: flashjvp.attention_jvp(*args)  # noqa: E731
        fn()
        print(f"default {label}: {triton.testing.do_bench(fn, warmup=25, rep=200, return_mode='median'):.4f} ms "
              f"{_common.last_config}", flush=True)
os.environ["FLASHJVP_TMA"] = "0"
fn = lambda: flashjvp.attention_jvp(*x[:4])  # noqa: E731
for t in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 4), (64, 128, 4, 2), (128, 64, 8, 2)]:
    c = triton.Config({"BLOCK_M": t[0], "BLOCK_N": t[1], "WS": False}, num_warps=t[2], num_stages=t[3])
    _force([c])
    try:
        o, to = fn()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        print(f"q {t}: {ms:.4f} ms  finite={bool(torch.isfinite(to).all())}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"q {t}: {type(e).__name__} {str(e)[:90]}", flush=True)
_force(FULL)
