"""Autoscaling reaction time and affinity routing, measured on this machine.

* ``scale_out``: a load step against one replica (min 1, max 2); time until the autoscaler
  decides (a second replica is STARTING), until it is RUNNING and registered for weight
  sync, and how much of that is the replica's own start (engine load + catch-up).
* ``routing``: the same grouped workload (long shared prompts, each group's samples sent
  as separate calls) over 2 replicas with Serve's default router and with ours: vLLM's
  prefix-cache hit rate of the follow-up calls from the replicas' own counters, and
  generated tokens/s (the wall time excludes the counter reads).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rollout.api import RolloutRequest, SamplingConfig
from rollout.app import deploy
from rollout.client import RolloutClient
from rollout.local import cpu_config
from rollout.status import prefix_cache_counters
from rollout.sync import WeightPublisher

ENGINE = "RolloutEngine"
METRICS_PORT = 8767


def _states(app: str) -> dict[str, int]:
    status = serve.status().applications.get(app)
    if status is None or ENGINE not in status.deployments:
        return {}
    return dict(status.deployments[ENGINE].replica_states)


async def _scale_out(model_dir: Path) -> dict[str, Any]:
    cfg = cpu_config(
        model_dir,
        app_name="bench-elastic",
        http={"port": 8768},
        metrics={"port": METRICS_PORT},
        deployment={"autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8, "look_back_period_s": 2, "upscale_delay_s": 2, "downscale_delay_s": 30}},
    )
    await asyncio.to_thread(deploy, cfg)
    client = RolloutClient.connect(app_name=cfg.app_name, batch_size=8)
    publisher = WeightPublisher.connect(app_name=cfg.app_name)
    stop = asyncio.Event()

    async def burst():
        sampling = SamplingConfig(max_tokens=200, ignore_eos=True)
        while not stop.is_set():
            await client.generate([RolloutRequest(prompt_token_ids=[5, 6, 7, 8], sampling=sampling) for _ in range(48)])

    t0 = time.monotonic()
    task = asyncio.create_task(burst())
    decided = running = None
    while running is None and time.monotonic() - t0 < 600:
        states = _states(cfg.app_name)
        now = time.monotonic()
        if decided is None and sum(states.values()) >= 2:
            decided = now
        if states.get("RUNNING", 0) >= 2 and len((await asyncio.to_thread(publisher.status))["replicas"]) >= 2:
            running = now
        await asyncio.sleep(0.25)
    stop.set()
    await task
    serve.delete(cfg.app_name)
    if running is None:
        raise RuntimeError("the second replica never came up within 600 s")
    return {
        "load_step_to_decision_s": decided - t0,
        "decision_to_serving_s": running - decided,
        "load_step_to_second_replica_serving_s": running - t0,
        "note": "decision_to_serving_s is the new replica's start: vLLM engine load plus catch-up to the committed weights",
    }


async def settled_prefix_counters(metrics_url: str, app: str, attempts: int = 60) -> tuple[float, float]:
    """(hits, queries) of ``app``'s prefix caches once two reads 2 s apart agree (Ray's
    agent exports every second)."""
    last = None
    for _ in range(attempts):
        now = await asyncio.to_thread(prefix_cache_counters, metrics_url, app)
        if now == last:
            return now
        last = now
        await asyncio.sleep(2)
    raise RuntimeError(f"prefix-cache counters of {app} did not settle")


# vLLM's CPU backend caches KV in blocks of 128 tokens (GPU: 16), only whole blocks are
# reused, and a prompt's last token is always recomputed: a prompt of k * 128 + 1 tokens
# can hit on every token but one. A 201-token prompt could never exceed 128/201 = 0.637.
CPU_KV_BLOCK_TOKENS = 128


def group_prompts(groups: int, seed: int = 0, blocks: int = 2, block_tokens: int = CPU_KV_BLOCK_TOKENS) -> list[list[int]]:
    """Long prompts, one per GRPO group, of ``blocks`` whole KV blocks plus one token;
    ``seed`` gives prompts no earlier run cached."""
    length = blocks * block_tokens
    return [[100 + g + 50 * seed] + [(g * 31 + i + 7 * seed) % 1000 + 3 for i in range(length)] for g in range(groups)]


def best_hit_rate(prompt_tokens: int, block_tokens: int = CPU_KV_BLOCK_TOKENS) -> float:
    """The highest prefix-cache hit rate a prompt of this length can reach."""
    return (prompt_tokens - 1) // block_tokens * block_tokens / prompt_tokens


async def grouped_workload(client: RolloutClient, app: str, metrics_url: str, prompts: list[list[int]], calls: int, n: int, max_tokens: int) -> dict[str, float]:
    """Each group's samples arrive as ``calls`` separate calls of ``n`` samples (all groups
    concurrently per call), as when rollout workers each ask for one sample of a group.
    The hit rate counts the follow-up calls: a group's first call misses on any router.
    Keep ``n`` at 1 to measure routing: the samples of one call share a replica on any
    router, and later siblings hit the blocks their first sibling just computed."""
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)

    async def one_call_per_group() -> int:
        results = await asyncio.gather(*(client.generate([RolloutRequest(prompt_token_ids=p, n=n, sampling=sampling)]) for p in prompts))
        return sum(len(s.token_ids) for (r,) in results for s in r.samples)

    t0 = time.perf_counter()
    tokens = await one_call_per_group()
    wall = time.perf_counter() - t0
    h0, q0 = await settled_prefix_counters(metrics_url, app)
    t1 = time.perf_counter()
    for _ in range(calls - 1):
        tokens += await one_call_per_group()
    wall += time.perf_counter() - t1
    h1, q1 = await settled_prefix_counters(metrics_url, app)
    return {"follow_up_prefix_cache_hit_rate": (h1 - h0) / (q1 - q0), "tokens_per_s": tokens / wall}


async def _routing(model_dir: Path) -> dict[str, Any]:
    out = {}
    metrics_url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    for seed, policy in enumerate(("default", "affinity")):
        cfg = cpu_config(model_dir, app_name=f"bench-{policy}", http={"port": 8768}, metrics={"port": METRICS_PORT}, deployment={"replicas": 2, "routing": {"policy": policy}})
        await asyncio.to_thread(deploy, cfg)
        client = RolloutClient.connect(app_name=cfg.app_name)
        await client.generate([RolloutRequest(prompt="warm-up", sampling=SamplingConfig(max_tokens=4))] * 4)
        prompts = group_prompts(16, seed)
        out[policy] = await grouped_workload(client, cfg.app_name, metrics_url, prompts, calls=8, n=1, max_tokens=32)
        out[policy]["best_possible_hit_rate"] = best_hit_rate(len(prompts[0]))
        serve.delete(cfg.app_name)
    return out


def run(model_dir: Path) -> dict[str, Any]:
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "bench")
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False, _metrics_export_port=METRICS_PORT, _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8768})
        scale_out = asyncio.run(_scale_out(model_dir))
        routing = asyncio.run(_routing(model_dir))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"benchmark": "scaling", "model": str(model_dir), "scale_out": scale_out, "routing": routing}
