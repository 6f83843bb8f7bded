"""flashjvp's forward+JVP under one environment setting each, as ``--kernel`` plug-ins of
``python -m benchmarks.bench``, so that one run times flashjvp's paths side by side:

- ``auto``: ``FLASHJVP_TMA=auto`` (the default policy);
- ``tma``: ``FLASHJVP_TMA=1`` (the tensor-descriptor path forced on);
- ``pointers``: ``FLASHJVP_TMA=0`` (forced off);
- ``nosplit``: the default with tail splitting off (``FLASHJVP_TAIL_SPLIT=0``).

    PYTHONPATH=src python -m benchmarks.bench --modes fwd_jvp \
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


def pointers(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("0", q, k, v, tq, tk, tv, causal, scale)


def auto(q, k, v, tq, tk, tv, causal, scale):
    return _with_tma("auto", q, k, v, tq, tk, tv, causal, scale)


def nosplit(q, k, v, tq, tk, tv, causal, scale):
    return _with_env("FLASHJVP_TAIL_SPLIT", "0", q, k, v, tq, tk, tv, causal, scale)
