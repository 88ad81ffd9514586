# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install exactly what the project needs:
# torch 2.13.0 (CPU build), DeepSpeed 0.19.8 without compiled ops, megatron-core, this package (editable).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megatron-ucp-installed
TORCH_VERSION := 2.13.0
DEEPSPEED_VERSION := 0.19.8
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export PYTHONUNBUFFERED := 1

.PHONY: venv demo test bench clean-venv lint

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m megatron_ucp.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py

clean-venv:
	rm -rf $(VENV)
