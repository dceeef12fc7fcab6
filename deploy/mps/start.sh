#!/usr/bin/env bash
# Start the CUDA MPS control daemon, so several lorafleet workers share one GPU's compute.
#
#   CUDA_VISIBLE_DEVICES=0 deploy/mps/start.sh      # then start workers with the same two variables:
#   export CUDA_MPS_PIPE_DIRECTORY=... CUDA_MPS_LOG_DIRECTORY=...
#   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 lorafleet worker --gpu-memory-fraction 0.45 --model a=... &
#   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 lorafleet worker --gpu-memory-fraction 0.45 --model b=... &
#
# MPS does not isolate memory: every worker needs --gpu-memory-fraction (a hard per-process cap), and
# the fractions must sum to less than 1. A fatal CUDA error in one client can take the others down.
# The GPU's compute mode is left as it is (EXCLUSIVE_PROCESS is recommended, but is the admin's call).
set -euo pipefail

export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
export CUDA_MPS_LOG_DIRECTORY="${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}"

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "start.sh: nvidia-cuda-mps-control is not on PATH (it ships with the NVIDIA driver)" >&2
    exit 1
fi
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"

# the control daemon answers on its pipe: a second start would fail, so report the running one
if echo get_default_active_thread_percentage | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "MPS control daemon already running (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    exit 0
fi
nvidia-cuda-mps-control -d
for _ in $(seq 50); do
    if echo get_default_active_thread_percentage | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
        echo "MPS control daemon running (pipe $CUDA_MPS_PIPE_DIRECTORY, log $CUDA_MPS_LOG_DIRECTORY)"
        exit 0
    fi
    sleep 0.1
done
echo "start.sh: the MPS control daemon did not answer; see $CUDA_MPS_LOG_DIRECTORY/control.log" >&2
exit 1
