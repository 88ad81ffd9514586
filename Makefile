# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install exactly what the project needs:
# torch 2.13.0 (CPU build), DeepSpeed 0.19.8 without compiled ops, this package (editable) with its
# test extra (the megatron-core stand-in for the demo and unit tests).
#
# `make test` also runs the DeepSpeed version matrix: every other release line users run is
# installed without dependencies into its own overlay folder, .venv-ds/<version> (DeepSpeed's
# dependencies are the same across 0.16-0.19 and live in .venv), and put first on PYTHONPATH.
# When the Megatron-DeepSpeed snapshot is beside this checkout (../shared/third_party, as in CI),
# its runtime dependencies and the ezpz launcher are installed too, and the tests against the real
# Megatron-DeepSpeed run on every release whose DeepSpeed it imports unedited (<= 0.19.5);
# then a skipped integration test is a failure.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.megatron-ucp-installed
TORCH_VERSION := 2.13.0
DEEPSPEED_VERSION := 0.19.8
# The release lines of the matrix (0.19.8, above, runs the full suite). Keep in step with
# megatron_ucp/versions.py INTERNALS.
DS_MATRIX := 0.16.2 0.16.9 0.17.6 0.18.9 0.19.5
# Where the real Megatron-DeepSpeed runs the full integration suite (both optimizer classes, the
# patch route, the wrapper flow); the other releases run a training + DP-change resume each.
DS_INTEGRATION_FULL := 0.19.5
MATRIX_DIR := .venv-ds
THIRD_PARTY ?= $(abspath ../shared/third_party)
MEGATRON_DEEPSPEED_DIR ?= $(THIRD_PARTY)/megatron-deepspeed
EZPZ_DIR ?= $(THIRD_PARTY)/ezpz
HAVE_MDS := $(shell test -f $(MEGATRON_DEEPSPEED_DIR)/pretrain_gpt_alcf.py && echo 1)
MDS_STAMP := $(VENV)/.megatron-deepspeed-runtime
# What Megatron-DeepSpeed's pretrain_gpt_alcf.py and `ezpz launch` need beyond torch and DeepSpeed
# (../shared/third_party/README.md).
MDS_RUNTIME := regex pybind11 six sentencepiece rich wandb nltk 'transformers<5' tensorboard mpi4py mpich \
	omegaconf hydra-core plotext seaborn torchinfo xarray ambivalent click hatchling
# Tests that exercise the hooks, the load path and the runner: run on every release of the matrix.
MATRIX_TESTS := tests/test_hooks_install.py tests/test_elastic_resume.py tests/test_runner.py tests/test_async_convert.py
RESULTS := .test-results
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export PYTHONUNBUFFERED := 1

.PHONY: venv matrix demo test test-main test-matrix bench clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test]'
	@touch $(STAMP)

$(MATRIX_DIR)/%/.installed: $(STAMP)
	rm -rf $(MATRIX_DIR)/$*
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation --no-deps --target $(MATRIX_DIR)/$* deepspeed==$*
	@touch $@

# Megatron-DeepSpeed's runtime and ezpz (installed from a temporary copy: the snapshot stays read-only).
$(MDS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet $(MDS_RUNTIME)
	tmp=$$(mktemp -d) && cp -r $(EZPZ_DIR) $$tmp/ezpz && chmod -R u+w $$tmp/ezpz && \
		$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation $$tmp/ezpz && rm -rf $$tmp
	@touch $@

matrix: $(foreach v,$(DS_MATRIX),$(MATRIX_DIR)/$(v)/.installed) $(if $(HAVE_MDS),$(MDS_STAMP))

demo: $(STAMP)
	$(BIN)/python -m megatron_ucp.demo

test: $(STAMP) matrix
	@rm -rf $(RESULTS) && mkdir -p $(RESULTS)
	$(MAKE) --no-print-directory test-main test-matrix; status=$$?; \
		$(BIN)/python tests/matrix_summary.py $(RESULTS); exit $$status

# The whole suite on DeepSpeed $(DEEPSPEED_VERSION) (the real Megatron-DeepSpeed does not import it unedited).
test-main: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/integration --junitxml=$(RESULTS)/deepspeed-$(DEEPSPEED_VERSION).xml

# Hooks, load path and runner on every release; the real Megatron-DeepSpeed where it runs. Every
# release runs even when one fails; the status is the worst.
test-matrix: matrix
	@status=0; for v in $(DS_MATRIX); do \
		overlay=$(abspath $(MATRIX_DIR))/$$v; \
		echo "=== DeepSpeed $$v: $(MATRIX_TESTS)"; \
		PYTHONPATH=$$overlay $(BIN)/python -m pytest -q $(MATRIX_TESTS) \
			--junitxml=$(RESULTS)/deepspeed-$$v.xml || status=1; \
		if [ -n "$(HAVE_MDS)" ]; then \
			if [ "$$v" = "$(DS_INTEGRATION_FULL)" ]; then select="integration"; \
			else select="(training or dp3) and $$(case $$v in 0.16.2|0.17.6) echo zero;; *) echo bf16;; esac)"; fi; \
			echo "=== DeepSpeed $$v: the real Megatron-DeepSpeed (-k '$$select')"; \
			PYTHONPATH=$$overlay MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) EZPZ_DIR=$(EZPZ_DIR) \
				MEGATRON_UCP_REQUIRE_INTEGRATION=1 \
				$(BIN)/python -m pytest -q tests/integration -k "$$select" \
				--junitxml=$(RESULTS)/megatron-deepspeed-$$v.xml || status=1; \
		fi; \
	done; exit $$status

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py

clean-venv:
	rm -rf $(VENV) $(MATRIX_DIR)
