# syntax=docker/dockerfile:1.7
# Rollout Platform image: vLLM engines in Ray Serve, for the Helm chart and k8s/.
# The versions below are the pins of pyproject.toml (ray[serve] in dependencies, vllm
# in the gpu extra); tests/test_dockerfile.py fails when they drift apart.

# ---- build: the project's wheel (pure Python; build tools stay in this stage) ----
FROM python:3.10.16-slim-bookworm AS build
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2.post1"
COPY pyproject.toml README.md ./
COPY platform/ platform/
RUN python -m build --wheel --outdir /dist .

# ---- runtime: CUDA runtime libraries, Python, vLLM, Ray, the wheel ----
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04 AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rollout-platform" \
      org.opencontainers.image.description="vLLM rollout engines in Ray Serve for RL trainers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/example/rollout-platform" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:12.8.1-runtime-ubuntu22.04"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Interpreter only: no compilers or -dev headers in the final image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

COPY --from=build /dist/ /tmp/dist/
RUN pip install "vllm==0.32.0" "ray[serve]==2.60.0" /tmp/dist/*.whl \
 && rm -rf /tmp/dist

# UID 1000 matches the Helm chart's runAsUser and KubeRay's ray images.
RUN groupadd --gid 1000 rollout \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rollout --shell /bin/bash rollout
USER 1000:1000
WORKDIR /home/rollout
# The chart mounts the root filesystem read-only; caches go to /tmp (an emptyDir there).
ENV HOME=/home/rollout XDG_CACHE_HOME=/tmp/cache

EXPOSE 8000 8080 8265 6379 10001
# /healthz answers 200 once an engine replica responds (no API key needed).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=8)"]

# KubeRay replaces the command with `ray start ...`; alone, the image serves a config file.
CMD ["rollout", "serve", "--config", "/etc/rollout/platform.yaml"]
