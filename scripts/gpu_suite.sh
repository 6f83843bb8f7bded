#!/usr/bin/env bash
# The GPU test suite and the benchmark suite in one call, from the repository root of a GPU machine:
#
#   bash scripts/gpu_suite.sh [STEPS]      STEPS: a comma-separated list of tests, tuned, bench, masks,
#                                          host, dispatch, models (default tests,bench)
#
# The GPU test suite in one device call: `bash scripts/gpu_suite.sh tests,tuned` (every test file
# with one fixed tile per kernel and the big matrices sampled, then a sample of the kernel tests
# with autotuning on), writing $OUT/tests.md, the per-file table (scripts/tests_report.py).
#
# Environment: OUT (where logs and results go, default /tmp/flashjvp-gpu), TESTS (test files or
# node ids, default tests), TEST_LIMIT (seconds for the tests, default 300; pytest is then
# interrupted and still prints its summary), WORKERS (pytest-xdist workers, default 8: 12 ran out of memory on an 80 GiB H100),
# TUNED_LIMIT (seconds for the tuned sample, default 150), BENCH_LIMIT (the benchmark's
# --time-limit, default 240), BENCH_ARGS (more options for python -m benchmarks.bench, e.g. --modes fwd_jvp),
# MASKS_LIMIT (the masks benchmark's --time-limit, default 240), MASKS_ARGS (more options for
# python -m benchmarks.bench_masks, e.g. --cases 1,3); FLASHJVP_AUTOTUNE is passed through.
# The benchmark adds the reference kernel when benchmarks/third_party/reference_jvp.py exists.
# HOST_ARGS, DISPATCH_ARGS and MODELS_ARGS add options to python -m benchmarks.host_time,
# benchmarks.dispatch_table and benchmarks.models (MODELS_LIMIT: the last one's --time-limit,
# default 240; DISPATCH_LIMIT: seconds for the dispatch table, default 300).
# Writes $OUT/gpu.txt, $OUT/tests.log, $OUT/bench.log, $OUT/bench/bench.{json,md,png}, and for the
# masks step $OUT/masks.log and $OUT/masks/masks.{json,md}.
set -uo pipefail
OUT=${OUT:-/tmp/flashjvp-gpu}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
steps=",${1:-tests,bench},"
has() { [[ $steps == *",$1,"* ]]; }

# Wheels in .whl/ (for a machine without network: e.g. timm, diffusers for the model tests) first.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi

# (a) the machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

# (b) the GPU tests: one fixed tile per kernel (no autotuning), outputs NaN-filled before each launch
if has tests; then
  par=(); python3 -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-8}")  # serial without pytest-xdist
  # shellcheck disable=SC2086  # TESTS is split into paths on purpose
  PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
  FLASHJVP_AUTOTUNE=0 FLASHJVP_POISON=1 timeout -s INT -k 30 "${TEST_LIMIT:-300}" python3 -m pytest ${TESTS:-tests} -q -rfE \
    --tb=short --durations=40 "${par[@]}" -p no:cacheprovider --ignore=tests/test_example.py \
    --junitxml="$OUT/tests.xml" >"$OUT/tests.log" 2>&1 &
  tpid=$!
  wait "$tpid"; echo "tests: exit status $?"
  # xdist workers can outlive a timed-out run: end what is left of timeout's process group
  pkill -KILL -g "$tpid" 2>/dev/null
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
fi

# (b') a sample of the kernel tests with autotuning on: the tiles users get (another seed's sample)
if has tuned; then
  par=(); python3 -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-8}")
  PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} FLASHJVP_TEST_SEED=tuned \
  FLASHJVP_AUTOTUNE=1 FLASHJVP_POISON=1 timeout -s INT -k 30 "${TUNED_LIMIT:-150}" python3 -m pytest \
    tests/test_forward.py tests/test_backward.py tests/test_second_order.py tests/test_block_mask.py -q -rfE \
    --tb=short "${par[@]}" -p no:cacheprovider --junitxml="$OUT/tuned.xml" >"$OUT/tuned.log" 2>&1 &
  tpid=$!
  wait "$tpid"; echo "tuned: exit status $?"
  pkill -KILL -g "$tpid" 2>/dev/null
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tuned.log" | tail -20
fi
if has tests || has tuned; then
  xmls=(); titles=()
  [[ -f $OUT/tests.xml ]] && xmls+=("$OUT/tests.xml") && titles+=(--title "every file, fixed tiles (FLASHJVP_AUTOTUNE=0)")
  [[ -f $OUT/tuned.xml ]] && xmls+=("$OUT/tuned.xml") && titles+=(--title "kernel tests, tuned tiles (FLASHJVP_AUTOTUNE=1)")
  ((${#xmls[@]})) && python3 scripts/tests_report.py "${xmls[@]}" "${titles[@]}" --meta "$OUT/gpu.txt" \
    --command "bash scripts/gpu_suite.sh ${1:-tests,bench}" --out "$OUT/tests.md" && cat "$OUT/tests.md"
fi

# (c) the benchmark suite (--time-limit records what is left as skipped, so the report is written)
if has bench; then
  ref=benchmarks/third_party/reference_jvp.py  # the reference kernel (gitignored): timed when present
  refk=(); [[ -f $ref ]] && refk=(--kernel "reference=$ref:attention")
  # shellcheck disable=SC2086  # BENCH_ARGS is split into options on purpose
  FLASHJVP_POISON=0 python3 -m benchmarks.bench --quick --time-limit "${BENCH_LIMIT:-240}" "${refk[@]}" ${BENCH_ARGS:-} \
    --out "$OUT/bench" >"$OUT/bench.log" 2>&1
  echo "bench: exit status $?"
  grep -E "^\[|time limit|wrote" "$OUT/bench.log" | tail -60
fi

# (d) the masks benchmark: varlen vs padded, sliding window, key padding, masked sdpa
if has masks; then
  # shellcheck disable=SC2086  # MASKS_ARGS is split into options on purpose
  FLASHJVP_POISON=0 python3 -m benchmarks.bench_masks --quick --time-limit "${MASKS_LIMIT:-240}" ${MASKS_ARGS:-} \
    --out "$OUT/masks" >"$OUT/masks.log" 2>&1
  echo "masks: exit status $?"
  grep -E "^\[|time limit|wrote" "$OUT/masks.log" | tail -70
fi

# (e) host time per eager call, the plain-path dispatch table, the model-level benchmark
if has host; then
  # shellcheck disable=SC2086
  FLASHJVP_POISON=0 timeout 120 python3 -m benchmarks.host_time --out "$OUT" ${HOST_ARGS:-} 2>&1 | tail -12
fi
if has dispatch; then
  # shellcheck disable=SC2086
  FLASHJVP_POISON=0 timeout "${DISPATCH_LIMIT:-300}" python3 -m benchmarks.dispatch_table --quick --out "$OUT" \
    ${DISPATCH_ARGS:-} >"$OUT/dispatch.log" 2>&1
  echo "dispatch: exit status $?"
fi
if has models; then
  # shellcheck disable=SC2086
  FLASHJVP_POISON=0 python3 -m benchmarks.models --time-limit "${MODELS_LIMIT:-240}" --out "$OUT" ${MODELS_ARGS:-} \
    >"$OUT/models.log" 2>&1
  echo "models: exit status $?"
  grep -E "^\|" "$OUT/models.log" | tail -40
fi
