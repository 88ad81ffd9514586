#!/usr/bin/env bash
###############################################################################
# train_aGPT_7B_ucp.sh: run YOUR train_aGPT_7B.sh (argonne-lcf/Megatron-DeepSpeed)
# through megatron-ucp: asynchronous universal checkpoints and elastic resume at
# any node count, with no edit to Megatron-DeepSpeed.
#
# Run it where you run train_aGPT_7B.sh (the Megatron-DeepSpeed checkout, usually
# $PBS_O_WORKDIR), with the same arguments:
#
#   UCP=1 bash /path/to/megatron-ucp/train_scripts/train_aGPT_7B_ucp.sh [args]
#   bash /path/to/megatron-ucp/train_scripts/train_aGPT_7B_ucp.sh --ucp [args]
#
# Without UCP=1 / --ucp it simply runs train_aGPT_7B.sh "$@".
#
# How it hooks in (verified against ALCF/helpers.sh): setup() calls
# `check_executable "${EXEC:-.../pretrain_gpt_alcf.py}"` and setupLauncher() builds
# the launcher as `ezpz launch $(which python3) ${EXEC}` (or, with
# LAUNCH_WITH=deepspeed, `deepspeed --hostfile ... --launcher MPICH ${EXEC}`);
# setup_run_cmd() appends train_aGPT_7B.sh's own arguments ("$@") to the training
# arguments. So this wrapper
#   1. writes a 3-line launcher shim, <workdir>/.cache/megatron_ucp/pretrain_gpt_alcf_ucp.py,
#      that runs megatron_ucp.run on the real entry script, and exports EXEC=<shim>
#      (a real file, so check_executable accepts it and both launchers use it);
#   2. appends --ucp-* options to the arguments (they travel in argv to every rank,
#      whatever the launcher forwards of the environment; the runner removes them
#      before Megatron parses argv);
#   3. elastic resume: when a checkpoint exists in $LOAD or $CKPT_DIR and GLOBAL_BATCH
#      is not set, exports GLOBAL_BATCH and GRAD_ACC_STEPS so that the checkpoint's
#      global batch is kept at this job's node count (helpers.sh would otherwise use
#      nodes x 12 x GAS, a different batch on a different node count);
#   4. runs train_aGPT_7B.sh "$@" <--ucp-* options>.
#
# Variables (all optional):
#   UCP=1                 turn megatron-ucp on (or pass --ucp)
#   UCP_DRY_RUN=1         print the shim, the environment and the command lines; launch nothing
#   UCP_ASYNC_CONVERT     1 (default): convert every saved checkpoint in the background
#   UCP_VERIFY_SAVES      1 (default): with UCP_ASYNC_CONVERT=0, still verify every saved
#                         checkpoint in the background (the conversion's read does it otherwise)
#   UCP_KEEP_LAST         keep at most N universal folders and HF exports (default: all)
#   UCP_ASYNC_SAVE        1: saves return once each rank's state is in host memory; the files are
#                         written in the background, latest names a save once all are durable
#   UCP_MEMORY_SAVE_INTERVAL  N: every N iterations, also save to each node's memory with a replica on
#                         the next node; a restart on the nodes left after a node failure resumes from
#                         it (docs/memory_saves.md)
#   UCP_LOCAL_DIR         each node's folder for memory saves (default: under /dev/shm)
#   UCP_EXPORT_HF         1: export every converted checkpoint as a Hugging Face model folder
#                         <tag>_hf in the background (needs UCP_ASYNC_CONVERT=1 and the [hf] extra)
#   UCP_CONVERTER_WORKERS worker processes per converter (default 1)
#   UCP_STRICT            0: warn instead of failing when a universal load misses a tensor
#   UCP_ELASTIC           0: no elastic resume (DeepSpeed refuses DP changes, as stock)
#   UCP_RANKS_PER_NODE    ranks per node, one converter per node (default: NGPU_PER_HOST, else
#                         ezpz's accelerators per node, else the launcher's local size)
#   UCP_TRAIN_SCRIPT      the script to wrap (default: <workdir>/train_aGPT_7B.sh)
#   UCP_ENTRY             the entry script (default: $EXEC or <workdir>/pretrain_gpt_alcf.py)
#   UCP_SHIM_DIR          where the shim goes; must be visible on every node
#   PYTHON                interpreter with megatron-ucp installed (default: python3)
#   CKPT_DIR / LOAD       the checkpoint folder. For elastic resume set CKPT_DIR: helpers.sh
#                         otherwise names the folder after WORLD_SIZE and GLOBAL_BATCH, so a
#                         job on another node count would look in (and start) a fresh folder.
###############################################################################
set -euo pipefail

