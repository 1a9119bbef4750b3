#!/usr/bin/env bash
# There (a lent GPU machine, from the repository root): the GPU check, in steps.
#
#   bash tests/gpu/check.sh models    build the test models with the machine's own Python (torch +
#                                     transformers are there already): start it first, in the background
#   bash tests/gpu/check.sh install   verify and unpack the transferred parts, install the overlay
#                                     (vllm 0.32.0, torch 2.13.0+cu130, ray 2.60.0; with VLLM_VERSION=0.33.0
#                                     the parts of .gpu-transfer-0.33.0/: vllm 0.33.0, torch 2.14.0) and
#                                     the project
#   VLLM_VERSION=0.33.0 bash tests/gpu/check.sh install-delta
#                                     on a machine that installed the 0.32.0 parts: verify and unpack the
#                                     delta parts (.gpu-transfer-0.33.0/delta/parts, in $ROLLOUT_GPU_PARTS),
#                                     build the 0.33.0 wheel set from the 0.32.0 one and the delta, and
#                                     install it into its own overlay ($ROLLOUT_GPU_SITE) and the project
#   bash tests/gpu/check.sh run [S] [PYTEST ARGS...]
#                                     run the GPU tests (tests/gpu/test_gpu_*.py: the senders', the
#                                     platform's, then any other file), at most S seconds (default
#                                     1500); results.json and check.log go to $OUT (or
#                                     $ROLLOUT_GPU_WORK/out), rewritten after every test. Any subset
#                                     runs on its own, e.g. `run 600 -k ipc` (the checks left out are
#                                     recorded as not run, and why); `run 900 -k fleet` on four GPUs
#                                     publishes into 1, 2 and 3 replicas (it skips with fewer);
#                                     ROLLOUT_GPU_FILES="tests/gpu/a.py tests/gpu/b.py" runs those files
#                                     in that order instead
#
# Where things are (override with the variables):
#   VLLM_VERSION       the vLLM the overlay holds (default 0.32.0); the results record the installed one
#   ROLLOUT_GPU_PARTS  the transferred part-NNN files and SHA256SUMS   (default /tmp/acc; for another
#                      version /tmp/acc-VERSION, and /tmp/acc-VERSION-delta for install-delta)
#   ROLLOUT_GPU_SITE   the overlay installed with pip --target          (default /tmp/site; for another
#                      version /tmp/site-VERSION, so both overlays can stay installed side by side)
#   ROLLOUT_GPU_WORK   models, checkpoints, the project's install, logs (default /tmp/gpu-work)
#   ROLLOUT_GPU_MARGIN seconds before the end of S after which no check starts (default 360: the
#                      longest check, TP=2, takes about five minutes; the fleet check, on four GPUs,
#                      about five after other checks and up to ten alone, where it starts the bare
#                      engine and compiles first)
set -uo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [ "$VLLM_VERSION" = 0.32.0 ]; then SUFFIX=""; else SUFFIX="-$VLLM_VERSION"; fi
if [ "${1:-}" = install-delta ]; then PARTS=${ROLLOUT_GPU_PARTS:-/tmp/acc$SUFFIX-delta}; else PARTS=${ROLLOUT_GPU_PARTS:-/tmp/acc$SUFFIX}; fi
SITE=${ROLLOUT_GPU_SITE:-/tmp/site$SUFFIX}
WORK=${ROLLOUT_GPU_WORK:-/tmp/gpu-work}
RESULTS_DIR=${OUT:-$WORK/out}
PY=${PYTHON:-python3}
mkdir -p "$WORK" "$RESULTS_DIR"
# NVLink multicast stays off on shared machines (the lent image sets these; keep them for every child).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

models() {
    # modelbuild.py needs only torch, transformers and tokenizers: no overlay yet (-P: see its __main__).
    [ -f "$WORK/model-1.5b/model.safetensors" ] || "$PY" -P platform/rollout/modelbuild.py "$WORK/model-1.5b" 1.5b
    # The Qwen3-MoE model of the routed-experts check (tests/gpu/test_gpu_moe.py), ~0.9B parameters.
    [ -f "$WORK/model-moe/model.safetensors" ] || "$PY" -P platform/rollout/modelbuild.py "$WORK/model-moe" moe
    touch "$WORK/models.done"
}

