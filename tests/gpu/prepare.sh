#!/usr/bin/env bash
# Here (any Linux machine with pip and the package registries): prepare what a lent GPU machine needs
# to run the platform's GPU check, in an ignored folder (see docs/gpu.md).
#
#   bash tests/gpu/prepare.sh                          vLLM 0.32.0 (the pinned stack) into .gpu-transfer/
#   VLLM_VERSION=0.33.0 bash tests/gpu/prepare.sh      vLLM 0.33.0 into .gpu-transfer-0.33.0/
#
# 1. Downloads the exact wheel closure of the stack (0.32.0: vllm, torch==2.13.0+cu130, ray[serve]==2.60.0,
#    pydantic, torchvision==0.28.0; 0.33.0: vllm, torch==2.14.0, torchvision==0.29.0, the rest alike) for
#    CPython 3.12 / manylinux x86_64 / CUDA 13, leaving out what the lent image already has at the pinned
#    version (tests/gpu/overlay-pins.txt for 0.32.0, overlay-pins-vllm-<version>.txt otherwise).
# 2. Tars the wheels and splits the tar into parts of at most 60 MiB (a lent machine takes 64 MiB a call),
#    with a sha256 file over the parts.
# 3. For another version than 0.32.0, also the delta: only the wheels its list pins and 0.32.0's does not
#    pin at that version (DEST/delta/parts; REPLACES in it names the 0.32.0 wheels they replace), for a
#    machine that already unpacked the 0.32.0 parts (`check.sh install-delta` builds the full set there).
# 4. Builds the project's own wheel (pure Python) next to them.
# Re-running reuses downloaded wheels and rebuilds the parts only when the wheel set changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE_VERSION=0.32.0
BASE_PINS=tests/gpu/overlay-pins.txt
VLLM_VERSION=${VLLM_VERSION:-$BASE_VERSION}
if [ "$VLLM_VERSION" = "$BASE_VERSION" ]; then
    DEST=.gpu-transfer
    PINS=$BASE_PINS
else
    DEST=.gpu-transfer-$VLLM_VERSION
    PINS=tests/gpu/overlay-pins-vllm-$VLLM_VERSION.txt
fi
[ -f "$PINS" ] || { echo "no wheel list for vLLM $VLLM_VERSION: $PINS"; exit 2; }
PY=${PYTHON:-python3}
mkdir -p "$DEST/wheels" "$DEST/parts"

# pip matches manylinux tags exactly: offer every glibc level the lent image (glibc 2.39) can load.
PLATFORMS=(--platform manylinux2014_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

# The host's pip constraints (a cap on torch for this machine's own use) do not apply to another machine's Python.
export PIP_CONSTRAINT=
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" --platform any \
    --dest "$DEST/wheels" -r "$PINS"

# Exactly one wheel per pinned project, and nothing else (a stale wheel of another version would break the install).
"$PY" - "$PINS" "$DEST/wheels" <<'EOF'
import os, re, sys
pins, folder = sys.argv[1], sys.argv[2]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {}
for line in open(pins):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        want[norm(name)] = version
have = {}
for f in os.listdir(folder):
    name, version = f.split("-")[:2]
    if want.get(norm(name)) != version:
        print("removing stale wheel", f); os.remove(os.path.join(folder, f)); continue
    have[norm(name)] = f
missing = sorted(set(want) - set(have))
if missing:
    sys.exit(f"missing wheels: {missing}")
print(f"{len(have)} wheels, {sum(os.path.getsize(os.path.join(folder, f)) for f in have.values()) / 2**30:.2f} GiB")
EOF

# The parts of folder $2 (under $1) in folder $3: rebuilt only when its wheel list changed (the listing is
# stored beside them).
split_parts() {
    local root=$1 folder=$2 parts=$3 listing
    mkdir -p "$parts"
    listing=$(cd "$root/$folder" && ls -l --time-style=+ | awk '{print $5, $NF}' | sort)
    if [ "$listing" != "$(cat "$parts/.listing" 2>/dev/null)" ]; then
        rm -f "$parts"/part-* "$parts/SHA256SUMS"
        # Wheels are zip archives already: tar without compression.
        tar -C "$root" -cf - "$folder" | split -b 60M -d -a 3 - "$parts/part-"
        (cd "$parts" && sha256sum part-* > SHA256SUMS)
        echo "$listing" > "$parts/.listing"
    fi
}
split_parts "$DEST" wheels "$DEST/parts"

if [ "$PINS" != "$BASE_PINS" ]; then
    # The delta onto the base overlay: this list's wheels that the base list does not pin at the same version
    # (hard links to the downloaded wheels), and REPLACES: the base wheels of the same projects (and any the
    # list drops), which the machine leaves out of the base set before installing both as one set.
    rm -rf "$DEST/delta/wheels-delta" && mkdir -p "$DEST/delta/wheels-delta"
    "$PY" - "$BASE_PINS" "$PINS" "$DEST/wheels" "$DEST/delta/wheels-delta" <<'EOF'
import os, re, sys
base_pins, pins, wheels, delta = sys.argv[1:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
def read(path):
    out = {}
    for line in open(path):
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[norm(name)] = (name, version)
    return out
base, want = read(base_pins), read(pins)
new = {n for n, (_, v) in want.items() if base.get(n, (None, None))[1] != v}
replaces = sorted(f"{base[n][0]}=={base[n][1]}" for n in new if n in base)
dropped = sorted(f"{name}=={v}" for n, (name, v) in base.items() if n not in want)
size = 0
for f in sorted(os.listdir(wheels)):
    if norm(f.split("-")[0]) in new:
        os.link(os.path.join(wheels, f), os.path.join(delta, f))
        size += os.path.getsize(os.path.join(wheels, f))
with open(os.path.join(delta, "REPLACES"), "w") as out:
    out.write("".join(f"{r}\n" for r in replaces + dropped))
print(f"delta onto the {len(base)}-wheel base overlay: {len(new)} wheels, {size / 2**30:.2f} GiB; they replace {len(replaces)} base wheels, {len(dropped)} base wheels dropped")
EOF
    split_parts "$DEST/delta" wheels-delta "$DEST/delta/parts"
    echo "$(ls "$DEST/delta/parts" | grep -c '^part-') delta parts in $DEST/delta/parts ($(du -sh "$DEST/delta/parts" | cut -f1))"
fi

# The project's wheel (pure Python), rebuilt every time so it matches the working tree.
rm -f "$DEST"/rollout_platform-*.whl
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" . 2>/dev/null \
    || "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DEST" .
ls "$DEST"/rollout_platform-*.whl
echo "$(ls "$DEST/parts" | grep -c '^part-') parts in $DEST/parts ($(du -sh "$DEST/parts" | cut -f1))"
