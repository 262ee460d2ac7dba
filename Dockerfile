# One image for the agent (`otel-gpu run` / `watch`), the processor (`otel-gpu processor`) and
# the demo: docker build -t otel-gpu:latest .
#
# The health check reads OTEL_GPU_HEALTHCHECK_URL: the processor's `--health` endpoint by default
# (http://127.0.0.1:13134/healthz, as docker-compose.yml starts it); an agent run with
# `--exporter prometheus` sets it to its /metrics (http://127.0.0.1:9464/metrics).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# Only what the package build reads, so edits to tests or docs do not rebuild the wheels.
COPY pyproject.toml README.md ./
COPY otel_gpu ./otel_gpu
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OTEL_GPU_HEALTHCHECK_URL=http://127.0.0.1:13134/healthz
# The GPU is reached through the NVIDIA container runtime (it mounts libnvidia-ml.so.1); the
# image itself carries no driver.
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/otel-gpu otel-gpu
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl \
    && rm -rf /wheels
USER 10001
WORKDIR /var/lib/otel-gpu
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['OTEL_GPU_HEALTHCHECK_URL'], timeout=4)"]
ENTRYPOINT ["otel-gpu"]
CMD ["--help"]
