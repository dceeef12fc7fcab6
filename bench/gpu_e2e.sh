#!/usr/bin/env bash
# bench/e2e on a GPU machine: the whole stack under load; results, plots and logs under $OUT, the table last.
# Usage (repository root, on the device, wheels the image lacks in .whl/): bash bench/gpu_e2e.sh [bench.e2e args]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the model and adapters (~25 GB) go to a tmpfs when it has room, else through the disk's page cache
work=/dev/shm/lorafleet-e2e
[ "$(df --output=avail -k /dev/shm | tail -1)" -gt 40000000 ] || work=/tmp/lorafleet-e2e
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
timeout "${E2E_TIMEOUT:-440}" python3 -m bench.e2e --out "$OUT" --workdir "$work" "$@" 2>&1 | tee "$OUT/run.log"
status=$?
for log in worker gateway0; do tail -c 8000000 "$work/logs/$log.log" >"$OUT/$log.log" 2>/dev/null; done
exit $status
