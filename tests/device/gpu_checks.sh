#!/usr/bin/env bash
# megatron-ucp on an accelerator, in two steps (tests/device/README.md):
#
#   bash tests/device/gpu_checks.sh prepare   # here, on the CPU: DeepSpeed and its missing dependencies as
#                                             # wheels, and the CPU-saved sources, into .gpu-carry/ (git-ignored)
#   bash tests/device/gpu_checks.sh run       # on the CUDA machine (DEVICE=cpu: the rehearsal, anywhere):
#                                             # the wheels installed beside its torch, the checks, the report
#
# The report (report.md, report.json) goes to $OUT when set (the device tool brings that folder back), else
# .gpu-carry/report-$DEVICE/. Exit 1 when a check failed.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=${CARRY:-.gpu-carry}
DEEPSPEED_VERSION=0.19.8
# What DeepSpeed needs that a CUDA image with torch may lack, at the versions the suite runs with.
WHEELS="hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0"

case "${1:-}" in
prepare)
    PY=${PYTHON:-.venv/bin/python}
    rm -rf "$CARRY/whl" && mkdir -p "$CARRY/whl"
    DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation "deepspeed==$DEEPSPEED_VERSION" \
        -w "$CARRY/whl"
    # shellcheck disable=SC2086  # one word per wheel
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$CARRY/whl" $WHEELS
    DS_ACCELERATOR=cpu "$PY" -m tests.device.gpu_checks prepare "$CARRY/sources"
    du -sh "$CARRY"
    ;;
run)
    DEVICE=${DEVICE:-cuda}
    PY=python3  # the CUDA image's, which holds torch; the rehearsal takes the project's environment
    if [ "$DEVICE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
    PY=${PYTHON:-$PY}
    if [ "$DEVICE" != cpu ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ucp-site \
            "$CARRY"/whl/*.whl
        export PYTHONPATH=/tmp/ucp-site${PYTHONPATH:+:$PYTHONPATH}
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    fi
    REPORT=${OUT:-$CARRY/report-$DEVICE}
    RUNS=$(mktemp -d /tmp/gpu_checks.XXXXXX)
    export PYTHONUNBUFFERED=1
    "$PY" -m tests.device.gpu_checks check "$CARRY/sources" --device "$DEVICE" --report "$REPORT" --runs "$RUNS"
    ;;
*)
    echo "usage: bash tests/device/gpu_checks.sh prepare|run   (DEVICE=cuda|cpu for run)" >&2
    exit 2
    ;;
esac