say() { printf 'megatron-ucp: %s\n' "$*" >&2; }

ucp="${UCP:-0}"
args=()
for arg in "$@"; do
	case "${arg}" in
	--ucp) ucp=1 ;;
	--no-ucp) ucp=0 ;;
	*) args+=("${arg}") ;;
	esac
done

workdir="${PBS_O_WORKDIR:-${PWD}}"
train_script="${UCP_TRAIN_SCRIPT:-${workdir}/train_aGPT_7B.sh}"
dry_run="${UCP_DRY_RUN:-0}"
python="${PYTHON:-python3}"

if [[ ! -f "${train_script}" ]]; then
	say "${train_script} not found: run this from your Megatron-DeepSpeed checkout (or set UCP_TRAIN_SCRIPT)"
	[[ "${dry_run}" == 1 ]] || exit 2
fi

if [[ "${ucp}" != 1 ]]; then
	if [[ "${dry_run}" == 1 ]]; then
		printf '# UCP is off: train_aGPT_7B.sh runs unchanged\n'
		printf 'bash'
		printf ' %q' "${train_script}" "${args[@]}"
		printf '\n'
		exit 0
	fi
	exec bash "${train_script}" "${args[@]}"
fi

entry="${UCP_ENTRY:-${EXEC:-${workdir}/pretrain_gpt_alcf.py}}"
if [[ ! -f "${entry}" ]]; then
	say "entry script ${entry} not found (set UCP_ENTRY)"
	[[ "${dry_run}" == 1 ]] || exit 2
fi
shim_dir="${UCP_SHIM_DIR:-${workdir}/.cache/megatron_ucp}"
entry_name="$(basename "${entry}" .py)"
shim="${shim_dir}/${entry_name}_ucp.py"

# ---- 1. the launcher shim ------------------------------------------------------------------------
# The entry path is embedded as a Python string literal (shell-quoting is not Python-quoting).
entry_literal="'$(printf '%s' "${entry}" | sed -e "s/\\\\/\\\\\\\\/g" -e "s/'/\\\\'/g")'"
shim_text="# Written by megatron-ucp's train_aGPT_7B_ucp.sh: runs ${entry_name}.py through megatron_ucp.run.
import sys
from megatron_ucp.run import main
sys.exit(main([${entry_literal}, *sys.argv[1:]]))"

if ! "${python}" -c 'import megatron_ucp' 2>/dev/null; then
	say "WARNING: ${python} cannot import megatron_ucp: install megatron-ucp in the environment train_aGPT_7B.sh"
	say "         runs in (pip install -e /path/to/megatron-ucp), or set PYTHON; every rank needs it."
fi

# ---- 2. --ucp-* options --------------------------------------------------------------------------
# Accelerators per node as helpers.sh sees them (ezpz); 0 on a CPU-only node. Not exported:
# helpers.sh works it out itself.
gpus_per_node="${NGPU_PER_HOST:-}"
if [[ -z "${gpus_per_node}" ]]; then
	gpus_per_node="$("${python}" -c 'import ezpz; print(ezpz.get_gpus_per_node())' 2>/dev/null || echo 12)"
fi
[[ "${gpus_per_node}" =~ ^[0-9]+$ ]] || gpus_per_node=0
ucp_args=()
if [[ "${UCP_ASYNC_CONVERT:-1}" == 1 ]]; then ucp_args+=(--ucp-async-convert); else ucp_args+=(--ucp-no-async-convert); fi
if [[ "${UCP_ASYNC_CONVERT:-1}" != 1 && "${UCP_VERIFY_SAVES:-1}" == 1 ]]; then ucp_args+=(--ucp-verify-saves); fi
if [[ -n "${UCP_KEEP_LAST:-}" ]]; then ucp_args+=(--ucp-keep-last "${UCP_KEEP_LAST}"); fi
if [[ "${UCP_EXPORT_HF:-0}" == 1 ]]; then ucp_args+=(--ucp-export-hf); fi
if [[ "${UCP_ASYNC_SAVE:-0}" == 1 ]]; then ucp_args+=(--ucp-async-save); fi
if [[ -n "${UCP_MEMORY_SAVE_INTERVAL:-}" ]]; then ucp_args+=(--ucp-memory-save-interval "${UCP_MEMORY_SAVE_INTERVAL}"); fi
if [[ -n "${UCP_LOCAL_DIR:-}" ]]; then ucp_args+=(--ucp-local-dir "${UCP_LOCAL_DIR}"); fi
if [[ -n "${UCP_CONVERTER_WORKERS:-}" ]]; then ucp_args+=(--ucp-converter-workers "${UCP_CONVERTER_WORKERS}"); fi
if [[ "${UCP_STRICT:-1}" == 0 ]]; then ucp_args+=(--ucp-no-strict); fi
if [[ "${UCP_ELASTIC:-1}" == 0 ]]; then ucp_args+=(--ucp-no-elastic-resume); fi
# One converter per node needs the ranks per node: given, else the accelerators per node, else
# (CPU-only: ezpz reports 0) left to the runner, which reads the launcher's local size.
ranks_per_node="${UCP_RANKS_PER_NODE:-${gpus_per_node}}"
if [[ "${ranks_per_node}" =~ ^[1-9][0-9]*$ ]]; then ucp_args+=(--ucp-ranks-per-node "${ranks_per_node}"); fi

