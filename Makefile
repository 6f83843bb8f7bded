# flashjvp: `make test` and `make demo` set up a fresh machine by themselves (a venv in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU CI pins torch's CPU build (2.13.0), Triton 3.6 and the model libraries tested with them
# (torchvision 0.28.0 pairs with torch 2.13.0); the rest comes from the `dev` extra (pyproject.toml).
PINS := torch==2.13.0 triton==3.6.0 torchvision==0.28.0 timm==1.0.31 diffusers==0.42.1 transformers==5.23.0
HAS_GPU = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# The newest Triton on PyPI, in a second venv: `make test-triton-latest` runs the kernel tests under
# its interpreter (numpy >= 2.4 is fine there), so the supported range is the tested one.
LATEST_VENV ?= .venv-triton-latest
LATEST_PY := $(LATEST_VENV)/bin/python
LATEST_PINS := torch==2.13.0 triton==3.9.0 numpy pytest pytest-xdist
LATEST_TESTS := tests/test_forward.py tests/test_backward.py tests/test_block_mask.py tests/test_masks.py \
	tests/test_window.py tests/test_varlen.py tests/test_padding.py tests/test_second_order.py tests/test_split.py \
	tests/test_launch_fallback.py tests/test_route.py tests/test_plan.py

.PHONY: test test-full test-triton-latest demo lint bench gpu-test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINS)
	$(PY) -m pip install -q -e ".[dev]" $(PINS)
	touch $(STAMP)

# `make test` samples the big parametrized matrices (tests/conftest.py: MATRICES): every value of
# every parameter in each run, the combinations by a seed, FLASHJVP_TEST_SEED (default 0), printed
# in pytest's header and summary; `make test-full` runs every parametrization.
test: $(STAMP)  ## the suite, matrices sampled; on a machine without a GPU the kernels run in Triton's interpreter
	$(PY) -m pytest tests -q -n auto

test-full: $(STAMP)  ## the whole suite, every parametrization of every matrix (about twice as long)
	FLASHJVP_TEST_FULL=1 $(PY) -m pytest tests -q -n auto

$(LATEST_VENV)/.installed: pyproject.toml
	test -x $(LATEST_PY) || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PY) -m pip install -q $(LATEST_PINS)
	$(LATEST_PY) -m pip install -q --no-deps -e .
	touch $@

test-triton-latest: $(LATEST_VENV)/.installed  ## the kernel tests (matrices sampled) under the newest Triton
	$(LATEST_PY) -c "import triton; print('triton', triton.__version__)"
	$(LATEST_PY) -m pytest $(LATEST_TESTS) -q -n auto

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples scripts benchmarks

# On a CPU: a smaller model that still trains to a meaningful figure in a few minutes on 2 cores.
CPU_DEMO := --device cpu --steps 1500 --dim 64 --depth 4 --heads 4 --batch-size 128 --lr 1e-3

demo: $(STAMP)  ## train MeanFlow on the 8x8 digits (GPU if there is one, else the CPU config above)
	env -u TRITON_INTERPRET $(PY) examples/meanflow_digits.py $(if $(filter 1,$(HAS_GPU)),,$(CPU_DEMO)) \
		--out outputs/meanflow_digits

bench:  ## on a GPU machine: the benchmark suite (results under benchmarks/results/<gpu>/)
	PYTHONPATH=src $(PYTHON) -m benchmarks.bench

gpu-test:  ## on a GPU machine: the full GPU test matrix
	PYTHONPATH=src FLASHJVP_AUTOTUNE=0 FLASHJVP_TEST_FULL=1 $(PYTHON) -m pytest tests -q -n 8

clean:
	rm -rf $(VENV) $(LATEST_VENV) outputs .pytest_cache
