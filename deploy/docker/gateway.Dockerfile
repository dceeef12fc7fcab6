# syntax=docker/dockerfile:1
# The gateway: aiohttp + Redis client + tokenizers, no torch (about 100 MB of Python packages).
# Build from the repository root:  docker build -f deploy/docker/gateway.Dockerfile -t lorafleet-gateway .

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml ./
COPY deploy/docker/gateway_requirements.py deploy/docker/
# pyproject's dependencies without the worker-only ones (torch, triton, ...) in a layer a change of the
# code or the README does not rebuild, then the package itself without dependencies; worker/ and
# kernels/ stay out of the image.
RUN python deploy/docker/gateway_requirements.py pyproject.toml > requirements-gateway.txt \
    && pip install --no-cache-dir --prefix=/install -r requirements-gateway.txt
COPY README.md ./
COPY cli cli
COPY gateway gateway
COPY shared shared
RUN pip install --no-cache-dir --no-deps --prefix=/install .

FROM python:3.11-slim
COPY --from=build /install /usr/local
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin lorafleet
USER 10001
ENV PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
# REDIS_URL comes from the environment
ENTRYPOINT ["lorafleet"]
CMD ["gateway", "--host", "0.0.0.0", "--port", "8000"]
