# flashjvp: `make test` and `make demo` set up a fresh machine by themselves (a venv in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU CI pins torch's CPU build (2.13.0), Triton 3.6 and the model libraries tested with them
# (torchvision 0.28.0 pairs with torch 2.13.0); the rest comes from the `dev` extra (pyproject.toml).
PINS := torch==2.13.0 triton==3.6.0 torchvision==0.28.0 timm==1.0.31 diffusers==0.42.1 transformers==5.23.0
HAS_GPU = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

.PHONY: test demo lint bench gpu-test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PINS)
	$(PY) -m pip install -q -e ".[dev]" $(PINS)
	touch $(STAMP)

test: $(STAMP)  ## the whole suite; on a machine without a GPU the kernels run in Triton's interpreter
	$(PY) -m pytest tests -q -n auto

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
	PYTHONPATH=src FLASHJVP_AUTOTUNE=0 $(PYTHON) -m pytest tests -q -n 8

clean:
	rm -rf $(VENV) outputs .pytest_cache
