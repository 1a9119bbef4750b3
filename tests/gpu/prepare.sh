#!/usr/bin/env bash
# Here (any Linux machine with pip and the package registries): prepare what a lent GPU machine needs
# to run the platform's GPU check, in the ignored folder .gpu-transfer/ (see docs/gpu.md).
#
#   bash tests/gpu/prepare.sh
#
# 1. Downloads the exact wheel closure of our pinned stack (vllm==0.32.0, torch==2.13.0+cu130,
#    ray[serve]==2.60.0, pydantic, torchvision==0.28.0) for CPython 3.12 / manylinux x86_64 / CUDA 13,
#    leaving out what the lent image already has at the pinned version (overlay-pins.txt is that list).
# 2. Tars the wheels and splits the tar into parts of at most 60 MiB (a lent machine takes 64 MiB a call),
#    with a sha256 file over the parts.
# 3. Builds the project's own wheel (pure Python) next to them.
# Re-running reuses downloaded wheels and rebuilds the parts only when the wheel set changed.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.gpu-transfer
PINS=tests/gpu/overlay-pins.txt
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

# Parts: rebuilt only when the wheel list changed (the listing is stored beside them).
LISTING=$(cd "$DEST/wheels" && ls -l --time-style=+ | awk '{print $5, $NF}' | sort)
if [ "$LISTING" != "$(cat "$DEST/parts/.listing" 2>/dev/null)" ]; then
    rm -f "$DEST/parts"/part-* "$DEST/parts/SHA256SUMS"
    # Wheels are zip archives already: tar without compression.
    tar -C "$DEST" -cf - wheels | split -b 60M -d -a 3 - "$DEST/parts/part-"
    (cd "$DEST/parts" && sha256sum part-* > SHA256SUMS)
    echo "$LISTING" > "$DEST/parts/.listing"
fi

# The project's wheel (pure Python), rebuilt every time so it matches the working tree.
rm -f "$DEST"/rollout_platform-*.whl
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" . 2>/dev/null \
    || "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DEST" .
ls "$DEST"/rollout_platform-*.whl
echo "$(ls "$DEST/parts" | grep -c '^part-') parts in $DEST/parts ($(du -sh "$DEST/parts" | cut -f1))"
