#!/usr/bin/env bash
###############################################################################
# cpu_demo.sh: train the Megatron-DeepSpeed STAND-IN on this machine's CPU.
#
# Runs train_scripts/megatron_standin/pretrain_gpt_standin.py (a CPU stand-in for
# argonne-lcf/Megatron-DeepSpeed's pretrain_gpt_alcf.py: megatron-core GPT model,
# DeepSpeed ZeRO-1 bf16) as NPROC local ranks over gloo, the way torchrun would
# set them up, either through megatron-ucp's runner (UCP=1, the default) or with
# stock DeepSpeed only (UCP=0). `make demo` (python -m demo) calls it
# for every run it makes.
#
# Usage (from anywhere):
#   bash train_scripts/cpu_demo.sh                       # 2 ranks, tiny model, 20 iterations
#   NPROC=4 bash train_scripts/cpu_demo.sh --train-iters 10
#   NPROC=2 bash train_scripts/cpu_demo.sh --train-iters 20   # resume the same folder at DP=2
#
# A resume at another DP size keeps the checkpoint's global batch (here 4 ranks x 1 x 4 = 16) when it splits
# over the new DP size (16 does over 2, not over 3: pin --global-batch-size to choose one that does).
#
# Arguments are appended to a tiny default model (argparse: the last value of an
# option wins, so any default can be overridden). --ucp-* options go to the runner.
# The global batch is not pinned: like train_aGPT_7B.sh's default it is micro batch
# x DP x 4 accumulation steps, so it changes with NPROC unless the runner keeps the
# checkpoint's global batch on a resume at another DP size.
#
# Variables:
#   NPROC        ranks (default 2)
#   UCP          1: python -m megatron_ucp.run (default); 0: stock DeepSpeed, no plugin
#   PYTHON       interpreter (default: python3)
#   CKPT_DIR     --save/--load folder of the default arguments (default: ./cpu_demo_ckpt)
#   LOG_DIR      per-rank logs, <LOG_DIR>/<RUN_NAME>.rank<r>.log (default: ./cpu_demo_logs)
#   RUN_NAME     log file prefix (default: cpu_demo)
#   QUIET        1: do not echo rank 0's log while it runs
#   MASTER_PORT  rendezvous port (default: a free one)
#   UCP_DRY_RUN  1: print each rank's command line and exit without running
#   TORCH_EXTENSIONS_DIR  where DeepSpeed builds its CPU ops (default: a folder of this interpreter and
#                PYTHONPATH under ~/.cache/megatron-ucp-demo-extensions: another DeepSpeed release's build in
#                the shared ~/.cache/torch_extensions makes every rank die at start)
#
# Exit status: 0 when every rank succeeded, else the first failing rank's status
# (the other ranks are stopped: they would wait in a collective forever).
###############################################################################
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPT="${HERE}/megatron_standin/pretrain_gpt_standin.py"
NPROC="${NPROC:-2}"
UCP="${UCP:-1}"
PYTHON="${PYTHON:-python3}"
CKPT_DIR="${CKPT_DIR:-${PWD}/cpu_demo_ckpt}"
LOG_DIR="${LOG_DIR:-${PWD}/cpu_demo_logs}"
RUN_NAME="${RUN_NAME:-cpu_demo}"

if ! [[ "${NPROC}" =~ ^[1-9][0-9]*$ ]]; then
	echo "cpu_demo.sh: NPROC must be a positive integer, got '${NPROC}'" >&2
	exit 2
fi

# A tiny GPT whose no-weight-decay group (3 RMSNorm weights of size 3) is 9 elements long:
# at DP=4 the ZeRO alignment (2 x DP = 8) pads it to 16, 4 per rank: rank 2 holds one element and rank 3
# only padding (the AuroraGPT DP=768 failure in miniature: docs/how-it-works.md).
defaults=(
	--num-layers 1 --hidden-size 3 --num-attention-heads 1 --ffn-hidden-size 32
	--seq-length 16 --max-position-embeddings 16
	--normalization rmsnorm --disable-bias-linear --untie-embeddings-and-output-weights
	--hidden-dropout 0 --attention-dropout 0
	--standin-vocab-size 32 --make-vocab-size-divisible-by 32
	--micro-batch-size 1 --standin-grad-acc-steps 4 --train-iters 20
	--lr 0.1 --lr-decay-style linear --seed 1234
	--bf16 --deepspeed --zero-stage 1 --no-pipeline-parallel
	--save "${CKPT_DIR}" --load "${CKPT_DIR}" --save-interval 10
)

