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
# The release lines of the matrix on torch 2.13 (0.19.8, above, runs the full suite; 0.16.9 runs on
# torch 2.8 + IPEX, below). Keep in step with megatron_ucp/deepspeed/versions.py INTERNALS.
DS_MATRIX := 0.16.2 0.17.6 0.18.9 0.19.5
# Where the real Megatron-DeepSpeed runs the full integration suite (both optimizer classes, the
# patch route, the wrapper flow); the other releases run a training + DP-change resume each.
DS_INTEGRATION_FULL := 0.19.5
MATRIX_DIR := .venv-ds
# The stack Aurora runs: torch 2.8 with intel-extension-for-pytorch 2.8 (both imported as a job on Aurora
# imports them; the torch wheel is PyPI's, run on the CPU), its own environment, with the DeepSpeed
# lines users pair with it: 0.19.5 installed there, 0.16.9 through its .venv-ds overlay.
TORCH28_VENV := .venv-torch2.8
TORCH28_BIN := $(TORCH28_VENV)/bin
TORCH28_STAMP := $(TORCH28_VENV)/.megatron-ucp-installed
TORCH28_PINS := torch==2.8.0 intel-extension-for-pytorch==2.8.0 deepspeed==0.19.5
TORCH28_DS := 0.19.5 0.16.9
THIRD_PARTY ?= $(abspath ../shared/third_party)
MEGATRON_DEEPSPEED_DIR ?= $(THIRD_PARTY)/megatron-deepspeed
EZPZ_DIR ?= $(THIRD_PARTY)/ezpz
HAVE_MDS := $(shell test -f $(MEGATRON_DEEPSPEED_DIR)/pretrain_gpt_alcf.py && echo 1)
MDS_STAMP := $(VENV)/.megatron-deepspeed-runtime
# What Megatron-DeepSpeed's pretrain_gpt_alcf.py and `ezpz launch` need beyond torch and DeepSpeed
# (../shared/third_party/README.md).
MDS_RUNTIME := regex pybind11 six sentencepiece rich wandb nltk 'transformers<5' tensorboard mpi4py mpich \
	omegaconf hydra-core plotext seaborn torchinfo xarray ambivalent click hatchling
# The --optimizer choices of other packages that install on a CPU (tests/integration/test_optimizers.py, the 0.19.5
# run): bitsandbytes' adam8bit, schedule-free's; pinned, as what the tests assert is their state's form.
MDS_OPTIMIZERS := bitsandbytes==0.50.2 schedulefree==1.4.1
# What depends on the DeepSpeed release, on every release of the matrix: the internals table and the
# save hook + conversion for both optimizer classes (test_deepspeed_versions; where stock DeepSpeed
# cannot train a case, it shows that instead), install/uninstall, and the elastic load (DP 4 -> 3 from
# the native files, bit for bit against the universal route; a same-DP restart checked against what the
# save recorded, mixed-up folders refused; the module read once across the job and exactly what
# DeepSpeed's own load gives; the universal load at DP 4 with an all-padding rank) with a class stock
# DeepSpeed trains there. The
# runner, the save hook, the async trigger and the elastic load also run under the real
# Megatron-DeepSpeed on each release (mds_class).
ELASTIC := tests/system/test_elastic_resume.py
ELASTIC_TESTS = tests/system/test_native_reshard.py::test_reshard_equals_the_universal_route_rank_by_rank[$(1)-3] \
	tests/system/test_mixed_up_folders.py::test_a_same_dp_restart_checks_what_the_save_recorded_and_names_the_file[$(1)] \
	tests/system/test_module_read.py::test_a_restart_gives_exactly_what_deepspeeds_load_gives[$(1)] \
	$(ELASTIC)::test_resume_restores_state_bit_for_bit_and_continues[4-$(1)] \
	$(ELASTIC)::test_explicit_flag_loads_at_source_dp_with_an_all_padding_rank[$(1)]
# (test_hooks_install's two checks that launch processes, the decision lines under a configured root logger and
# no module importing IPEX, hold whatever the release: the main suite and torch 2.8 + IPEX run them.)
MATRIX_TESTS = tests/system/test_deepspeed_versions.py tests/system/test_hooks_install.py \
	--deselect tests/system/test_hooks_install.py::test_decision_lines_survive_a_library_configuring_the_root_logger \
	--deselect tests/system/test_hooks_install.py::test_no_module_imports_ipex \
	$(ELASTIC)::test_install_patches_both_load_paths_and_uninstall_restores_them \
	$(if $(1),$(call ELASTIC_TESTS,$(1))) $(if $(filter $(2),$(ZERO3_HARNESS_DS)),$(ZERO3_HARNESS)) \
	$(if $(filter $(2),$(DS_INTEGRATION_FULL)),$(FULL_HARNESS_DESELECT))
