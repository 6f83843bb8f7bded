"""Host (Python) time of the forward launcher without a GPU: ``attn_fwd`` with the Triton launch
stubbed out, for a plain forward at B32 H16 N256 D72 (bf16 CPU tensors), microseconds per call
(median of 5 timings of 3000 calls). It runs on the CPU machine; the number is the launcher's own
Python, not Triton's launch.

    PYTHONPATH=src python scripts/launcher_host_time.py
"""

import statistics
import time

import torch

from flashjvp import _fwd
from flashjvp._validate import check_inputs


def main():
    _fwd.launch_tuned = lambda *args, **kwargs: None
    q, k, v = (torch.randn(32, 16, 256, 72, dtype=torch.bfloat16) for _ in range(3))
    a = check_inputs(q, k, v)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(3000):
            _fwd.attn_fwd(q, k, v, None, None, None, a)
        times.append((time.perf_counter() - t0) / 3000 * 1e6)
    print(f"attn_fwd host time without the launch: {statistics.median(times):.1f} us per call")


if __name__ == "__main__":
    main()
