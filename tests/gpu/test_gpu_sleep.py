"""Issue 42's sleep and wake on a real GPU, one GPU enough: a replica started with vLLM's
sleep mode (``model.enable_sleep_mode``), a non-base version published into it (so that
restoring the model it started from would be wrong), then for level 1 and level 2 in turn:
``RolloutClient.sleep``, the GPU memory the replica gave back (``torch.cuda.mem_get_info``
from this process), rollouts refused retryably and a publish refused naming the sleep while
asleep, ``wake_up`` (level 2: the weights first, which reloads the committed checkpoint,
then the KV cache), and greedy output after the wake equal to the output before the sleep.

Run by ``tests/gpu/check.sh`` like the other GPU checks (``run 600 -k sleep``); skipped
without a GPU. Its engine is eager (compilation is not the point) and publishes over gloo
from the host, so one GPU serves it; about three minutes, most of it the replica's start.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu.machine import needs_gpus
from tests.gpu.test_gpu_platform import PROMPTS, _clean_stage_after_a_failure, cluster, first_mismatch, greedy, load_weights, on_platform, perturbed, platform_cfg, requests, stage  # noqa: F401 - fixtures

pytestmark = needs_gpus(1)
APP = "gpu-sleep"
GPU_MEMORY_UTILIZATION = 0.35  # tests.gpu.test_gpu_platform.model_cfg's: the engine's budget
# Each level must give back at least this share of the engine's budget (weights + KV cache
# are nearly all of it; what stays is the CUDA context and allocations outside vLLM's pool).
FREED_SHARE = 0.6


def used_bytes(gpu: int) -> int:
    """Memory in use on ``gpu``, once two reads half a second apart agree (the driver's view
    lags a release by a moment), at most 15 s."""
    last, deadline = None, time.monotonic() + 15
    while True:
        free, total = torch.cuda.mem_get_info(gpu)
        used = total - free
        if used == last or time.monotonic() > deadline:
            return used
        last = used
        time.sleep(0.5)


def test_sleep_levels_free_the_replicas_gpu_memory_and_wake_to_the_same_greedy_output(stage, perturbed, record):
    from rollout.errors import EngineUnavailableError
    from rollout.sync import FleetAsleepError, WeightPublisher

    app = stage.app_for(platform_cfg(APP, "gloo", enable_sleep_mode=True, enforce_eager=True, gpu_memory_utilization=GPU_MEMORY_UTILIZATION))
    client, gpu = app.handle, app.replica_gpu
    base = greedy(on_platform(client))
    tensors = load_weights(perturbed, "cpu")
    pub = WeightPublisher.connect(app_name=APP, backend="gloo")
    try:
        # A non-base version with its checkpoint: what a level-2 wake must reload.
        version = pub.publish(tensors, checkpoint=str(perturbed))
        app.published, app.committed = True, version
        before = greedy(on_platform(client))
        assert before != base, "the published version must serve other tokens than the model it started from, or a wrong restore would pass"
        budget = GPU_MEMORY_UTILIZATION * torch.cuda.mem_get_info(gpu)[1]
        numbers: dict = {"version": version, "engine_budget_bytes": int(budget)}
        for level in (1, 2):
            awake = used_bytes(gpu)
            t0 = time.perf_counter()
            client.sleep_sync(level=level)
            sleep_s = time.perf_counter() - t0
            asleep = used_bytes(gpu)
            assert client.is_sleeping_sync() is True
            freed = awake - asleep
            assert freed >= FREED_SHARE * budget, f"level {level} freed {freed / 2**30:.2f} GiB of the engine's {budget / 2**30:.2f} GiB budget (expected at least {FREED_SHARE:.0%})"
            with pytest.raises(EngineUnavailableError, match="asleep"):
                client.generate_sync(requests([PROMPTS[0]]))
            with pytest.raises(FleetAsleepError, match=f"asleep at level {level}"):
                pub.publish(tensors)
            phases = {}
            if level == 2:
                # The weights first (the committed checkpoint reloads), then the KV cache.
                t0 = time.perf_counter()
                assert client.wake_up_sync(tags=["weights"]) is False
                phases["wake_weights_s"] = round(time.perf_counter() - t0, 3)
                assert client.is_sleeping_sync() is True
            t0 = time.perf_counter()
            assert client.wake_up_sync() is True
            phases["wake_s" if level == 1 else "wake_kv_cache_s"] = round(time.perf_counter() - t0, 3)
            woken = used_bytes(gpu)
            after = greedy(on_platform(client))
            assert after == before, f"level {level}: greedy output after the wake differs from before the sleep: {first_mismatch(after, before)}"
            numbers[f"level{level}"] = {
                "sleep_s": round(sleep_s, 3),
                **phases,
                "freed_gib": round(freed / 2**30, 2),
                "freed_share_of_budget": round(freed / budget, 3),
                "used_awake_gib": round(awake / 2**30, 2),
                "used_asleep_gib": round(asleep / 2**30, 2),
                "used_woken_gib": round(woken / 2**30, 2),
                "greedy": "equal",
            }
            record(**numbers)
    finally:
        pub.close()
        del tensors