# On DS_INTEGRATION_FULL the real Megatron-DeepSpeed trains both classes at ZeRO-1 and DP 4 through the save hook and
# verifies every conversion against the source: the harness's save + conversion runs there at ZeRO-2 and DP 2 only.
FULL_HARNESS_DESELECT := \
	--deselect "tests/system/test_deepspeed_versions.py::test_save_hook_records_and_conversion_is_bit_exact[zero-1-4]" \
	--deselect "tests/system/test_deepspeed_versions.py::test_save_hook_records_and_conversion_is_bit_exact[bf16-1-4]"
# ZeRO-3 in the harness (a hooked save at DP 4, three sub-groups, resumed at DP 3 with the optimizer offloaded:
# the native reshard against the universal route rank by rank) runs in the main suite; 0.16.2, 0.17.6, 0.18.9 and
# 0.19.5 pass it too, run by hand (`make test ZERO3_HARNESS_DS=0.16.2` adds it there); every release runs ZeRO-3
# under the real Megatron-DeepSpeed (ZERO3_MATRIX below). The suite's time.
ZERO3_HARNESS_DS ?=
ZERO3_HARNESS := "tests/system/test_zero3_resume.py::test_the_native_reshard_equals_the_universal_route_rank_by_rank[hooked-offload]"
# On torch 2.8 + IPEX 2.8 (TORCH28_DS), with IPEX loaded first in every process (tests/support/site);
# IPEX's import costs ~6 s of CPU per process, so each path runs once. On 0.16.9: the internals table,
# install/uninstall, the save recording + conversion of both optimizer classes (test_deepspeed_versions),
# and the real Megatron-DeepSpeed through the runner: training with background conversion, then
# DP 4 -> 3 through both routes (mds_class), the same training with asynchronous saves, and a mixture-of-experts job saved, converted in the background and
# resumed at EP 4 (0.19.5 runs every MoE resume). On 0.19.5: the IPEX checks and install (test_hooks_install),
# our torch file reader and writer against what torch 2.8 writes and reads (DeepSpeed's files of one
# class; the other's are read by the conversions), the runner's end-of-job wait for a background
# conversion (the MDS run on 0.16.9 waits for it too), and both elastic loads bit for bit in the harness (the native
# reshard against the universal route).
TORCH28_0195 = tests/system/test_hooks_install.py tests/unit/test_fast_io.py tests/system/test_torchless_io.py \
	tests/unit/test_optimizer_probe.py \
	--deselect "tests/system/test_torchless_io.py::test_real_deepspeed_files_load_as_torch_loads_them[bf16]" \
	tests/system/test_runner.py::test_main_installs_runs_and_uninstalls \
	"tests/system/test_native_reshard.py::test_reshard_equals_the_universal_route_rank_by_rank[$(call elastic_class,0.19.5)-3]"
# (On 0.16.9, the save recording + conversion of BF16_Optimizer at ZeRO-1 and DeepSpeedZeroOptimizer at ZeRO-2, DP 4:
# IPEX makes each launch cost ~30 s; ZeRO-1 with DeepSpeedZeroOptimizer runs on 0.16.2 and under Megatron here.)
TORCH28_TESTS = $(if $(filter 0.19.5,$(1)),$(TORCH28_0195),$(ELASTIC)::test_install_patches_both_load_paths_and_uninstall_restores_them \
	tests/system/test_deepspeed_versions.py \
	--deselect "tests/system/test_deepspeed_versions.py::test_save_hook_records_and_conversion_is_bit_exact[zero-1-4]" \
	--deselect "tests/system/test_deepspeed_versions.py::test_save_hook_records_and_conversion_is_bit_exact[zero-1-2]")
