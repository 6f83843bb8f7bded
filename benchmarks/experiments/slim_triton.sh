#!/usr/bin/env bash
# Packs a Triton wheel for the device (the working tree that travels is limited to 64 MiB):
# Triton 3.9.0's cp312 wheel is 273 MB; without the AMD backend, the profiler and cupti, with
# libtriton stripped and xz-compressed it is 53 MB. Run from the repo root; writes .t39/t39.tar.xz
# (ignored via .git/info/exclude). On the device (`carry` .t39):
#   python3 -c "import tarfile; tarfile.open('.t39/t39.tar.xz').extractall('/tmp/site39')"
#   export PYTHONPATH=/tmp/site39:src TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_BLACKWELL_PATH=/usr/local/cuda/bin/ptxas
# (the device's own Triton registers an AMD backend; 3.9 compiles sm_90 with "ptxas-blackwell").
set -euo pipefail
VERSION=${1:-3.9.0}
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work" "triton==$VERSION"
(cd "$work" && unzip -q triton-*.whl && rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti \
  triton/backends/nvidia/lib/cupti-blackwell triton/backends/nvidia/bin/ptxas-blackwell \
  triton/_C/libproton.so triton/instrumentation && strip --strip-unneeded triton/_C/libtriton.so)
mkdir -p .t39
grep -qx ".t39/" .git/info/exclude || echo ".t39/" >> .git/info/exclude
tar -C "$work" -cf - triton | xz -T0 -6 > .t39/t39.tar.xz
rm -rf "$work"
ls -la .t39/t39.tar.xz
