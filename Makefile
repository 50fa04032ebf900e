# The README's two commands: `make bench` (the main job) and `make test` (the suite).
# Both set everything up on a fresh machine: .venv/ from the pinned lock file, the
# offline model/text packages, and the kvpress peer venv (.venv-kvpress/).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
FIND_LINKS := $(shell [ -d /opt/wheels ] && echo --find-links /opt/wheels)
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install bench bench-full test test-fast lint kvpress clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" $(FIND_LINKS)
	# exact pins, no resolution: the lock is the whole environment (torch 2.13.0+cpu from the local wheels)
	$(PIP) install -q --no-deps $(FIND_LINKS) -r requirements.lock
	$(PIP) install -q --no-deps --no-build-isolation -e .
	PIP=$(PIP) bash scripts/install_assets.sh
	# torchvision/torchaudio/torchcodec wheels fail to load next to torch 2.13.0+cpu and break transformers
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
	$(PY) -c "import torch, vtoken_sdk, vtoken_runtime, vtoken_cli; print('torch', torch.__version__)"
	touch $(STAMP)

kvpress: $(VENV)-kvpress/.installed

$(VENV)-kvpress/.installed: scripts/setup_kvpress.sh
	bash scripts/setup_kvpress.sh
	touch $@

bench: install
	$(VENV)/bin/vtoken-cli validate policies/*.py --examples 100
	$(VENV)/bin/vtoken-cli bench blocks --quick --json results/bench_blocks_quick.json --plot results/bench_blocks_quick.png

bench-full: install
	$(VENV)/bin/vtoken-cli bench blocks --json results/bench_blocks.json

# Three processes: Triton kernels run under TRITON_INTERPRET=1 (set by tests/triton/conftest.py) and
# vLLM engines start in-process, so neither the interpreter flag nor modules imported by the other
# suites (numba's JIT confuses vLLM's kernel rebinding on a second engine start) leak between them.
test: install kvpress
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/triton --ignore=tests/vllm
	$(PY) -m pytest -q -p no:cacheprovider tests/triton
	$(PY) -m pytest -q -p no:cacheprovider tests/vllm

# The fast suite: no real model, no vLLM engine; plus the Triton statistics kernel's value test (interpreter,
# own process: TRITON_INTERPRET must be set before triton is imported).
test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not vllm" --ignore=tests/triton --ignore=tests/vllm
	$(PY) -m pytest -q -p no:cacheprovider tests/triton/test_stats_values.py

lint: install
	$(VENV)/bin/ruff check vtoken_sdk runtime cli policies tests benchmarks

clean:
	rm -rf $(VENV) $(VENV)-kvpress build *.egg-info
