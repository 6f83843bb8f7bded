"""Do the warp-specialized TMA tiles leave outputs unwritten or NaN? Each WS tile is forced on a
few D128 shapes, all tangents and tq only, three calls each, every output buffer NaN-filled
first (FLASHJVP_POISON=1, set before the import). Prints per call the NaN count of o, to, lse
and mu, where the first and last NaN row is, and the largest finite difference from the pointer
path (128x64 w8 s2 tile). Then tq only on the TMA path against the pointer path, autotuned, at
B2 H24 N4096 D128. Run from the repo root with PYTHONPATH=src on the GPU."""
import os

os.environ["FLASHJVP_POISON"] = "1"

import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp import _common, _fwd  # noqa: E402

sys.path.insert(0, "scripts")
from tile_sweep import _force  # noqa: E402

FULL = list(_fwd._attn_fwd_kernel.configs)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
SHAPES = [(1, 40, 32760, 512), (1, 40, 32760, 1024), (2, 24, 4096, 4096), (1, 8, 777, 1333)]
x = {s: [torch.randn(s[0], s[1], n, 128, device="cuda", dtype=torch.bfloat16) for n in (s[2], s[3], s[3]) * 2]
     for s in SHAPES}


def call(s, given):
    args = x[s] if given == "qkv" else x[s][:4]
    return flashjvp.attention_jvp(*args, return_lse=True)


def config(bm, bn, w, st, ws):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WS": ws}, num_warps=w, num_stages=st)


os.environ["FLASHJVP_TMA"] = "0"
_force([config(128, 64, 8, 2, False)])
base = {(s, g): [t.clone() for t in call(s, g)] for s in SHAPES for g in ("qkv", "q")}
torch.cuda.synchronize()
os.environ["FLASHJVP_TMA"] = "1"
for tile in [(64, 64, 4, 2, True), (128, 64, 4, 2, True)]:
    _force([config(*tile)])
    for s in SHAPES:
        for g in ("qkv", "q"):
            for rep in range(3):
                try:
                    out = call(s, g)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    print(f"{tile} {s} {g}: {type(e).__name__} {str(e)[:120]}", flush=True)
                    break
                parts = []
                for name, t, b in zip(("o", "to", "lse", "mu"), out, base[(s, g)]):
                    bad = torch.isnan(t)
                    n = int(bad.sum())
                    fin = ~bad & torch.isfinite(b)
                    d = (t[fin].float() - b[fin].float()).abs().max().item() if fin.any() else float("nan")
                    where = ""
                    if n:
                        idx = bad.nonzero()
                        where = f" rows {idx[0, :3].tolist()}..{idx[-1, :3].tolist()}"
                    parts.append(f"{name} nan={n}{where} diff={d:.3g}")
                print(f"{tile} {s} {g} #{rep}: " + "; ".join(parts), flush=True)
_force(FULL)
s = (2, 24, 4096, 4096)
for path in ("0", "1", "0", "1"):
    os.environ["FLASHJVP_TMA"] = path
    fn = lambda: flashjvp.attention_jvp(*x[s][:4])  # noqa: E731
    fn()
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    print(f"tq only B2 H24 N4096 D128 tma={path}: {ms:.4f} ms", _common.last_config.get('_attn_fwd_kernel'), flush=True)
