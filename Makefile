# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow bench-ar bench-draft vllm-peer clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a looser pin would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	cd /tmp && $(CURDIR)/$(BIN)/blockspec generate "def fib(n):"
	cd /tmp && $(CURDIR)/$(BIN)/blockspec generate "def fib(n):" --method dflash
	cd /tmp && $(CURDIR)/$(BIN)/blockspec generate "def fib(n):" --method dspark

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The real vLLM (CPU build) in .venv-vllm, for benchmarks/vllm_peer.py and the `vllm` tests (make test-slow).
vllm-peer:
	bash benchmarks/vllm_peer_env.sh .venv-vllm

bench-ar: $(STAMP)
	$(BIN)/python benchmarks/ar_vs_transformers.py

clean:
	rm -rf $(VENV) .venv-vllm build dist src/*.egg-info