if [[ "${UCP}" == 1 ]]; then
	cmd=("${PYTHON}" -m megatron_ucp.run "${SCRIPT}" "${defaults[@]}" "$@")
else
	cmd=("${PYTHON}" "${SCRIPT}" "${defaults[@]}" "$@")
fi

if [[ -n "${MASTER_PORT:-}" ]]; then
	port="${MASTER_PORT}"
elif [[ "${UCP_DRY_RUN:-0}" == 1 ]]; then
	port="<free port>"
else
	port="$("${PYTHON}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

if [[ -z "${TORCH_EXTENSIONS_DIR:-}" ]]; then
	env_key="$("${PYTHON}" -c 'import hashlib, os, sys; print(hashlib.sha1((sys.prefix + os.pathsep + os.environ.get("PYTHONPATH", "")).encode()).hexdigest()[:12])')"
	TORCH_EXTENSIONS_DIR="${HOME}/.cache/megatron-ucp-demo-extensions/env-${env_key}"
fi

rank_env() { # the variables torchrun would set for rank $1
	printf '%s\n' "RANK=$1" "WORLD_SIZE=${NPROC}" "LOCAL_RANK=$1" "LOCAL_WORLD_SIZE=${NPROC}" \
		"MASTER_ADDR=127.0.0.1" "MASTER_PORT=${port}" "DS_ACCELERATOR=cpu" "OMP_NUM_THREADS=1" \
		"PYTHONUNBUFFERED=1" "TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR}"
}

if [[ "${UCP_DRY_RUN:-0}" == 1 ]]; then
	for ((r = 0; r < NPROC; r++)); do
		mapfile -t envs < <(rank_env "${r}")
		printf 'rank %d: %s' "${r}" "${envs[*]}"
		printf ' %q' "${cmd[@]}"
		printf '\n'
	done
	exit 0
fi

mkdir -p "${LOG_DIR}"
pids=()
for ((r = 0; r < NPROC; r++)); do
	mapfile -t envs < <(rank_env "${r}")
	env "${envs[@]}" "${cmd[@]}" >"${LOG_DIR}/${RUN_NAME}.rank${r}.log" 2>&1 &
	pids+=("$!")
done

tail_pid=""
if [[ "${QUIET:-0}" != 1 ]]; then
	tail -n +1 -f "${LOG_DIR}/${RUN_NAME}.rank0.log" &
	tail_pid="$!"
fi

# Poll rather than `wait -n PID...` (bash >= 5.1 only): reap each rank as it ends.
status=0
remaining=("${pids[@]}")
while ((${#remaining[@]} > 0)); do
	still=()
	for pid in "${remaining[@]}"; do
		if kill -0 "${pid}" 2>/dev/null; then
			still+=("${pid}")
			continue
		fi
		rc=0
		wait "${pid}" || rc=$?
		if ((rc != 0 && status == 0)); then
			status="${rc}"
			sleep 2 # let the peers print their own errors first
			for other in "${pids[@]}"; do
				kill "${other}" 2>/dev/null || true
			done
		fi
	done
	remaining=(${still[@]+"${still[@]}"})
	((${#remaining[@]} == 0)) || sleep 0.5
done

if [[ -n "${tail_pid}" ]]; then
	sleep 0.5
	kill "${tail_pid}" 2>/dev/null || true
	wait "${tail_pid}" 2>/dev/null || true
fi
if ((status != 0)); then
	echo "cpu_demo.sh: a rank failed (exit ${status}); logs: ${LOG_DIR}/${RUN_NAME}.rank*.log" >&2
fi
exit "${status}"
