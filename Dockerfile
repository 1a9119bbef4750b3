# syntax=docker/dockerfile:1.7
# Rollout Platform image: vLLM engines in Ray Serve, for the Helm chart and k8s/.
# The versions below are the pins of pyproject.toml (ray[serve] in dependencies, vllm
# in the gpu extra) and of the GPU check (torch, torchvision: tests/gpu/overlay-pins.txt);
# tests/test_dockerfile.py fails when they drift apart, and resolves this install for the
# image's Python (Ubuntu 24.04's python3, 3.12) and platform (glibc 2.39, x86_64).

# ---- build: the project's wheel (pure Python; build tools stay in this stage) ----
FROM python:3.12.12-slim-bookworm AS build
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2.post1"
COPY pyproject.toml README.md ./
COPY platform/ platform/
RUN python -m build --wheel --outdir /dist .

# ---- runtime: CUDA runtime libraries, Python, vLLM, Ray, the wheel ----
# CUDA 13.0: PyPI's torch 2.13.0 and vllm 0.32.0 wheels are CUDA 13 builds (NVIDIA driver >= 580).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rollout-platform" \
      org.opencontainers.image.description="vLLM rollout engines in Ray Serve for RL trainers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/example/rollout-platform" \
      org.opencontainers.image.base.name="docker.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Interpreter only: no compilers or -dev headers in the final image. Ubuntu 24.04's python3 is
# 3.12, the Python of the GPU check (vLLM 0.32 needs >= 3.11); the venv keeps pip off the
# system interpreter (PEP 668). The python tool's sandbox: bubblewrap (noble's is 0.9), libseccomp,
# and util-linux's setpriv, with which a tool worker run as root (not the chart's) runs each call
# as an unprivileged uid (Essential, so already there: named to say it is needed). The interpreter
# (/usr) and the venv (/opt/venv, root's, umask 022) are readable by every uid, as calls need.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates bubblewrap libseccomp2 util-linux \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

COPY --from=build /dist/ /tmp/dist/
RUN pip install "vllm==0.32.0" "torch==2.13.0" "torchvision==0.28.0" "ray[serve]==2.60.0" /tmp/dist/*.whl \
 && rm -rf /tmp/dist

# UID 1000 matches the Helm chart's runAsUser and KubeRay's ray images. Ubuntu 24.04 images
# ship a user "ubuntu" with UID/GID 1000: remove it first.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
 && groupadd --gid 1000 rollout \
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
