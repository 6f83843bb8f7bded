#!/usr/bin/env bash
# One GPU session, run from the repo root: bash scripts/gpu_run.sh STEP[,STEP...]
# Steps: tests (GPU test matrix, fp16/bf16/fp32), bench (python -m flashjvp.bench $BENCH_ARGS),
# bench2 (a second benchmark run with $BENCH2_ARGS, environment $BENCH2_ENV, e.g. FLASHJVP_TMA=1),
# probe (scripts/host_probe.py $PROBE_ARGS: GPU kernel time vs do_bench per call), models (model tests with their peak-memory
# lines), sweep (scripts/tile_sweep.py $SWEEP_ARGS), demo (examples/meanflow_digits.py, GPU configuration),
# tmacheck (the TMA path: each tile's error vs float64, then its GPU tests, -v so that a
# run cut by its limit still names each finished test), soak (benchmarks/experiments/ws_soak.py
# $SOAK_ARGS), seqmajor (benchmarks/experiments/seq_major.py: (B, N, H, D) storage, pointer vs TMA).
# Limits: TEST_LIMIT, BENCH_LIMIT, BENCH2_LIMIT, PROBE_LIMIT, SWEEP_LIMIT, DEMO_LIMIT, SOAK_LIMIT, SEQMAJOR_LIMIT seconds; TEST_PATHS picks test files. Logs and results go to $OUT.
# Wheels in .whl/ (timm, diffusers: versions as in the Makefile) are installed first if present.
# TRITON_NEXT=1: run everything on the Triton packed by benchmarks/experiments/slim_triton.sh
# (.t39/t39.tar.xz, carried) instead of the device's own.
set -uo pipefail
OUT=${OUT:-/tmp/flashjvp-gpu}  # the device tool returns what is written under $OUT
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 FLASHJVP_POISON=1
steps=",${1:-tests,bench},"
has() { [[ $steps == *",$1,"* ]]; }
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
if [[ ${TRITON_NEXT:-0} == 1 ]]; then
  [ -d /tmp/site39/triton ] || python3 -c "import tarfile; tarfile.open('.t39/t39.tar.xz').extractall('/tmp/site39')" || exit 1
  # the device's own Triton registers an AMD backend (not packed); 3.9 compiles sm_90 with its
  # "ptxas-blackwell" (not packed: CUDA's own ptxas instead)
  export PYTHONPATH=/tmp/site39:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if has tests; then
  FLASHJVP_AUTOTUNE=0 timeout ${TEST_LIMIT:-540} python3 -m pytest ${TEST_PATHS:-tests} -v -rfE --tb=short -n 14 -p no:cacheprovider \
    -p no:benchmark --ignore=tests/test_example.py 2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
  pkill -f "pytest" 2>/dev/null; sleep 2  # xdist workers outlive a timed-out controller: keep them off the GPU
fi
if has tmacheck; then
  FLASHJVP_POISON=0 FLASHJVP_TMA=1 timeout ${TMACHECK_LIMIT:-120} python3 scripts/tile_sweep.py --no-autotune --shapes 1,8,1024,128 1,8,1024,64 \
    --modes fwd_jvp fwd --dtype bfloat16 float16 --check 2>&1 | tee "$OUT/tmacheck.txt"
  FLASHJVP_AUTOTUNE=0 timeout ${TEST_LIMIT:-240} python3 -m pytest tests/test_gpu.py tests/test_forward.py -k tma -v -rfE \
    --tb=short -n 14 -p no:cacheprovider -p no:benchmark 2>&1 | tee "$OUT/tests_tma.log" | grep -E "FAILED|ERROR|passed|failed" | tail -30
  pkill -f "pytest" 2>/dev/null; sleep 2
fi
if has soak; then
  timeout ${SOAK_LIMIT:-300} python3 benchmarks/experiments/ws_soak.py ${SOAK_ARGS:-1:128,64,4,2,1 1:64,64,4,2,1} \
    2>&1 | grep -v Warn | tee "$OUT/soak.txt"
fi
if has seqmajor; then
  FLASHJVP_POISON=0 timeout ${SEQMAJOR_LIMIT:-200} python3 benchmarks/experiments/seq_major.py 2>&1 | tee "$OUT/seq_major.txt"
fi
if has models; then
  timeout ${MODELS_LIMIT:-200} python3 -m pytest ${MODELS_TESTS:-tests/test_models.py -m gpu} -s -v --tb=short \
    -p no:cacheprovider 2>&1 | tee "$OUT/models.log" | grep -E "peak memory|PASSED|FAILED|passed|failed|Error" | tail -20
fi
bench() {  # bench NAME EXTRA_ARGS TIME_LIMIT: one benchmark run into $OUT/NAME
  FLASHJVP_POISON=0 python3 -m flashjvp.bench --quick --time-limit $3 $2 \
    --out "$OUT/$1" 2>&1 | tee "$OUT/$1.log" | grep -E "^\[|wrote" | tail -60
}
if has bench; then bench bench1 "${BENCH_ARGS:-}" "${BENCH_LIMIT:-520}"; fi
if has bench2; then (export ${BENCH2_ENV:-FLASHJVP_TMA=0}; bench bench2 "${BENCH2_ARGS:-}" "${BENCH2_LIMIT:-520}"); fi
if has probe; then
  FLASHJVP_POISON=0 timeout ${PROBE_LIMIT:-200} python3 scripts/host_probe.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.txt"
fi
if has sweep; then
  FLASHJVP_POISON=0 timeout ${SWEEP_LIMIT:-200} python3 scripts/tile_sweep.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.txt"
fi
if has demo; then
  FLASHJVP_POISON=0 timeout ${DEMO_LIMIT:-300} python3 examples/meanflow_digits.py --out "$OUT/demo" \
    ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" | tr '\r' '\n' | grep -v "it/s\]$" | tail -25
fi
rm -f "$OUT"/bench*/bench.png "$OUT"/bench*/bench.md  # the device tool returns at most 8 files; --merge remakes these
