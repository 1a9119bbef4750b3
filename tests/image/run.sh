#!/usr/bin/env bash
# `make image-test`: the image `make image` built, run as the Helm chart runs it. Its root
# filesystem (buildah mount) bound read-only under bubblewrap, as uid and gid 1000 (the
# chart's runAsUser/runAsGroup, and the image's USER), with an empty tmpfs at /tmp and at
# /dev/shm (the chart's emptyDirs), /sys read-only (as runtimes mount it; vLLM's CPU
# backend reads the CPU topology there), the image's own environment and nothing else, and a
# network namespace of its own (loopback only: its ports meet no other process's). The files
# a container runtime provides (/etc/hosts, /etc/hostname, /etc/resolv.conf) are written into
# the working container's own layer, never the image. Then:
#   - `rollout --version`, and `ray` and `rollout` found by KubeRay's login shell (bash -lc);
#   - tests/image/check.py, by the image's Python: `rollout serve` with the README's smallest
#     config on the demo model built in the image, a rollout over /v1/rollouts, an OpenAI
#     completion, uid 1000 and the read-only root, a clean stop.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-localhost/rollout-platform:cpu}
t_all=$SECONDS

buildah inspect --type image "$IMAGE" >/dev/null || { echo "make image-test: no image $IMAGE: run make image" >&2; exit 1; }
mkdir -p build/image
rm -f build/image/check.log
ctr=$(buildah from --pull=never "$IMAGE")
cleanup() { end_sandbox; buildah umount "$ctr" >/dev/null 2>&1 || true; buildah rm "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
root=$(buildah mount "$ctr")
printf '127.0.0.1\tlocalhost rollout-image-test\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
echo rollout-image-test > "$root/etc/hostname"
: > "$root/etc/resolv.conf"

# The image's configuration: its user, environment and command, as a runtime reads them.
user=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$IMAGE")
[ "$user" = "1000:1000" ] || { echo "make image-test: the image's USER is '$user', not the chart's 1000:1000" >&2; exit 1; }
mapfile -t env < <(buildah inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
envargs=()
for kv in "${env[@]}"; do envargs+=(--setenv "${kv%%=*}" "${kv#*=}"); done

# PROC=own: a pid namespace and /proc of its own. PROC=unmasked: the host's /proc, as a pod
# with procMount: Unmasked sees its own: bubblewrap mounts its /proc with read-only parts
# (/proc/sys ...) over it, and the kernel lets the python tool's bubblewrap mount a fresh
# /proc only where none of /proc is covered; the chart's tool pods need the same
# (docs/kubernetes-tool-sandbox.md). Its processes are then ended by their user namespace.
PROC=own
sandbox() {
    local proc=(--unshare-pid --proc /proc)
    [ "$PROC" = own ] || proc=(--bind /proc /proc)
    bwrap --die-with-parent --unshare-user --uid 1000 --gid 1000 \
        --unshare-ipc --unshare-net --unshare-uts --hostname rollout-image-test \
        --ro-bind "$root" / "${proc[@]}" --dev /dev --ro-bind /sys /sys --tmpfs /tmp --tmpfs /dev/shm \
        --clearenv "${envargs[@]}" --chdir / "$@"
}
# The serve check prints its user namespace first; whatever is still in it at the end is killed.
end_sandbox() {
    local userns
    userns=$(sed -n 's/^image-test: userns //p' build/image/check.log 2>/dev/null | head -1)
    [ -n "$userns" ] || return 0
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/user" 2>/dev/null)" = "$userns" ] && kill -KILL "${p#/proc/}" 2>/dev/null
    done
    return 0
}

t0=$SECONDS
version=$(sandbox rollout --version)
echo "make image-test: rollout --version: $version"
# KubeRay's command for every Ray container: /bin/bash -lc -- "ulimit -n 65536; ray start ...".
found=$(sandbox /bin/bash -lc -- 'command -v ray rollout python | tr "\n" " "')
case "$found" in
    "/opt/venv/bin/ray /opt/venv/bin/rollout /opt/venv/bin/python "*) echo "make image-test: KubeRay's login shell finds $found" ;;
    *) echo "make image-test: KubeRay's login shell (bash -lc) finds '$found', not the venv's ray, rollout and python" >&2; exit 1 ;;
esac
PROC=unmasked
sandbox python - < tests/image/check.py | tee build/image/check.log
echo "make image-test: passed in $((SECONDS - t_all)) s (the checks in the image: $((SECONDS - t0)) s)"
