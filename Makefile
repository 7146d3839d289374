# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow bench-ar bench-draft clean

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

bench-ar: $(STAMP)
	$(BIN)/python benchmarks/ar_vs_transformers.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
