"""Per-request HTTP throughput on one GPU (issue 41): `rollout serve` against bare `vllm
serve`, both up at once on the same GPU, rounds interleaved.

Issue 41 measured, on one H200 with the 1.5B model and 256 in flight, one request per HTTP
call: the platform's /v1/completions at 0.79x of bare `vllm serve`, /v1/rollouts at 0.72x
(logprobs off) and 0.55x (on, against bare without). Its acceptance: at least 0.95x on both
routes, with logprobs and without, at 256 and 512 in flight, the intervals of interleaved
rounds in the results.

Here (tests/gpu/per_request.py is the harness, the CPU benchmark's client under it):

- both servers on GPU 0 with the same engine arguments (bare's are built from the
  platform config's model by ``serve_argv``, as the CPU benchmark does), each
  ``GPU_MEMORY_UTILIZATION`` of the GPU; bare starts first (on a fresh machine it compiles;
  the platform then starts on the compile cache it wrote: same key, recorded), one after
  the other because vLLM sizes the KV cache by measuring the GPU's free memory while it
  profiles, which the other engine's start would disturb. The KV cache each logged is recorded;
- the platform: `rollout serve` with the README's config (the model; the python tool off, as
  the lent image has no bubblewrap) and the front door the CPU benchmark found fastest
  (docs/bench/per_request*.json: recorded with the scores it was chosen by);
- greedy equality of a few prompts across bare /v1/completions, the platform's
  /v1/completions and /v1/rollouts (temperature 0);
- issue 41's workload: 512 random 128-token prompts, 256 output tokens (``ignore_eos``), one
  request per call, at 256 and 512 in flight, the platform's /v1/completions and
  /v1/rollouts each with and without sampled-token logprobs, bare /v1/completions with and
  without; every path a batch in turn, ``FULL.min_rounds`` rounds at least, more while the
  check's budget (``FULL.budget_s`` from its start, both servers' starts included) allows,
  none that would run into check.sh's end. Output tok/s per round, the median with a
  bootstrap 90% interval of the paired ratios platform / bare.

Everything is recorded before the acceptance is asserted. Run alone:
``bash tests/gpu/check.sh run 900 -k per_request``: on an H200 from a fresh machine about
9-12 minutes (bare's cold start with its compile 2.5-5 min, the platform's warm start
1.5-3 min, greedy and warm-up ~20 s, two rounds of ~1.5-2 min, the stops); on warm caches
(after another check of the same run) ~7-8 minutes. ``run 600`` on a fresh machine leaves
no room for a round after the starts: the check then fails saying so, with the starts' times.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from tests.gpu import per_request
from tests.gpu.machine import MODEL, ROOT, WORK, needs_gpus
from tests.gpu.servers import Command, compile_keys, kv_cache_tokens, phases, rollout_serve_argv, vllm_cache_root, wait_for_idle_gpu, write_platform_config

pytestmark = needs_gpus(1)
API_KEY = "gpu-per-request-key"
BARE_PORT, PLATFORM_PORT = 18141, 18142
SERVED_NAME = "model-1.5b"
# Two engines on one GPU, each this share: the same KV budget for both (the 1.5B model's
# KV at 512 x 384 tokens needs ~6 GB; each gets ~50 GB on an H200), and the second to start
# still finds its share free (vLLM refuses to start otherwise).
GPU_MEMORY_UTILIZATION = 0.42
MAX_MODEL_LEN = 2048
STOP_SLACK_S = 60.0  # both servers' stop (SIGTERM, Ray's shutdown) and the GPU idle again


def workload() -> per_request.Workload:
    """Issue 41's workload; ``ROLLOUT_GPU_PER_REQUEST_BUDGET_S`` replaces its time budget."""
    budget = os.environ.get("ROLLOUT_GPU_PER_REQUEST_BUDGET_S")
    return dataclasses.replace(per_request.FULL, budget_s=float(budget)) if budget else per_request.FULL


def test_per_request_http_throughput_against_vllm_serve_on_one_gpu(record):
    started = time.monotonic()
    end = float(os.environ["ROLLOUT_GPU_END"]) if os.environ.get("ROLLOUT_GPU_END") else None
    wait_for_idle_gpu()  # an engine of an earlier check would take the memory these need
    logs = WORK / "per-request"
    logs.mkdir(parents=True, exist_ok=True)
    key_file = logs / "api-key"
    key_file.write_text(API_KEY + "\n")

    front_door, scores = per_request.fastest_front_door(ROOT / "docs" / "bench")
    model = {
        "path": str(MODEL), "served_name": SERVED_NAME, "dtype": "bfloat16", "device": "cuda", "max_model_len": MAX_MODEL_LEN,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "seed": 0,
    }  # fmt: skip
    config = per_request.platform_config(model, PLATFORM_PORT, key_file, front_door)
    argv, env = per_request.bare_argv(config, "cuda", BARE_PORT, API_KEY)
    cache = vllm_cache_root()
    keys_before = compile_keys(cache)
    record(front_door=front_door, front_door_scores=scores, bare_argv=argv[argv.index("serve") + 1 :], gpu_memory_utilization=GPU_MEMORY_UTILIZATION)

    bare = platform = None
    try:
        bare = Command(argv, env, logs / "bare.log", BARE_PORT, API_KEY, SERVED_NAME)
        bare_start_s = round(bare.first_completion_s(), 1)
        keys_after_bare = compile_keys(cache)
        platform = Command(
            rollout_serve_argv(write_platform_config(config, logs / "platform.yaml")), {"ROLLOUT_SYNC_TOKEN": "gpu-per-request-sync"},
            logs / "platform.log", PLATFORM_PORT, API_KEY, SERVED_NAME,
        )  # fmt: skip
        platform_start_s = round(platform.first_completion_s(), 1)
        new_keys = sorted(compile_keys(cache) - keys_after_bare)
        record(
            bare_start_s=bare_start_s, platform_start_s=platform_start_s, platform_phases=phases(platform.lines),
            bare_compiled=bool(keys_after_bare - keys_before), platform_new_compile_keys=new_keys,
            kv_cache_tokens={"bare": kv_cache_tokens(bare.lines), "platform": kv_cache_tokens(platform.lines)},
        )  # fmt: skip

        result = per_request.run(bare.url, platform.url, SERVED_NAME, API_KEY, workload(), started, end, STOP_SLACK_S)
        record(**result, seconds_to_last_round=round(time.monotonic() - started, 1))
    finally:
        for cmd in (platform, bare):
            if cmd is not None:
                cmd.gpu = cmd is bare  # idle only once both are gone
                cmd.stop()

    table = result["table"]
    if not result["rounds_run"]:
        pytest.fail(
            f"no round fitted before the run's end ({result['rounds_stopped']}); the starts took {bare_start_s} s (bare) and "
            f"{platform_start_s} s (platform): give the run more time (check.sh run 900 -k per_request)"
        )
    print("per-request:", per_request.summary_line(table), flush=True)
    assert result["greedy"] == {"/v1/rollouts": "equal", "/v1/completions": "equal"}, f"greedy (temperature 0) differs from bare vllm serve: {result['greedy']}"
    assert len(table) == 4 * len(per_request.FULL.concurrencies), f"rows missing from the table (rounds run {result['rounds_run']}: {result['rounds_stopped']}): {table}"
    missed = per_request.misses(table)
    assert not missed, (
        f"per-request throughput under {per_request.GOAL}x of bare vllm serve ({result['rounds_run']} interleaved rounds, "
        f"front door {front_door}):\n" + "\n".join(missed) + f"\nall: {per_request.summary_line(table)}"
    )