TORCH28_ENV = PYTHONPATH=$(abspath $(MATRIX_DIR))/$(1):$(abspath tests/support/site) MEGATRON_UCP_TEST_IMPORT_IPEX=1
# Optimizer classes per release (megatron_ucp/deepspeed/versions.py INTERNALS says why): 0.17.x never builds
# BF16_Optimizer and its DeepSpeedZeroOptimizer dies on all-padding ranks (the harness model has one
# at DP=4, the Megatron model does not); 0.18.9's DeepSpeedZeroOptimizer step breaks on torch 2.13.
# ZeRO-3 on the real Megatron-DeepSpeed on every release (DeepSpeedZeroOptimizer_Stage3, whatever the class above):
# the training through the hooks with background conversion and the DP 4 -> 3 resume with no flag (on torch 2.8 +
# IPEX with 0.16.9, whose ZeRO-3 code is 0.16.2's, the training only: the suite's time).
ZERO3_MATRIX := (zero3 and (trains or dp3))
# What the real Megatron-DeepSpeed runs on the releases other than DS_INTEGRATION_FULL: the training through the runner
# with background conversion and the DP 4 -> 3 resume with no flag (the universal route's load on each release is the
# harness's, ELASTIC_TESTS), the same training with asynchronous saves (its files against the synchronous ones), ZeRO-3's,
# and a GPTModelPipe PP=2 save resumed at another DP on the oldest release.
MDS_RELEASE = ((training or dp3_with_no_flag or async_save_trains$(if $(filter 0.16.2,$(1)), or pp2_hooked)) \
	and $(call mds_class,$(1))) or $(ZERO3_MATRIX)
# Left out of the full run (the suite's time), each covered elsewhere: DeepSpeedZeroOptimizer's universal route
# under the real Megatron-DeepSpeed is every MoE resume's (and the harness compares it with the native reshard rank
# by rank, bit for bit); the same-DP restart's per-rank reads are measured in the harness (test_module_read), the
# DP change's under the real Megatron-DeepSpeed too.
MDS_FULL_DESELECT := \
	--deselect "tests/integration/test_megatron_deepspeed.py::test_resume_at_dp3_through_the_universal_route_gives_the_same_losses[zero]" \
	--deselect "tests/integration/test_megatron_deepspeed.py::test_each_rank_reads_its_share_of_the_checkpoint[same-dp-zero]"
mds_class = $(word 2,$(subst :, ,$(filter $(1):%,0.16.2:zero 0.16.9:bf16 0.17.6:zero 0.18.9:bf16 0.19.5:zero)))
elastic_class = $(word 2,$(subst :, ,$(filter $(1):%,0.16.2:bf16 0.16.9:zero 0.18.9:bf16 0.19.5:zero)))
# On DS_INTEGRATION_FULL the elastic loads run under the real Megatron-DeepSpeed (every route, both classes) and, in the
# harness, on torch 2.8 + IPEX (TORCH28_0195); the main suite runs the harness on the next release of its line.
matrix_elastic_class = $(if $(filter $(DS_INTEGRATION_FULL),$(1)),,$(call elastic_class,$(1)))
RESULTS := .test-results
comma := ,
export DS_ACCELERATOR := cpu
export DS_BUILD_OPS := 0
export PYTHONUNBUFFERED := 1

.PHONY: venv envs matrix demo test lint test-main test-matrix bench bench-scale peer clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test]'
	@touch $(STAMP)

# After Megatron-DeepSpeed's runtime where there is one: nothing installs into .venv while an overlay builds from it.
$(MATRIX_DIR)/%/.installed: $(STAMP) $(if $(HAVE_MDS),$(MDS_STAMP))
	rm -rf $(MATRIX_DIR)/$*
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet --no-build-isolation --no-deps --target $(MATRIX_DIR)/$* deepspeed==$*
	@touch $@

# Megatron-DeepSpeed's runtime and ezpz (installed from a temporary copy: the snapshot stays read-only).
# $(1): the environment's python, $(2): extra pip options, $(3): more packages.
install_mds_runtime = $(1) -m pip install --quiet $(2) $(MDS_RUNTIME) $(3) && \
	tmp=$$(mktemp -d) && cp -r $(EZPZ_DIR) $$tmp/ezpz && chmod -R u+w $$tmp/ezpz && \
	$(1) -m pip install --quiet --no-deps --no-build-isolation $$tmp/ezpz && rm -rf $$tmp

$(MDS_STAMP): $(STAMP)
	$(call install_mds_runtime,$(BIN)/python,,$(MDS_OPTIMIZERS))
	@touch $@

