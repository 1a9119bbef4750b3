"""Cold start on one GPU (issue 41): `rollout serve` against bare `vllm serve`, cold against
cold and warm against warm, with the same engine arguments and the same caches.

Issue 41 measured, on one H200 with the 1.5B model: bare `vllm serve` cold 299.8 s (~146 s
of it FlashInfer building its sampling kernels), then `rollout serve` 168.8 s (it compiled
again, under another compile-cache key), then bare again, warm, 96.6 s. The platform now
builds its engine as `vllm serve` does (usage context, so the same scheduler defaults and
compile key: tests/test_engine_build.py proves it on CPU), sets nothing that enters the key
(no VLLM_ALLOW_INSECURE_SERIALIZATION) and starts Ray's workers at nice 0. Here, on a GPU:

1. bare `vllm serve`, cold: empty caches (a fresh VLLM_CACHE_ROOT, FlashInfer, Triton,
   Inductor, CUDA caches: rollout's chart keeps these on the compileCache volume);
2. `rollout serve`, warm, on the caches (1) left: it must compile nothing new (no new
   directory in vLLM's torch_compile_cache: the same key) and start within
   WARM_GOAL x of (3);
3. bare `vllm serve`, warm, on the same caches (the reference for 2);
4. `rollout serve`, cold, on fresh empty caches: within COLD_GOAL x of (1).

Each start is timed from the command to its first answered request (a completion of one
token through the OpenAI route, the same request for both). The platform's replica also
logs its start phase by phase (rollout.engine.startup); the check records them. Every
command runs with its own local Ray cluster (`rollout serve`'s own), so run this check
alone: `check.sh run 1500 -k coldstart` (about 15 minutes on an H200: two cold starts of
~5 min, two warm of ~1.5 min, and the stops).
"""

from __future__ import annotations

from pathlib import Path

from tests.gpu.machine import MODEL, WORK, needs_gpus
from tests.gpu.servers import VLLM_SERVE, Command, cache_env, compile_dirs, phases, rollout_serve_argv, wait_for_idle_gpu, write_platform_config

pytestmark = needs_gpus(1)
API_KEY = "gpu-coldstart-key"
PORT = 18131
WARM_GOAL = 1.15  # the platform warm within 15% of bare vllm serve warm (Ray and Serve's own start)
COLD_GOAL = 1.15
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 256
GPU_MEMORY_UTILIZATION = 0.85
SERVED_NAME = "model-1.5b"


def bare(env: dict[str, str], log: Path) -> Command:
    argv = [
        *VLLM_SERVE, str(MODEL), "--served-model-name", "model-1.5b", "--dtype", "bfloat16",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
        "--seed", "0", "--port", str(PORT), "--host", "127.0.0.1", "--api-key", API_KEY,
    ]  # fmt: skip
    return Command(argv, env, log, PORT, API_KEY, SERVED_NAME)


def platform(env: dict[str, str], log: Path, sync_backend: str = "ipc") -> Command:
    key_file = WORK / "coldstart-api-key"
    key_file.write_text(API_KEY + "\n")
    config = {
        "model": {
            "path": str(MODEL), "served_name": "model-1.5b", "dtype": "bfloat16", "device": "cuda", "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "seed": 0,
        },
        "http": {"port": PORT, "host": "127.0.0.1", "api_key_file": str(key_file)},
        # ipc: the backend that set VLLM_ALLOW_INSECURE_SERIALIZATION before (issue 41).
        "sync": {"backend": sync_backend},
        "tools": {"python": {"enabled": False}},  # the lent image has no bubblewrap
    }  # fmt: skip
    path = write_platform_config(config, WORK / f"{log.stem}.yaml")
    return Command(rollout_serve_argv(path), {**env, "ROLLOUT_SYNC_TOKEN": "gpu-coldstart-sync"}, log, PORT, API_KEY, SERVED_NAME)


def timed(cmd: Command) -> float:
    try:
        return round(cmd.first_completion_s(), 1)
    finally:
        cmd.stop()


def test_coldstart_rollout_serve_against_vllm_serve_cold_and_warm(record, tmp_path_factory):
    """(1) bare cold, (2) platform warm on (1)'s caches, (3) bare warm, (4) platform cold."""
    wait_for_idle_gpu()  # an engine of an earlier check would take the memory these need
    shared = tmp_path_factory.mktemp("coldstart-shared")
    logs = WORK / "coldstart"
    logs.mkdir(parents=True, exist_ok=True)

    bare_cold_s = timed(bare(cache_env(shared), logs / "1-bare-cold.log"))
    record(bare_cold_s=bare_cold_s)
    keys_after_bare = compile_dirs(shared)
    assert keys_after_bare, "bare vllm serve compiled nothing into its VLLM_CACHE_ROOT: the check cannot compare compile keys"

    warm = platform(cache_env(shared), logs / "2-platform-warm.log")
    platform_warm_s = timed(warm)
    new_keys = sorted(compile_dirs(shared) - keys_after_bare)
    record(platform_warm_s=platform_warm_s, platform_warm_phases=phases(warm.lines), platform_new_compile_keys=new_keys)

    bare_warm_s = timed(bare(cache_env(shared), logs / "3-bare-warm.log"))
    warm_ratio = round(platform_warm_s / bare_warm_s, 2)
    record(bare_warm_s=bare_warm_s, warm_ratio=warm_ratio, warm_goal=WARM_GOAL)

    cold = platform(cache_env(tmp_path_factory.mktemp("coldstart-fresh")), logs / "4-platform-cold.log")
    platform_cold_s = timed(cold)
    cold_ratio = round(platform_cold_s / bare_cold_s, 2)
    record(platform_cold_s=platform_cold_s, platform_cold_phases=phases(cold.lines), cold_ratio=cold_ratio, cold_goal=COLD_GOAL)

    assert not new_keys, f"the platform compiled under another key than bare vllm serve with the same arguments: new {new_keys} beside {sorted(keys_after_bare)}"
    assert warm_ratio <= WARM_GOAL, f"warm: platform {platform_warm_s} s against bare {bare_warm_s} s (goal <= {WARM_GOAL}x); phases {phases(warm.lines)}"
    assert cold_ratio <= COLD_GOAL, f"cold: platform {platform_cold_s} s against bare {bare_cold_s} s (goal <= {COLD_GOAL}x); phases {phases(cold.lines)}"
