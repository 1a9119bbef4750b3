"""Autoscaling reaction time and affinity routing, measured on this machine.

* ``scale_out``: a load step against one replica (min 1, max 2); time until the autoscaler
  decides (a second replica is STARTING), until it is RUNNING and registered for weight
  sync, and how much of that is the replica's own start (engine load + catch-up).
* ``routing``: the same grouped workload (long shared prompts, each group's samples sent
  as separate calls) over 2 replicas with Serve's default router and with ours: vLLM's
  prefix-cache hit rate from the replicas' own counters, and generated tokens/s.
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


async def _settled(app: str) -> tuple[float, float]:
    # Ray's agent reports every second: wait until two reads agree.
    last = None
    while True:
        now = await asyncio.to_thread(prefix_cache_counters, f"http://127.0.0.1:{METRICS_PORT}/metrics", app)
        if now == last:
            return now
        last = now
        await asyncio.sleep(2)


async def _routing(model_dir: Path) -> dict[str, Any]:
    out = {}
    prompts = [[100 + g] + [(g * 31 + i) % 1000 + 3 for i in range(200)] for g in range(16)]
    for policy in ("default", "affinity"):
        cfg = cpu_config(model_dir, app_name=f"bench-{policy}", http={"port": 8768}, metrics={"port": METRICS_PORT}, deployment={"replicas": 2, "routing": {"policy": policy}})
        await asyncio.to_thread(deploy, cfg)
        client = RolloutClient.connect(app_name=cfg.app_name)
        await client.generate([RolloutRequest(prompt="warm-up", sampling=SamplingConfig(max_tokens=4))] * 4)
        h0, q0 = await _settled(cfg.app_name)
        t0 = time.perf_counter()
        tokens = 0
        for _ in range(4):
            results = await asyncio.gather(
                *(client.generate([RolloutRequest(prompt_token_ids=p, n=4, sampling=SamplingConfig(max_tokens=32, ignore_eos=True))]) for p in prompts)
            )
            tokens += sum(len(s.token_ids) for (r,) in results for s in r.samples)
        wall = time.perf_counter() - t0
        h1, q1 = await _settled(cfg.app_name)
        out[policy] = {"prefix_cache_hit_rate": (h1 - h0) / (q1 - q0), "tokens_per_s": tokens / wall}
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