matrix: $(foreach v,$(sort $(DS_MATRIX) $(TORCH28_DS)),$(MATRIX_DIR)/$(v)/.installed) $(if $(HAVE_MDS),$(MDS_STAMP)) \
	$(TORCH28_STAMP)

# Everything pinned by one constraints file, so that no later install (megatron-core, the runtime of
# Megatron-DeepSpeed) moves torch off 2.8.0.
$(TORCH28_STAMP): pyproject.toml Makefile
	@test -x $(TORCH28_BIN)/python || $(PYTHON) -m venv $(TORCH28_VENV)
	printf '%s\n' $(TORCH28_PINS) > $(TORCH28_VENV)/constraints.txt
	$(TORCH28_BIN)/python -m pip install --quiet --upgrade pip wheel setuptools
	$(TORCH28_BIN)/python -m pip install --quiet -c $(TORCH28_VENV)/constraints.txt torch intel-extension-for-pytorch
	DS_BUILD_OPS=0 $(TORCH28_BIN)/python -m pip install --quiet --no-build-isolation -c $(TORCH28_VENV)/constraints.txt deepspeed
	$(TORCH28_BIN)/python -m pip install --quiet --no-build-isolation -c $(TORCH28_VENV)/constraints.txt -e '.[test,xpu]'
	$(if $(HAVE_MDS),$(call install_mds_runtime,$(TORCH28_BIN)/python,-c $(TORCH28_VENV)/constraints.txt))
	@touch $@

demo: $(STAMP)
	$(BIN)/python -m demo

# Every environment, two at a time: .venv (then its overlays and Megatron-DeepSpeed's runtime, in that order) beside
# .venv-torch2.8, which shares nothing with it (on a fresh machine the two took minutes one after the other, mostly
# downloading and unpacking wheels).
envs:
	@$(MAKE) --no-print-directory -j 2 --output-sync=target $(STAMP) matrix

# --keep-going: a failure in the main suite does not skip the matrix and the real Megatron-DeepSpeed.
test: envs
	@rm -rf $(RESULTS) && mkdir -p $(RESULTS)
	$(MAKE) --no-print-directory --keep-going lint test-main test-matrix; status=$$?; \
		MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) $(BIN)/python tests/support/matrix_summary.py $(RESULTS); \
		exit $$status

# The code's form (ruff: formatted, pyflakes, 120 columns, sorted imports; pyproject.toml [tool.ruff])
# and the layering contracts (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The whole suite on DeepSpeed $(DEEPSPEED_VERSION) (the real Megatron-DeepSpeed does not import it unedited).
test-main: $(STAMP)
	$(BIN)/python -m pytest -q tests --ignore=tests/integration --junitxml=$(RESULTS)/deepspeed-$(DEEPSPEED_VERSION).xml

# Every release runs even when one fails; the status is the worst.
test-matrix: matrix
	@status=0; \
	$(foreach v,$(DS_MATRIX),\
		echo "=== DeepSpeed $(v): hooks, save, conversion, elastic load ($(or $(call matrix_elastic_class,$(v)),none))"; \
		PYTHONPATH=$(abspath $(MATRIX_DIR))/$(v) $(BIN)/python -m pytest -q \
			$(call MATRIX_TESTS,$(call matrix_elastic_class,$(v)),$(v)) --junitxml=$(RESULTS)/deepspeed-$(v).xml || status=1; \
		$(if $(HAVE_MDS),\
			echo "=== DeepSpeed $(v): the real Megatron-DeepSpeed"; \
			PYTHONPATH=$(abspath $(MATRIX_DIR))/$(v) MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) EZPZ_DIR=$(EZPZ_DIR) \
				MEGATRON_UCP_REQUIRE_INTEGRATION=1 MEGATRON_UCP_MDS_CACHE=$(abspath $(RESULTS))/mds-checkout \
				$(BIN)/python -m pytest -q tests/integration \
				$(if $(filter $(DS_INTEGRATION_FULL),$(v)),$(MDS_FULL_DESELECT),-k "$(call MDS_RELEASE,$(v))") \
				--junitxml=$(RESULTS)/megatron-deepspeed-$(v).xml || status=1; ,) \
	) \
	$(foreach v,$(TORCH28_DS),\
		echo "=== torch 2.8 + IPEX 2.8 + DeepSpeed $(v): $(if $(filter 0.19.5,$(v)),IPEX checks$(comma) file formats$(comma) runner$(comma) elastic loads,hooks$(comma) save$(comma) conversion)"; \
		$(call TORCH28_ENV,$(v)) $(TORCH28_BIN)/python -m pytest -q $(call TORCH28_TESTS,$(v)) \
			--junitxml=$(RESULTS)/torch2.8-deepspeed-$(v).xml || status=1; \
		$(if $(and $(HAVE_MDS),$(filter-out 0.19.5,$(v))),\
			echo "=== torch 2.8 + IPEX 2.8 + DeepSpeed $(v): the real Megatron-DeepSpeed"; \
			$(call TORCH28_ENV,$(v)) MEGATRON_DEEPSPEED_DIR=$(MEGATRON_DEEPSPEED_DIR) EZPZ_DIR=$(EZPZ_DIR) \
				MEGATRON_UCP_REQUIRE_INTEGRATION=1 MEGATRON_UCP_MDS_CACHE=$(abspath $(RESULTS))/mds-checkout \
				$(TORCH28_BIN)/python -m pytest -q tests/integration -k "((training or dp3_with_no_flag or async_save_trains) and $(call mds_class,$(v))) or (moe and (background or ep4 or dp2)) or (zero3 and trains) or ipex_lamb or (async_save_layouts and moe)" \
				--junitxml=$(RESULTS)/megatron-deepspeed-torch2.8-$(v).xml || status=1; ,) \
	) exit $$status

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_convert.py
	$(BIN)/python benchmarks/bench_resume.py
	$(BIN)/python benchmarks/bench_reads.py
	set -e; $(foreach opt,zero bf16,$(foreach dp,1 2 4,\
		$(BIN)/python benchmarks/bench_async_save.py --model m100 --dp $(dp) --saves 3 --optimizer $(opt);))

