#!/usr/bin/env bash
# `make image`: the repository's Dockerfile, built with buildah on a Debian base made here
# (mmdebstrap), with the CPU build of vLLM. The same file as the published GPU image; only the
# build arguments differ (docs/kubernetes.md, "The image"). Prints each phase's wall time.
#
#   IMAGE       the image built (default localhost/rollout-platform:cpu)
#   IMAGE_BASE  the base image; made from Debian bookworm when buildah does not have it
#               (default localhost/rollout-base:bookworm). `buildah rmi` it to make it anew.
#
# This machine's pip configuration is passed into the build, for the build only: its CA
# bundle (pip's `cert`: a TLS-inspecting proxy's CA, mounted beside the base's), its
# index (an http(s) `index-url`) and its local wheel folders (`find-links`, mounted read-only
# at the same paths). When a find-links folder holds torch's +cpu wheel, PyTorch's CPU index
# (unreachable from such machines) is not asked; TORCH_CPU_INDEX overrides that either way.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-localhost/rollout-platform:cpu}
IMAGE_BASE=${IMAGE_BASE:-localhost/rollout-base:bookworm}
SUITE=bookworm
mkdir -p build/image
t_all=$SECONDS

if ! buildah inspect --type image "$IMAGE_BASE" >/dev/null 2>&1; then
    # minbase: the Essential and required packages (passwd's useradd among them) and apt,
    # like the CUDA base's Ubuntu; the Dockerfile installs Python itself, as on that base.
    t0=$SECONDS
    rm -f build/image/base.tar
    mmdebstrap --quiet --variant=minbase "$SUITE" build/image/base.tar
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" build/image/base.tar /
    buildah config --cmd /bin/bash "$ctr"
    buildah commit --quiet --rm "$ctr" "$IMAGE_BASE" >/dev/null
    rm -f build/image/base.tar
    echo "make image: base $IMAGE_BASE (Debian $SUITE, mmdebstrap) made in $((SECONDS - t0)) s"
fi

pip_get() { python3 -m pip config get "$1" 2>/dev/null || true; }
args=(--build-arg "BASE=$IMAGE_BASE" --build-arg VLLM=cpu)
cert=${PIP_CERT:-$(pip_get global.cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    # Beside the base's bundle, not over it: ca-certificates' install in the build rewrites that one.
    args+=(--volume "$(realpath "$cert"):/etc/pip-build-ca.crt:ro" --build-arg PIP_CERT=/etc/pip-build-ca.crt)
fi
index=${PIP_INDEX_URL:-$(pip_get global.index-url)}
case "$index" in http://*|https://*) args+=(--build-arg "PIP_INDEX_URL=$index") ;; esac
links=()
torch_local=
for dir in ${PIP_FIND_LINKS:-$(pip_get global.find-links)}; do
    dir=${dir#file://}
    [ -d "$dir" ] || continue
    links+=("$dir")
    args+=(--volume "$dir:$dir:ro")
    compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null && torch_local=1
done
[ ${#links[@]} -eq 0 ] || args+=(--build-arg "PIP_FIND_LINKS=${links[*]}")
if [ -n "${TORCH_CPU_INDEX+set}" ]; then
    args+=(--build-arg "TORCH_CPU_INDEX=$TORCH_CPU_INDEX")
elif [ -n "$torch_local" ]; then
    args+=(--build-arg TORCH_CPU_INDEX=)
fi

t0=$SECONDS
# chroot isolation: no nested container runtime here; --layers: unchanged steps come from
# the cache (the dependency layer depends on pyproject.toml and the arguments only); docker
# format: OCI's has no HEALTHCHECK, and docker builds keep it.
buildah bud --isolation chroot --layers --pull=never --format docker "${args[@]}" --tag "$IMAGE" .
echo "make image: $IMAGE built in $((SECONDS - t0)) s"
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
echo "make image: done in $((SECONDS - t_all)) s"
