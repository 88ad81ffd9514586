#!/bin/bash --login
#PBS -A <your_project>
#PBS -q prod
#PBS -l select=48
#PBS -l walltime=06:00:00
#PBS -l filesystems=flare:home
#PBS -j oe
#PBS -N aGPT7B-elastic
###############################################################################
# pbs_resume_elastic.sh: resume AuroraGPT-7B on Aurora at whatever node count
# this job got, from a checkpoint saved at another node count.
#
# Example: the run was saved by a 64-node job (768 tiles, DP=768); 16 of those
# nodes are down, so resume on 48:
#
#   cd /path/to/Megatron-DeepSpeed           # your checkout: the job runs from here
#   qsub -l select=48 -v CKPT_DIR=/flare/<project>/checkpoints/aGPT-7B \
#        /path/to/megatron-ucp/train_scripts/pbs_resume_elastic.sh
#
# What happens:
#   * train_aGPT_7B_ucp.sh runs your train_aGPT_7B.sh with EXEC pointing at a
#     shim that starts pretrain_gpt_alcf.py through `python -m megatron_ucp.run`;
#   * if GLOBAL_BATCH is not set, it keeps the checkpoint's global batch at the new
#     node count (GLOBAL_BATCH and GRAD_ACC_STEPS for helpers.sh), when it divides;
#   * on every rank, the runner sees the DP change (768 -> 576), adds --no-load-rng
#     and re-seeds each rank after the load; the elastic-load hook reshards
#     each rank's partitions straight from the tag's native rank files (a TP, PP
#     or EP change, or MEGATRON_UCP_RESUME_ROUTE=universal, loads <tag>_universal,
#     converting it first, one converter per node, if it is not there yet);
#   * new checkpoints are converted to universal ones in the background (UCP_ASYNC_CONVERT=1),
#     so the next resume at yet another node count starts at once;
#   * with LAUNCH_WITH=deepspeed (helpers.sh's DeepSpeed launcher, which starts on
#     HOSTFILE), when the launch fails with nodes down, those nodes are dropped and
#     the launch repeated on the rest, at the new node count, from the newest
#     checkpoint (`megatron-ucp relaunch`), at most UCP_MAX_RESTARTS times (default 3;
#     0: one launch). A node is down when `ssh <node> true` fails (UCP_PROBE overrides
#     the probe command, {host} replaced). Each launch is recorded in the checkpoint's
#     store; `megatron-ucp status $CKPT_DIR` shows it. Submit with
#     `-W tolerate_node_failures=all` so that PBS keeps the job when a node fails.
#     The loop runs before train_aGPT_7B.sh sets up its environment: PYTHON names an
#     interpreter with megatron-ucp (default python3).
#
# Requirements: megatron-ucp installed in the Python environment that
# train_aGPT_7B.sh activates (pip install -e /path/to/megatron-ucp), and a
# CKPT_DIR that does not depend on the node count (helpers.sh's default folder
# name contains WORLD_SIZE and GLOBAL_BATCH).
#
# UCP_DRY_RUN=1 prints the command lines instead of launching (also outside PBS).
###############################################################################
set -euo pipefail

cd "${PBS_O_WORKDIR:-${PWD}}" || exit 1
here="$(pwd)"

# Where this script lives (PBS copies job scripts to a spool folder; set MEGATRON_UCP_HOME then).
megatron_ucp_home="${MEGATRON_UCP_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
wrapper="${megatron_ucp_home}/train_scripts/train_aGPT_7B_ucp.sh"
if [[ ! -f "${wrapper}" ]]; then
	echo "pbs_resume_elastic.sh: ${wrapper} not found; set MEGATRON_UCP_HOME to your megatron-ucp checkout" >&2
	exit 2
fi

if [[ -z "${CKPT_DIR:-}" ]]; then
	echo "pbs_resume_elastic.sh: set CKPT_DIR to the checkpoint folder to resume (qsub -v CKPT_DIR=...)" >&2
	exit 2
fi
export CKPT_DIR
export UCP=1
export UCP_ASYNC_CONVERT="${UCP_ASYNC_CONVERT:-1}"
export UCP_KEEP_LAST="${UCP_KEEP_LAST:-3}"
export UCP_CONVERTER_WORKERS="${UCP_CONVERTER_WORKERS:-4}"
export NGPU_PER_HOST="${NGPU_PER_HOST:-12}" # Aurora: 6 GPUs x 2 tiles per node

nodes="unknown"
if [[ -f "${PBS_NODEFILE:-}" ]]; then
	nodes="$(wc -l <"${PBS_NODEFILE}")"
fi
echo "pbs_resume_elastic.sh: ${nodes} node(s) x ${NGPU_PER_HOST} ranks, resuming ${CKPT_DIR} from ${here}"

# Any arguments (e.g. --train-iters=...) go to train_aGPT_7B.sh, as they would without megatron-ucp.
# The relaunch loop (megatron-ucp relaunch) needs a launcher that starts on the host file it is given: helpers.sh's
# DeepSpeed launcher (LAUNCH_WITH=deepspeed) reads HOSTFILE; its default, `ezpz launch`, reads the job's own node
# file and would start on a lost node again.
python="${PYTHON:-python3}"
max_restarts="${UCP_MAX_RESTARTS:-3}"
launcher="${LAUNCH_WITH:-${LAUNCH_CMD:-MPICH}}"
if [[ "${max_restarts}" != 0 && -f "${PBS_NODEFILE:-}" ]]; then
	why_not=""
	if [[ ! "${max_restarts}" =~ ^[0-9]+$ ]]; then
		why_not="UCP_MAX_RESTARTS=${max_restarts} is not a number"
	elif [[ "${launcher}" != deepspeed ]]; then
		why_not="the ${launcher} launcher (ezpz launch) starts on the job's own node file; set LAUNCH_WITH=deepspeed for the relaunch loop (UCP_MAX_RESTARTS=0 says nothing)"
	elif ! check="$("${python}" -c 'from megatron_ucp.cli import build_parser; build_parser()' 2>&1)"; then
		why_not="${python} cannot run megatron-ucp before train_aGPT_7B.sh sets up its environment ($(tail -n 1 <<<"${check}")); set PYTHON to that environment's interpreter"
	fi
	if [[ -n "${why_not}" ]]; then
		echo "pbs_resume_elastic.sh: no relaunch after a node failure: ${why_not}" >&2
	else
		relaunch=("${python}" -m megatron_ucp.cli relaunch --max-restarts "${max_restarts}" --root "${CKPT_DIR}")
		if [[ -n "${UCP_PROBE:-}" ]]; then
			relaunch+=(--probe "${UCP_PROBE}")
		fi
		if [[ "${UCP_DRY_RUN:-0}" == 1 ]]; then
			"${relaunch[@]}" --dry-run -- bash "${wrapper}" "$@" || true
			exec bash "${wrapper}" "$@" # its own dry run: what the first launch runs
		fi
		exec "${relaunch[@]}" -- bash "${wrapper}" "$@"
	fi
fi
bash "${wrapper}" "$@"
