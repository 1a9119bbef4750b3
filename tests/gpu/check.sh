#!/usr/bin/env bash
# There (a lent GPU machine, from the repository root): the GPU check, in steps.
#
#   bash tests/gpu/check.sh models    build the test models with the machine's own Python (torch +
#                                     transformers are there already): start it first, in the background
#   bash tests/gpu/check.sh install   verify and unpack the transferred parts, install the overlay
#                                     (vllm 0.32.0, torch 2.13.0+cu130, ray 2.60.0) and the project
#   bash tests/gpu/check.sh run [S] [PYTEST ARGS...]
#                                     run the GPU tests (tests/gpu/test_gpu_*.py: the senders', the
#                                     platform's, then any other file), at most S seconds (default
#                                     1500); results.json and check.log go to $OUT (or
#                                     $ROLLOUT_GPU_WORK/out), rewritten after every test. Any subset
#                                     runs on its own, e.g. `run 600 -k ipc` (the checks left out are
#                                     recorded as not run, and why); `run 900 -k fleet` on four GPUs
#                                     publishes into 1, 2 and 3 replicas (it skips with fewer)
#
# Where things are (override with the variables):
#   ROLLOUT_GPU_PARTS  the transferred part-NNN files and SHA256SUMS   (default /tmp/acc)
#   ROLLOUT_GPU_SITE   the overlay installed with pip --target          (default /tmp/site)
#   ROLLOUT_GPU_WORK   models, checkpoints, the project's install, logs (default /tmp/gpu-work)
#   ROLLOUT_GPU_MARGIN seconds before the end of S after which no check starts (default 360: the
#                      longest check, TP=2, takes about five minutes; the fleet check, on four GPUs,
#                      about five after other checks and up to ten alone, where it starts the bare
#                      engine and compiles first)
set -uo pipefail
cd "$(dirname "$0")/../.."
PARTS=${ROLLOUT_GPU_PARTS:-/tmp/acc}
SITE=${ROLLOUT_GPU_SITE:-/tmp/site}
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
    rm -rf "$WORK/wheels"
    cat "$PARTS"/part-* | tar -x -C "$WORK" || { echo "install: unpacking the parts failed"; return 1; }
    echo "install: $(ls "$WORK/wheels" | wc -l) wheels verified and unpacked in $((SECONDS - t0)) s"
    # ONE pip call for all wheels: a later `pip --target --upgrade` replaces whole top-level folders (nvidia/).
    env -u PYTHONPATH "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WORK"/wheels/*.whl \
        || { echo "install: pip failed"; return 1; }
    # torch 2.13 finds its CUDA libraries through RPATH $ORIGIN/../../nvidia/{cu13,...}/lib inside $SITE only; the
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
    local files=(tests/gpu/test_gpu_senders.py tests/gpu/test_gpu_platform.py) f
    for f in tests/gpu/test_gpu_*.py; do
        case " ${files[*]} tests/gpu/test_gpu_moe.py " in *" $f "*) ;; *) files+=("$f") ;; esac
    done
    files+=(tests/gpu/test_gpu_moe.py)
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
    run) shift; run "$@" ;;
    *) echo "usage: $0 models|install|run [seconds]"; exit 2 ;;
esac