install() {
    local t0=$SECONDS
    (cd "$PARTS" && sha256sum --quiet -c SHA256SUMS) || { echo "install: the parts in $PARTS do not match SHA256SUMS"; return 1; }
    rm -rf "$WORK/wheels$SUFFIX"
    # The tar holds wheels/: a version's own set goes to wheels-VERSION, beside the 0.32.0 one.
    cat "$PARTS"/part-* | tar -x -C "$WORK" --transform "s#^wheels#wheels$SUFFIX#" || { echo "install: unpacking the parts failed"; return 1; }
    echo "install: $(ls "$WORK/wheels$SUFFIX" | wc -l) wheels verified and unpacked in $((SECONDS - t0)) s"
    install_set "$WORK/wheels$SUFFIX" "$t0"
}

install_delta() {
    # The 0.32.0 set ($WORK/wheels, from `install`) less the wheels REPLACES names, plus the delta's: one
    # set, installed as `install` installs one (hard links: no copy of the shared wheels).
    local t0=$SECONDS set="$WORK/wheels$SUFFIX"
    [ -n "$SUFFIX" ] || { echo "install-delta: set VLLM_VERSION to the version the delta is for"; return 1; }
    [ -d "$WORK/wheels" ] || { echo "install-delta: no 0.32.0 wheels in $WORK/wheels (run install with the 0.32.0 parts first)"; return 1; }
    (cd "$PARTS" && sha256sum --quiet -c SHA256SUMS) || { echo "install-delta: the parts in $PARTS do not match SHA256SUMS"; return 1; }
    rm -rf "$WORK/wheels-delta" "$set"
    cat "$PARTS"/part-* | tar -x -C "$WORK" || { echo "install-delta: unpacking the parts failed"; return 1; }
    "$PY" - "$WORK/wheels" "$WORK/wheels-delta" "$set" <<'EOF' || return 1
import os, re, sys
base, delta, out = sys.argv[1:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
replaced = set()
for line in open(os.path.join(delta, "REPLACES")):
    if line.strip():
        name, version = line.strip().split("==")
        replaced.add((norm(name), version))
os.makedirs(out)
kept = [f for f in os.listdir(base) if (norm(f.split("-")[0]), f.split("-")[1]) not in replaced]
missing = len(replaced) - (len(os.listdir(base)) - len(kept))
if missing:
    sys.exit(f"install-delta: {missing} wheel(s) REPLACES names are not in {base}: not the 0.32.0 set")
new = [f for f in os.listdir(delta) if f.endswith(".whl")]
for folder, names in ((base, kept), (delta, new)):
    for f in names:
        os.link(os.path.join(folder, f), os.path.join(out, f))
print(f"install-delta: {len(kept)} wheels of the 0.32.0 set and {len(new)} of the delta ({len(replaced)} replaced)")
EOF
    install_set "$set" "$t0"
}

install_set() {
    local wheels=$1 t0=$2
    # A fresh overlay: ONE pip call for all wheels (a later `pip --target --upgrade` replaces whole top-level
    # folders, nvidia/ among them, so an overlay is never updated in place).
    rm -rf "$SITE"
    env -u PYTHONPATH "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl \
        || { echo "install: pip failed"; return 1; }
    # torch (2.13, 2.14) finds its CUDA libraries through RPATH $ORIGIN/../../nvidia/{cu13,...}/lib inside $SITE only; the
    # ones reused from the image (cupti nvrtc cudart cufft cufile curand cusolver cusparse nvjitlink nvtx, nvshmem)
    # are linked in, never over a carried file. Never put the image's nvidia folders on LD_LIBRARY_PATH.
    env -u PYTHONPATH "$PY" - "$SITE" <<'EOF'
import os, sys, sysconfig
target = os.path.join(sys.argv[1], "nvidia")
image = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
linked = 0
for sub in ("cu13", "nvshmem"):
    for root, _, files in os.walk(os.path.join(image, sub)):
        d = os.path.join(target, os.path.relpath(root, image))
        os.makedirs(d, exist_ok=True)
        for f in files:
            if not os.path.lexists(os.path.join(d, f)):
                os.symlink(os.path.join(root, f), os.path.join(d, f))
                linked += 1
print(f"install: linked {linked} CUDA files reused from {image}")
EOF
    # The project: built from this tree, into its own folder (a --target install into $SITE would replace its bin/).
    # Built with the image's setuptools; else the wheel prepare.sh built (carried in .gpu-transfer/).
    rm -rf "$WORK/project" "$WORK/dist"
    if ! env -u PYTHONPATH "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/dist" . ; then
        echo "install: building the project's wheel here failed; using the one prepare.sh built"
        mkdir -p "$WORK/dist" && cp .gpu-transfer/rollout_platform-*.whl "$WORK/dist/" || { echo "install: no project wheel"; return 1; }
    fi
    env -u PYTHONPATH "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/project" "$WORK"/dist/*.whl \
        || { echo "install: installing the project's wheel failed"; return 1; }
    export PYTHONPATH="$WORK/project:$SITE"
    "$PY" -c "import torch, vllm, ray, pydantic, rollout; print('install: torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), '| vllm', vllm.__version__, '| ray', ray.__version__, '| rollout from', rollout.__file__)" \
        || { echo "install: the overlay does not import"; return 1; }
    "$PY" -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$VLLM_VERSION' else f'install: vllm {vllm.__version__} installed, not $VLLM_VERSION')" || return 1
    echo "install: done in $((SECONDS - t0)) s"
}

run() {
    local budget=${1:-1500}
    shift $(( $# > 0 ? 1 : 0 ))
    export PYTHONPATH="$WORK/project:$SITE" PYTHONUNBUFFERED=1
    export ROLLOUT_GPU_WORK="$WORK" ROLLOUT_GPU_MODEL="$WORK/model-1.5b" ROLLOUT_GPU_MOE_MODEL="$WORK/model-moe" ROLLOUT_GPU_RESULTS="$RESULTS_DIR/results.json"
    # The run ends at ROLLOUT_GPU_END (the timeout below). Checks not started by the deadline are
    # skipped (and say so): the longest check, the TP=2 replica's start and publish, takes about
    # five minutes on two H100s, so one started before it still ends within the budget.
    export ROLLOUT_GPU_END=$(( $(date +%s) + budget ))
    export ROLLOUT_GPU_DEADLINE=$(( ROLLOUT_GPU_END - ${ROLLOUT_GPU_MARGIN:-360} ))
    for _ in $(seq 1 120); do [ -f "$WORK/models.done" ] && break; sleep 2; done
    [ -f "$WORK/models.done" ] || models
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader > "$RESULTS_DIR/gpus.txt" 2>&1
    # The senders' tests (no Ray), then the platform's, then any other GPU test file, the MoE
    # and FP8 checks last (their engines are the likeliest to stall at start: see the file).
    # ROLLOUT_GPU_FILES (space-separated test files) replaces that order, for a stay that must
    # run the checks it cares most about first.
    local files=(tests/gpu/test_gpu_senders.py tests/gpu/test_gpu_platform.py) f
    for f in tests/gpu/test_gpu_*.py; do
        case " ${files[*]} tests/gpu/test_gpu_moe.py " in *" $f "*) ;; *) files+=("$f") ;; esac
    done
    files+=(tests/gpu/test_gpu_moe.py)
    if [ -n "${ROLLOUT_GPU_FILES:-}" ]; then read -r -a files <<< "$ROLLOUT_GPU_FILES"; fi
    # The project's tests/ is imported from this tree (the engines' code ships to Ray workers by value).
    timeout "$budget" "$PY" -m pytest -p no:cacheprovider -v -rA --timeout 1200 -o addopts="" \
        "${files[@]}" "$@" 2>&1 | tee "$RESULTS_DIR/check.log"
    local rc=${PIPESTATUS[0]}
    # Serve's and the replicas' logs: the first place to look when a check failed.
    tar -czf "$RESULTS_DIR/ray-logs.tgz" -C /tmp/ray/session_latest logs 2>/dev/null
    [ "$(stat -c %s "$RESULTS_DIR/ray-logs.tgz" 2>/dev/null || echo 0)" -lt 15000000 ] || rm -f "$RESULTS_DIR/ray-logs.tgz"
    "$PY" -c "import json, sys; sys.path.insert(0, '$WORK/project'); d = json.load(open('$RESULTS_DIR/results.json')); print({k: v['outcome'] for k, v in d['checks'].items()})"
    return "$rc"
}

case "${1:-}" in
    models) models ;;
    install) install ;;
    install-delta) install_delta ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 models|install|install-delta|run [seconds]"; exit 2 ;;
esac
