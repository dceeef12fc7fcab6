#!/usr/bin/env bash
# `make deploy-test`: build the images from the project's Dockerfiles, bring the compose stack up with
# the CPU override (docker-compose.cpu.yml) serving the demo model, run deploy/ci/stack_checks.py
# against it through nginx, and tear everything down, also when a step fails.
#
# For the CI machines (Debian, root, package registries but no image registry): podman with runc
# (setup-podman.sh), local look-alikes of the upstream base images (base-images.sh), podman-compose
# from PyPI (the Makefile installs it). Grafana is not started: no package source has its server
# (tests/deploy check its provisioning and dashboard). Image layers, the base images, the torch wheel
# and the demo wheel are cached on the machine, so a second run rebuilds only what changed.
#
#   deploy/ci/stack-test.sh            (from the repository root; VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${VENV:-.venv}"
python="$venv/bin/python"
compose=("$venv/bin/podman-compose" -p lorafleet-ci -f deploy/docker-compose.yml -f deploy/docker-compose.cpu.yml)
cache=/var/cache/lorafleet-ci
started=$SECONDS

step() { echo "deploy-test [$((SECONDS - started))s] $*"; }
free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step "podman and the local base images"
deploy/ci/setup-podman.sh
deploy/ci/base-images.sh

step "images: lorafleet-gateway:dev, lorafleet-worker:dev (CPU torch)"
# --format docker keeps the Dockerfiles' HEALTHCHECK (OCI images have none)
build=(podman build --quiet --format docker --pull=never)
# podman 4.3 reads only the context's .dockerignore, not BuildKit's per-Dockerfile one: name it
"${build[@]}" --ignorefile deploy/docker/gateway.Dockerfile.dockerignore -f deploy/docker/gateway.Dockerfile \
    -t lorafleet-gateway:dev . >/dev/null
# the torch wheel pip resolves on this machine (the Makefile's TORCH: the CPU build on the CI machines),
# handed to the worker Dockerfile's TORCH argument through a build volume
mkdir -p "$cache/wheels"
# shellcheck disable=SC2086  # TORCH may carry pip options, as in the Makefile
"$python" -m pip download --quiet --no-deps --dest "$cache/wheels" ${TORCH:-torch==2.13.0}
torch_wheel="$(cd "$cache/wheels" && ls -t torch-*.whl | head -n1)"
"${build[@]}" --ignorefile deploy/docker/worker.Dockerfile.dockerignore -f deploy/docker/worker.Dockerfile \
    -v "$cache/wheels:/wheels:ro" --build-arg "TORCH=/wheels/$torch_wheel" \
    --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t lorafleet-worker:dev . >/dev/null
podman image prune --force >/dev/null  # the previous builds' layers, now untagged


work="$(mktemp -d /var/tmp/lorafleet-deploy-test.XXXXXX)"
export LORAFLEET_MODELS_DIR="$work/models" LORAFLEET_ADAPTERS_DIR="$work/adapters"
export LORAFLEET_MODEL="smollm2=/models/smollm2" REDIS_MAXMEMORY=256mb
LORAFLEET_PORT="$(free_port)" PROMETHEUS_PORT="$(free_port)"
export LORAFLEET_PORT PROMETHEUS_PORT

teardown() {
    local status=$?
    step "tear down (containers, pod, volumes, network)"
    if ((status != 0)); then
        for container in $(podman ps -a --filter label=io.podman.compose.project=lorafleet-ci --format '{{.Names}}'); do
            echo "--- last log lines of $container"
            podman logs --tail 15 "$container" 2>&1 || true
        done
    fi
    "${compose[@]}" down --volumes --timeout 5 >/dev/null 2>&1 || true
    podman pod rm --force pod_lorafleet-ci >/dev/null 2>&1 || true
    podman network rm --force lorafleet-ci_default >/dev/null 2>&1 || true
    rm -rf "$work"
    step "$( ((status == 0)) && echo PASS || echo FAIL ) deploy-test"
    exit "$status"
}
trap teardown EXIT

step "demo model and adapters"
"$python" deploy/ci/stack_checks.py demo-files "$work"
chmod -R a+rX "$work"  # the containers run as uid 10001 and mount it read-only
"${compose[@]}" down --volumes --timeout 5 >/dev/null 2>&1 || true  # what an interrupted run left

step "compose up: redis, then gateway x2, lb, worker, prometheus (ports $LORAFLEET_PORT, $PROMETHEUS_PORT)"
# podman 4.3 ignores depends_on's service_healthy and has no systemd timers to run healthchecks: wait for
# Redis' own healthcheck here before starting what needs it
"${compose[@]}" up -d redis >/dev/null 2>&1
for _ in $(seq 60); do
    podman healthcheck run lorafleet-ci_redis_1 >/dev/null 2>&1 && break
    sleep 1
done
podman healthcheck run lorafleet-ci_redis_1 >/dev/null
"${compose[@]}" up -d gateway lb worker prometheus >/dev/null 2>&1
podman ps --filter label=io.podman.compose.project=lorafleet-ci --format '{{.Names}}  {{.Image}}  {{.Status}}'

step "checks"
"$python" deploy/ci/stack_checks.py check --project lorafleet-ci \
    --url "http://127.0.0.1:$LORAFLEET_PORT" --prometheus "http://127.0.0.1:$PROMETHEUS_PORT"
