#!/usr/bin/env bash
# One device-machine session for model switching and MPS: GPU tests of worker/switching, then
# bench/model_switch.py (switch part; share part without MPS; share part under the real MPS daemon
# started and stopped by deploy/mps/); logs and JSON rows under $OUT, the tables printed last.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
SECONDS_PER_SETUP=${SECONDS_PER_SETUP:-10}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 90 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/switching 2>&1 | tee "$OUT/tests.log" | tail -4
timeout 260 python3 -m bench.model_switch --part switch --out "$OUT/rows.jsonl" "$@" 2>&1 \
    | grep -v model_loaded | tee "$OUT/switch.log" | grep -v '^|'
timeout 150 python3 -m bench.model_switch --part share --seconds "$SECONDS_PER_SETUP" --out "$OUT/rows.jsonl" 2>&1 \
    | grep -v model_loaded | tee "$OUT/share.log" | grep -v '^|'
export CUDA_MPS_PIPE_DIRECTORY=/tmp/lorafleet-mps CUDA_MPS_LOG_DIRECTORY=/tmp/lorafleet-mps-log
bash deploy/mps/start.sh 2>&1 | tee "$OUT/mps.log"
timeout 100 python3 -m bench.model_switch --part share --mps --seconds "$SECONDS_PER_SETUP" --out "$OUT/rows.jsonl" 2>&1 \
    | grep -v model_loaded | tee "$OUT/share_mps.log" | grep -v '^|'
bash deploy/mps/stop.sh 2>&1 | tee -a "$OUT/mps.log"
cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$OUT/mps_control.log" 2>/dev/null
echo; grep -h '^|\|floor' "$OUT/switch.log"; echo; grep -h '^|' "$OUT/share.log" "$OUT/share_mps.log"
