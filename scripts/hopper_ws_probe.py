"""Does Triton's automatic warp specialization apply on Hopper? Compile-only, no GPU needed.

Compiles a minimal FlashAttention forward loop for sm_90a with ``tl.range(...,
warp_specialize=WS)`` in two variants, K/V read through tensor descriptors (TMA) or through
pointers (``cp.async``), for 4 and 8 warps, and counts what the PTX holds: ``setmaxnreg`` (the
register split between producer and consumer warp groups, present only when the loop was
specialized), wgmma, TMA copies and mbarriers. A third variant takes host-made 4-D tensor
descriptors over (B, H, N, D) (``triton.tools.tensor_descriptor.TensorDescriptor``: no
descriptor is built or fenced on the device) and stores through pointers. Findings with Triton
3.6 are in benchmarks/NOTES.md.

    python scripts/hopper_ws_probe.py
"""

from __future__ import annotations

import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def _softmax_step(q, k, v, acc, m, l_sum):
    """One key block of the online softmax: k (D, BN), v (BN, D) into acc (BM, D), m, l_sum (BM,)."""
    s = tl.dot(q, k)  # (BM, BN)
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])  # (BM, BN)
    alpha = tl.math.exp2(m - m_new)
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_sum


@triton.jit
def _probe_kernel(Q, K, V, O, N, stride_n, WS: tl.constexpr, TMA: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)  # (BM,)
    offs_n = tl.arange(0, BN)  # (BN,)
    offs_d = tl.arange(0, D)  # (D,)
    if TMA:
        q = tl.make_tensor_descriptor(Q, [N, D], [stride_n, 1], [BM, D]).load([tl.program_id(0) * BM, 0])  # (BM, D)
    else:
        q = tl.load(Q + offs_m[:, None] * stride_n + offs_d[None, :])  # (BM, D)
    k_desc = tl.make_tensor_descriptor(K, [N, D], [stride_n, 1], [BN, D])
    v_desc = tl.make_tensor_descriptor(V, [N, D], [stride_n, 1], [BN, D])
    acc = tl.zeros([BM, D], tl.float32)  # (BM, D)
    m = tl.full([BM], -float("inf"), tl.float32)  # (BM,)
    l_sum = tl.zeros([BM], tl.float32)  # (BM,)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        if TMA:
            k = k_desc.load([start, 0]).T  # (D, BN)
            v = v_desc.load([start, 0])  # (BN, D)
        else:
            k = tl.load(K + (start + offs_n)[None, :] * stride_n + offs_d[:, None])  # (D, BN)
            v = tl.load(V + (start + offs_n)[:, None] * stride_n + offs_d[None, :])  # (BN, D)
        acc, m, l_sum = _softmax_step(q, k, v, acc, m, l_sum)
    o = (acc / l_sum[:, None]).to(O.dtype.element_ty)  # (BM, D)
    if TMA:
        tl.make_tensor_descriptor(O, [N, D], [stride_n, 1], [BM, D]).store([tl.program_id(0) * BM, 0], o)
    else:
        tl.store(O + offs_m[:, None] * stride_n + offs_d[None, :], o)


@triton.jit
def _probe_host_desc_kernel(Qd, Kd, Vd, O, N, stride_n, WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            D: tl.constexpr):
    m0 = tl.program_id(0) * BM
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.arange(0, BM)  # (BM,)
    offs_d = tl.arange(0, D)  # (D,)
    q = Qd.load([b, h, m0, 0]).reshape(BM, D)  # (BM, D)
    acc = tl.zeros([BM, D], tl.float32)  # (BM, D)
    m = tl.full([BM], -float("inf"), tl.float32)  # (BM,)
    l_sum = tl.zeros([BM], tl.float32)  # (BM,)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        k = Kd.load([b, h, start, 0]).reshape(BN, D).T  # (D, BN)
        v = Vd.load([b, h, start, 0]).reshape(BN, D)  # (BN, D)
        acc, m, l_sum = _softmax_step(q, k, v, acc, m, l_sum)
    o = (acc / l_sum[:, None]).to(O.dtype.element_ty)  # (BM, D)
    tl.store(O + m0 * stride_n + rows[:, None] * stride_n + offs_d[None, :], o, mask=(rows < N - m0)[:, None])


def _compile_summary(kernel, signature, constexprs, warps: int) -> str:
    """Compile ``kernel`` for sm_90a (2 stages) and count what its PTX holds, or say why it failed."""
    try:
        ptx = triton.compile(ASTSource(kernel, signature, constexprs, {}), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "num_stages": 2}).asm["ptx"]
    except Exception as e:  # noqa: BLE001 - a probe: report the compiler's failure and go on
        return f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return (f"setmaxnreg {count('setmaxnreg')}, wgmma {count('wgmma.mma_async')}, "
            f"TMA copies {count('cp.async.bulk.tensor')}, mbarrier {count('mbarrier')}, "
            f"device-built descriptors {count('tensormap.cp_fenceproxy')}")


def probe_host_descriptors(ws: bool, warps: int, bm: int = 128) -> str:
    signature = {"Qd": f"tensordesc<bf16[1,1,{bm},128]>", "Kd": "tensordesc<bf16[1,1,64,128]>",
                 "Vd": "tensordesc<bf16[1,1,64,128]>", "O": "*bf16", "N": "i32", "stride_n": "i32",
                 "WS": "constexpr", "BM": "constexpr", "BN": "constexpr", "D": "constexpr"}
    constexprs = {(6,): ws, (7,): bm, (8,): 64, (9,): 128}
    return _compile_summary(_probe_host_desc_kernel, signature, constexprs, warps)


def probe(ws: bool, tma: bool, warps: int) -> str:
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "N": "i32", "stride_n": "i32",
                 "WS": "constexpr", "TMA": "constexpr", "BM": "constexpr", "BN": "constexpr", "D": "constexpr"}
    constexprs = {(6,): ws, (7,): tma, (8,): 128, (9,): 64, (10,): 128}
    return _compile_summary(_probe_kernel, signature, constexprs, warps)


def main() -> None:
    print("Triton", triton.__version__, "target sm_90a")
    for tma in (True, False):
        for warps in (4, 8):
            for ws in (False, True):
                print(f"{'TMA' if tma else 'pointers'}, {warps} warps, warp_specialize={ws}: {probe(ws, tma, warps)}",
                      flush=True)
    for warps, ws, bm in ((8, False, 128), (4, True, 128), (4, True, 64)):
        print(f"host descriptors (4-D), BM={bm}, {warps} warps, warp_specialize={ws}: "
              f"{probe_host_descriptors(ws, warps, bm)}", flush=True)


if __name__ == "__main__":
    main()
