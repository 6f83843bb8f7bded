"""Quick timing probe on the GPU: flashjvp vs PyTorch SDPA vs the reference kernel on a few
shapes (bf16). The full suite is ``python -m flashjvp.bench``; this is for kernel iteration."""

import importlib.util
import sys
import time
import types

import torch
import triton

import flashjvp
from flashjvp import _bwd, _fwd


def load_reference(path="benchmarks/third_party/reference_jvp.py"):
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except ImportError:
        stub = types.ModuleType("flash_attn.flash_attn_interface")
        stub._flash_attn_backward = stub._flash_attn_varlen_backward = None
        sys.modules["flash_attn"] = types.ModuleType("flash_attn")
        sys.modules["flash_attn.flash_attn_interface"] = stub
    try:
        spec = importlib.util.spec_from_file_location("reference_jvp", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.attention
    except Exception as e:  # noqa: BLE001
        print("reference kernel unavailable:", e)
        return None


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main():
    ref = load_reference()
    shapes = [(4, 32, 4096, 64, False), (4, 32, 4096, 64, True), (2, 24, 4096, 128, False),
              (1, 12, 32768, 128, False)]
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for b, h, n, d, causal in shapes:
        q, k, v, tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(6))
        fl = 4 * b * h * n * n * d * (0.5 if causal else 1)
        t0 = time.time()
        flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal)
        torch.cuda.synchronize()
        first = time.time() - t0
        res = {}
        res["fj fwd+jvp"] = (bench(lambda: flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal)), 3)
        res["fj fwd"] = (bench(lambda: flashjvp.attention(q, k, v, causal=causal)), 1)
        if ref is not None:
            try:
                res["ref fwd+jvp"] = (bench(lambda: ref(q, k, v, tq, tk, tv, causal, d ** -0.5)), 3)
            except Exception as e:  # noqa: BLE001
                print("ref failed", e)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        F = torch.nn.functional
        for name, be in (("torch flash", SDPBackend.FLASH_ATTENTION), ("torch cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    res[f"{name} fwd"] = (bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), 1)
                    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    do = torch.randn_like(o)
                    res[f"{name} bwd"] = (bench(lambda: o.backward(do, retain_graph=True)), 2.5)
            except Exception as e:  # noqa: BLE001
                print(name, "failed", e)
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        o = flashjvp.attention(qg, kg, vg, causal=causal)
        do = torch.randn_like(o)
        res["fj bwd"] = (bench(lambda: o.backward(do, retain_graph=True)), 2.5)
        print(f"\nB={b} H={h} N={n} D={d} causal={causal}  (first fwd+jvp call incl. autotune: {first:.1f}s)")
        for name, (ms, mult) in res.items():
            print(f"  {name:18s} {ms:8.3f} ms  {fl * mult / ms * 1e-9:7.1f} TFLOP/s")
        for name, kern in (("fwd", _fwd._attn_fwd_kernel), ("dkdv", _bwd._attn_bwd_dkdv_kernel),
                           ("dq", _bwd._attn_bwd_dq_kernel)):
            for cfg in list(kern.cache.values())[-2:]:
                print(f"  {name} config: {cfg}")
        del q, k, v, tq, tk, tv, qg, kg, vg, o, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
