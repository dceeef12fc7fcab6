# syntax=docker/dockerfile:1
# A GPU worker: CUDA torch, Triton (which compiles small C launchers at run time, hence gcc and the
# Python headers), the lorafleet package, and the heartbeat check the orchestrators probe with.
# Build from the repository root:  docker build -f deploy/docker/worker.Dockerfile -t lorafleet-worker .
# The torch wheel brings its own CUDA libraries; the base image only has to match the host's driver.

FROM nvidia/cuda:13.0.0-base-ubuntu24.04
ARG TORCH="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv && pip install --index-url "$TORCH_INDEX_URL" "$TORCH"
WORKDIR /src
COPY pyproject.toml ./
# the dependencies in their own layer, which a change of the code or the README does not rebuild (Triton
# alone is hundreds of MB), then the package itself without dependencies
RUN python3 -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > requirements.txt \
    && pip install -r requirements.txt
COPY README.md ./
COPY cli cli
COPY gateway gateway
COPY kernels kernels
COPY shared shared
COPY worker worker
RUN pip install --no-deps . && rm -rf /src
COPY --chmod=0755 deploy/docker/worker_health.py /usr/local/bin/lorafleet-worker-health
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin lorafleet
USER 10001
WORKDIR /home/lorafleet
# REDIS_URL comes from the environment; models and adapters are mounted read-only. The command is the
# orchestrator's to give: `worker --model NAME=/models/DIR --adapter-root /adapters --device cuda ...`
ENTRYPOINT ["lorafleet"]