# ---- 3. keep the checkpoint's global batch at this node count ------------------------------------
env_lines=("EXEC=${shim}")
ckpt="${LOAD:-${CKPT_DIR:-}}"
if [[ -z "${ckpt}" ]]; then
	say "CKPT_DIR (or LOAD) is not set: helpers.sh names the checkpoint folder after WORLD_SIZE and GLOBAL_BATCH,"
	say "so a job on another node count does not find the previous checkpoint. Set CKPT_DIR for elastic resume."
elif [[ -z "${GLOBAL_BATCH:-}" && "${UCP_ELASTIC:-1}" == 1 ]]; then
	if [[ -n "${WORLD_SIZE:-}" ]]; then
		world="${WORLD_SIZE}"
	elif [[ -f "${HOSTFILE:-${PBS_NODEFILE:-/nonexistent}}" && "${ranks_per_node}" =~ ^[1-9][0-9]*$ ]]; then
		world=$(($(wc -l <"${HOSTFILE:-${PBS_NODEFILE}}") * ranks_per_node))
	else
		world=""
		say "cannot tell the node count (no HOSTFILE/PBS_NODEFILE/WORLD_SIZE): global batch left to helpers.sh"
	fi
	if [[ -n "${world}" ]]; then
		while IFS='=' read -r key value; do
			case "${key}" in
			GLOBAL_BATCH | GRAD_ACC_STEPS)
				[[ "${value}" =~ ^[0-9]+$ ]] || continue
				export "${key}=${value}"
				env_lines+=("${key}=${value}")
				;;
			esac
		done < <(WORLD_SIZE="${world}" "${python}" -m megatron_ucp.run --ucp-alcf-batch-env "${ckpt}")
	fi
fi

# ---- 4. launch --------------------------------------------------------------------------------------
if [[ "${dry_run}" == 1 ]]; then
	printf '# megatron-ucp: launcher shim %s\n%s\n' "${shim}" "${shim_text}"
	printf '# environment for train_aGPT_7B.sh\n'
	for line in "${env_lines[@]}"; do printf 'export %q\n' "${line}"; done
	printf '# command\nbash'
	printf ' %q' "${train_script}" "${args[@]}" "${ucp_args[@]}"
	printf '\n# launch command that ALCF/helpers.sh builds from it (setupLauncher, setup_run_cmd)\n'
	if [[ "${LAUNCH_WITH:-${LAUNCH_CMD:-MPICH}}" == deepspeed ]]; then
		printf 'deepspeed --hostfile %s --launcher MPICH %s' "${WORKING_DIR:-${workdir}}/hostfile_deepspeed" "${shim}"
	else
		printf 'ezpz launch %s %s' "$(command -v python3 || echo python3)" "${shim}"
	fi
	printf ' <helpers.sh training arguments>'
	printf ' %q' "${args[@]}" "${ucp_args[@]}"
	printf '\n# every rank: python3 %s ... = python -m megatron_ucp.run %s ... (--ucp-* options removed)\n' \
		"${shim}" "${entry}"
	exit 0
fi

mkdir -p "${shim_dir}"
tmp="$(mktemp "${shim_dir}/.${entry_name}_ucp.XXXXXX")"
printf '%s\n' "${shim_text}" >"${tmp}"
mv -f "${tmp}" "${shim}"
export EXEC="${shim}"
say "launching $(basename "${train_script}") through megatron-ucp (EXEC=${shim}; ${ucp_args[*]})"
exec bash "${train_script}" "${args[@]}" "${ucp_args[@]}"
