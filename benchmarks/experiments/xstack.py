"""tq-only forward+JVP with S and tS from one product ([Q; tQ].K^T: .exp/fwd_stack.py, written by
make_fwd_stack.py) against the present kernel, in one process: the 512-key cross-attention (tq
only and all tangents), B2 H24 N4096 D128 and B4 H32 N4096 D64 with tq only; autotuned and forced
tiles; errors against float64 on two heads. Then tail splitting on and off at B1 H24 N16384 D128.
Run from the repo root with PYTHONPATH=src after make_fwd_stack.py."""
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, ".exp")
import fwd_stack  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp import _common, _fwd  # noqa: E402
from flashjvp.ref import attention_jvp_ref  # noqa: E402

BASE, STACK = _fwd._attn_fwd_kernel, fwd_stack._attn_fwd_kernel
FULL = {BASE: list(BASE.configs), STACK: list(STACK.configs)}


def use(kernel, configs=None):
    kernel.configs = configs or FULL[kernel]
    kernel.cache.clear()
    _common._TUNED.clear()
    _fwd._attn_fwd_kernel = kernel


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def tensors(b, h, nq, nk, d):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for n in (nq, nk, nk, nq, nk, nk)]


def err(x, o, to):
    r = attention_jvp_ref(*[t[:, :2].double() for t in x[:4]])
    return f"err o {float((o[:, :2] - r[0]).abs().max()):.2e} to {float((to[:, :2] - r[1]).abs().max()):.2e}"


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
shapes = {"xattn": (1, 40, 32760, 512, 128), "d128": (2, 24, 4096, 4096, 128), "d64": (4, 32, 4096, 4096, 64)}
for name, shape in shapes.items():
    x = tensors(*shape)
    tq_only = lambda x=x: flashjvp.attention_jvp(*x[:4])  # noqa: E731
    outs = {}
    for kern, label in ((BASE, "base"), (STACK, "stack")):
        use(kern)
        outs[label] = tq_only()
        print(f"{name} tq {label}: {err(x, *outs[label])} cfg {_common.last_config['_attn_fwd_kernel']}", flush=True)
    d = [float((a.float() - b.float()).abs().max()) for a, b in zip(outs["base"], outs["stack"])]
    print(f"{name} stack vs base max|diff| o {d[0]:.2e} to {d[1]:.2e}", flush=True)
    for rnd in range(2):
        for kern, label in ((BASE, "base"), (STACK, "stack")):
            use(kern)
            tq_only()
            print(f"{name} round {rnd} tq {label}: {ms(tq_only):.4f} ms", flush=True)
        if name == "xattn":
            use(BASE)
            full = lambda x=x: flashjvp.attention_jvp(*x)  # noqa: E731
            full()
            print(f"{name} round {rnd} all tangents base: {ms(full):.4f} ms", flush=True)
    if name == "xattn":
        for t in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 64, 4, 3)]:
            c = triton.Config({"BLOCK_M": t[0], "BLOCK_N": t[1], "WS": False}, num_warps=t[2], num_stages=t[3])
            for kern, label in ((BASE, "base"), (STACK, "stack")):
                use(kern, [c])
                try:
                    tq_only()
                    print(f"{name} forced {t} tq {label}: {ms(tq_only):.4f} ms", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} forced {t} tq {label}: {type(e).__name__} {str(e)[:100]}", flush=True)
use(BASE)
x = tensors(1, 24, 16384, 16384, 128)
full = lambda: flashjvp.attention_jvp(*x)  # noqa: E731
for rnd in range(2):
    for flag in ("1", "0"):
        os.environ["FLASHJVP_TAIL_SPLIT"] = flag
        full()
        print(f"N16384 H24 D128 all tangents round {rnd} split={flag}: {ms(full):.4f} ms "
              f"merges {_fwd.launches['split']}", flush=True)
