#!/usr/bin/env bash
# One device-machine session: GPU tests of the engine path, then bench/engine.py; logs under $OUT.
#   bash bench/gpu_session.sh [bench/engine.py arguments...]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -rA -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_fused.py \
    tests/worker/test_sampling.py tests/engine/test_engine_gpu.py tests/engine/test_engine_generation.py \
    tests/engine/test_engine_overlap.py 2>&1 | tee "$OUT/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-400}" python3 -m bench.engine --out "$OUT/engine.jsonl" "$@" 2>&1 | tee "$OUT/bench.log"