# Synthetic checkpoints at DP up to 768 (megatron_ucp.synthetic): conversion against DP and against
# stock and the ALCF converter, and the AuroraGPT-7B plan from metadata; then ZeRO-3 at DP 8 and 768
# (conversion against stock's stage-3 converter, the native reshard's bytes read per sampled rank). llama-1b needs ~25 GB of disk
# (one checkpoint, one output and stock's fragments at a time) and about an hour on 2 cores. Last, one optimizer that is not
# Adam (the fork's Muon: moment1, moment2 and a flag per partition) at DP 768, converted and resharded to 512. Then the
# Hugging Face export of the same model (bf16 and fp32, two shard bounds) against a durable copy of its bytes.
BENCH_SCALE_PRESET ?= llama-1b
BENCH_SCALE_MOE_PRESET ?= llama-100m
bench-scale: $(STAMP)
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour plain
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour megatron --tools ours,cp+sync
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour megatron --zero-stage 3 \
		--dp 8,768 --tools ours,stock,alcf,cp+sync --resume-to 512,1024 --shares '' --no-metadata
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_MOE_PRESET) --experts 8 --ep 8 --ds-version 0.19.5 \
		--dp 8,768 --tools ours,cp+sync --resume-to 512,1024 --shares '' --no-metadata
	$(BIN)/python benchmarks/bench_scale.py --preset $(BENCH_SCALE_PRESET) --flavour megatron --base-optimizer muon \
		--dp 768 --tools ours,cp+sync --resume-to 512 --shares '' --no-metadata --label muon
	$(BIN)/python benchmarks/bench_hf_export.py --preset $(BENCH_SCALE_PRESET)

# DeepSpeed's own checkpoint tests (../shared/third_party/deepspeed-tests), run stock, with the hooks, and with the
# hooks and asynchronous saves; every difference from stock printed with its first error (docs/peer_suite.md). About
# an hour on 2 cores: not part of `make test`, whose tests/system/test_peer_behaviours.py holds what it found.
# DeepSpeed's test harness needs pytest < 8.4 (its DistributedFixture tests find no fixture under pytest 9): that
# pytest lives in its own folder, first on the runs' path, and the project's environment keeps its own.
PEER_PYTEST := .peer-pytest
peer: $(STAMP)
	@test -d $(PEER_PYTEST)/_pytest || $(BIN)/python -m pip install --quiet --no-deps --target $(PEER_PYTEST) 'pytest>=8.3,<8.4'
	PYTHONPATH=$(abspath $(PEER_PYTEST)) $(BIN)/python tests/peer/run_peer.py $(PEER_ARGS)

clean-venv:
	rm -rf $(VENV) $(MATRIX_DIR) $(TORCH28_VENV)
