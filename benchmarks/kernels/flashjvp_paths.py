"""flashjvp's forward+JVP under each ``FLASHJVP_TMA`` setting: ``auto`` (the policy, the
default), ``tma`` (``1``: forced on), ``ws`` (``ws``: on, with the experimental warp-specialized
tiles; before a4c0031 ``1`` meant this) and ``pointers`` (``0``: off), and the default with tail
splitting off (``nosplit``: ``FLASHJVP_TAIL_SPLIT=0``), as ``--kernel``s for the benchmark, so
that one run times them next to the default:

    python -m flashjvp.bench --modes fwd_jvp \
        --kernel flashjvp-auto=benchmarks/kernels/flashjvp_paths.py:auto \
        --kernel flashjvp-ptr=benchmarks/kernels/flashjvp_paths.py:pointers
"""

import os

import flashjvp


def _with_env(name: str, value: str, q, k, v, tq, tk, tv, causal, scale):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return flashjvp.attention_jvp(q, k, v, tq, tk, tv, causal=causal, scale=scale)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _with_tma(mode: str, *args):
    return _with_env("FLASHJVP_TMA", mode, *args)


def tma(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("1", q, k, v, tq, tk, tv, causal, scale)


def ws(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("ws", q, k, v, tq, tk, tv, causal, scale)


def pointers(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("0", q, k, v, tq, tk, tv, causal, scale)


def auto(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("auto", q, k, v, tq, tk, tv, causal, scale)


def nosplit(q, k, v, tq, tk, tv, causal, scale):
    return _with_env("FLASHJVP_TAIL_SPLIT", "0", q, k, v, tq, tk, tv, causal, scale)
