"""``python -m flashjvp.bench [options]``: runs the benchmark suite of a source checkout,
``benchmarks/bench.py`` (``python -m benchmarks.bench``); the package itself holds the library only.
See ``benchmarks/README.md``."""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, when flashjvp is imported from its src/

if __name__ == "__main__":
    if not (ROOT / "benchmarks" / "bench.py").is_file():
        sys.exit(f"flashjvp.bench: no benchmarks/bench.py under {ROOT}. The benchmark suites live in "
                 "benchmarks/ of a source checkout of flashjvp: run `PYTHONPATH=src python -m benchmarks.bench` "
                 "(or benchmarks.bench_masks, benchmarks.models) from its root.")
    sys.path.insert(0, str(ROOT))
    runpy.run_module("benchmarks.bench", run_name="__main__", alter_sys=True)
