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
# megatron_ucp/deepspeed/versions.py INTERNALS.
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
# What depends on the DeepSpeed release, on every release of the matrix: the internals table and the
# save hook + conversion for both optimizer classes (test_deepspeed_versions; where stock DeepSpeed
# cannot train a case, it shows that instead), install/uninstall, and the elastic load (DP 4 -> 3 from
# the native files, bit for bit against the universal route, and the universal load at DP 4 with an
# all-padding rank) with a class stock DeepSpeed trains there. The
# runner, the save hook, the async trigger and the elastic load also run under the real
# Megatron-DeepSpeed on each release (mds_class).
ELASTIC := tests/system/test_elastic_resume.py
ELASTIC_TESTS = tests/system/test_native_reshard.py::test_reshard_equals_the_universal_route_rank_by_rank[$(1)-3] \
	$(ELASTIC)::test_resume_restores_state_bit_for_bit_and_continues[4-$(1)] \
	$(ELASTIC)::test_explicit_flag_loads_at_source_dp_with_an_all_padding_rank[$(1)]
MATRIX_TESTS = tests/system/test_deepspeed_versions.py tests/system/test_hooks_install.py \
	$(ELASTIC)::test_install_patches_both_load_paths_and_uninstall_restores_them \
	$(if $(1),$(call ELASTIC_TESTS,$(1)))
# Optimizer classes per release (megatron_ucp/deepspeed/versions.py INTERNALS says why): 0.17.x never builds
# BF16_Optimizer and its DeepSpeedZeroOptimizer dies on all-padding ranks (the harness model has one
# at DP=4, the Megatron model does not); 0.18.9's DeepSpeedZeroOptimizer step breaks on torch 2.13.
mds_class = $(word 2,$(subst :, ,$(filter $(1):%,0.16.2:zero 0.16.9:bf16 0.17.6:zero 0.18.9:bf16)))
elastic_class = $(word 2,$(subst :, ,$(filter $(1):%,0.16.2:bf16 0.16.9:zero 0.18.9:bf16 0.19.5:zero)))
RESULTS := .test-results
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export PYTHONUNBUFFERED := 1

.PHONY: venv matrix demo test test-main test-matrix bench bench-scale clean-venv

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
	$(BIN)/python -m demo

# --keep-going: a failure in the main suite does not skip the matrix and the real Megatron-DeepSpeed.
test: $(STAMP) matrix
	@rm -rf $(RESULTS) && mkdir -p $(RESULTS)
	$(MAKE) --no-print-directory --keep-going test-main test-matrix; status=$$?; \
		MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) $(BIN)/python tests/support/matrix_summary.py $(RESULTS); \
		exit $$status

# The layering contracts (pyproject.toml [tool.importlinter]), then the whole suite on DeepSpeed
# $(DEEPSPEED_VERSION) (the real Megatron-DeepSpeed does not import it unedited).
test-main: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests --ignore=tests/integration --junitxml=$(RESULTS)/deepspeed-$(DEEPSPEED_VERSION).xml

# Every release runs even when one fails; the status is the worst.
test-matrix: matrix
	@status=0; \
	$(foreach v,$(DS_MATRIX),\
		echo "=== DeepSpeed $(v): hooks, save, conversion, elastic load ($(or $(call elastic_class,$(v)),none))"; \
		PYTHONPATH=$(abspath $(MATRIX_DIR))/$(v) $(BIN)/python -m pytest -q \
			$(call MATRIX_TESTS,$(call elastic_class,$(v))) --junitxml=$(RESULTS)/deepspeed-$(v).xml || status=1; \
		$(if $(HAVE_MDS),\
			echo "=== DeepSpeed $(v): the real Megatron-DeepSpeed"; \
			PYTHONPATH=$(abspath $(MATRIX_DIR))/$(v) MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) EZPZ_DIR=$(EZPZ_DIR) \
				MEGATRON_UCP_REQUIRE_INTEGRATION=1 MEGATRON_UCP_MDS_CACHE=$(abspath $(RESULTS))/mds-checkout \
				$(BIN)/python -m pytest -q tests/integration \
				$(if $(filter $(DS_INTEGRATION_FULL),$(v)),,-k "(training or dp3 or pp2_hooked) and $(call mds_class,$(v))") \
				--junitxml=$(RESULTS)/megatron-deepspeed-$(v).xml || status=1; ,) \
	) exit $$status

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py
	$(BIN)/python benchmarks/bench_resume.py

# Synthetic checkpoints at DP up to 768 (megatron_ucp.synthetic): conversion against DP and against
# stock and the ALCF converter, and the AuroraGPT-7B plan from metadata. llama-1b needs ~25 GB of disk
# (one checkpoint, one output and stock's fragments at a time) and about an hour on 2 cores.
BENCH_SCALE_PRESET ?= llama-1b
bench-scale: $(STAMP)
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour plain
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour megatron --tools ours,cp+sync

clean-venv:
	rm -rf $(VENV) $(MATRIX_DIR)
