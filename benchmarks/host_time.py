"""Host (Python) time of flashjvp's public calls, with the Triton launch stubbed out.

Small attention calls are bound by the host: this measures what flashjvp's own Python adds per
call (argument checks, routing, buffers, launch arguments), without a GPU. It prints the best of
21 timings of ``--calls`` calls (as ``timeit`` does: the least disturbed), in microseconds per
call, for a plain forward and a forward+JVP at B32 H16 N256 D72 (bf16 CPU tensors; the path taken
is the one CUDA tensors take).

    PYTHONPATH=src python benchmarks/host_time.py
"""

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the kernel path (the launch is stubbed)

import torch  # noqa: E402

import flashjvp  # noqa: E402
from flashjvp import _fwd  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    _fwd.launch_tuned = lambda *a, **k: {"BLOCK_M": 64}
    q, k, v = (torch.randn(32, 16, 256, 72, dtype=torch.bfloat16) for _ in range(3))
    for name, fn in (("attention", lambda: flashjvp.attention(q, k, v)),
                     ("attention_jvp", lambda: flashjvp.attention_jvp(q, k, v, q, k, v))):
        print(f"{name}: {per_call_us(fn, args.calls):.1f} us per call")


if __name__ == "__main__":
    main()
