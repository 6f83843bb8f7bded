#!/usr/bin/env bash
# One GPU session: tests (fp16/bf16/fp32) then the timing probe. Run from the repo root.
# Usage: bash scripts/gpu_run.sh [tests|bench|probe|tests+bench|all]; one step fills a 600 s device call
# (TEST_LIMIT, BENCH_LIMIT seconds). Logs go to $OUT (the device tool returns them).
set -uo pipefail
OUT=${OUT:-/tmp/flashjvp-gpu}  # the device tool returns what is written under $OUT
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 FLASHJVP_POISON=1
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $what == all || $what == tests || $what == tests+bench ]]; then
  FLASHJVP_AUTOTUNE=0 timeout ${TEST_LIMIT:-540} python3 -m pytest tests -v -rfE --tb=short -n 14 -p no:cacheprovider -p no:benchmark \
    --ignore=tests/test_example.py 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
fi
if [[ $what == all || $what == probe ]]; then
  FLASHJVP_POISON=0 timeout 230 python3 scripts/gpu_probe.py 2>&1 | tee "$OUT/probe.log"
fi
if [[ $what == all || $what == bench || $what == tests+bench ]]; then
  FLASHJVP_POISON=0 python3 -m flashjvp.bench --quick --time-limit ${BENCH_LIMIT:-520} ${BENCH_ARGS:-} --out "$OUT/nvidia-h200" \
    --kernel reference=benchmarks/third_party/reference_jvp.py:attention 2>&1 | tee "$OUT/bench.log" | tail -60
fi
