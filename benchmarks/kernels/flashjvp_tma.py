"""flashjvp with the experimental tensor-descriptor / warp-specialized forward (FLASHJVP_TMA=1),
as a ``--kernel`` for the benchmark, so that one run times it next to the default path:

    python -m flashjvp.bench --modes fwd_jvp --kernel flashjvp-tma=benchmarks/kernels/flashjvp_tma.py:attention
"""

import os

import flashjvp


def attention(q, k, v, tq, tk, tv, causal, scale):
    before = os.environ.get("FLASHJVP_TMA")
    os.environ["FLASHJVP_TMA"] = "1"
    try:
        return flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, scale=scale)
    finally:
        if before is None:
            del os.environ["FLASHJVP_TMA"]
        else:
            os.environ["FLASHJVP_TMA"] = before
