#!/usr/bin/env bash
# Stop the CUDA MPS control daemon started by start.sh (same CUDA_MPS_PIPE_DIRECTORY). Stop the
# workers first: the daemon's MPS server exits once its clients are gone.
set -euo pipefail

export CUDA_MPS_PIPE_DIRECTORY="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"

if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "stop.sh: nvidia-cuda-mps-control is not on PATH (it ships with the NVIDIA driver)" >&2
    exit 1
fi
if ! echo get_default_active_thread_percentage | timeout 5 nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "no MPS control daemon answers on $CUDA_MPS_PIPE_DIRECTORY"
    exit 0
fi
echo quit | nvidia-cuda-mps-control
for _ in $(seq 100); do
    if ! pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
        echo "MPS control daemon stopped"
        exit 0
    fi
    sleep 0.1
done
echo "stop.sh: the MPS control daemon is still running after 10 s (are clients still attached?)" >&2
exit 1
