"""The same 200 requests (lengths drawn from 8 to 128 tokens) through one big ``generate``
and through ``client.stream(requests, max_in_flight=64)``, on one replica.

One call returns when its longest request is done; the stream hands each result over as
soon as it is back. Per path: the time to the first result, to all of them, and tokens/s.
The two paths take turns round by round (the order rotates); every round is in the JSON.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import ray

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.local import cpu_config, local_platform

REQUESTS = 200
MAX_IN_FLIGHT = 64
ROUNDS = 5


def _requests(seed: int) -> list[RolloutRequest]:
    rng = random.Random(seed)
    return [
        RolloutRequest(prompt_token_ids=[10 + (i * 7 + j) % 1000 for j in range(16)], sampling=SamplingConfig(max_tokens=rng.randint(8, 128), ignore_eos=True))
        for i in range(REQUESTS)
    ]


async def _one_generate(client: RolloutClient, reqs: list[RolloutRequest]) -> dict[str, float]:
    t0 = time.perf_counter()
    results = await client.generate(reqs)
    wall = time.perf_counter() - t0
    return {"first_result_s": wall, "all_results_s": wall, "tokens": sum(len(s.token_ids) for r in results for s in r.samples)}


async def _stream(client: RolloutClient, reqs: list[RolloutRequest]) -> dict[str, float]:
    t0 = time.perf_counter()
    first, tokens, n = None, 0, 0
    async for r in client.stream(reqs, max_in_flight=MAX_IN_FLIGHT):
        first = first if first is not None else time.perf_counter() - t0
        tokens += sum(len(s.token_ids) for s in r.samples)
        n += 1
    assert n == len(reqs), f"stream returned {n} of {len(reqs)} results"
    return {"first_result_s": first, "all_results_s": time.perf_counter() - t0, "tokens": tokens}


async def _rounds(client: RolloutClient, rounds: int) -> dict[str, list[dict[str, float]]]:
    paths = {"one_generate": _one_generate, "stream": _stream}
    by_path: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    names = list(paths)
    await client.generate(_requests(seed=0)[:16])  # warm-up
    for k in range(rounds):
        reqs = _requests(seed=k + 1)  # the same requests for both paths of a round
        for name in names[k % len(names):] + names[: k % len(names)]:
            m = await paths[name](client, reqs)
            m["tokens_per_s"] = m["tokens"] / m["all_results_s"]
            by_path[name].append({key: round(v, 3) for key, v in m.items()})
    return by_path


def run(model_dir: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    cfg = cpu_config(model_dir, app_name="rollout-bench-stream", http={"port": 8766})
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False)
    try:
        with local_platform(cfg):
            client = RolloutClient.connect(app_name=cfg.app_name, batch_size=cfg.deployment.client_batch_size)
            rounds_by_path = asyncio.run(_rounds(client, rounds))
            client.close()
    finally:
        ray.shutdown()
    summary = {
        name: {key: {"median": round(statistics.median(r[key] for r in rs), 3), "range": [min(r[key] for r in rs), max(r[key] for r in rs)]} for key in ("first_result_s", "all_results_s", "tokens_per_s")}
        for name, rs in rounds_by_path.items()
    }
    return {
        "benchmark": "rollout_stream",
        "requests": REQUESTS,
        "max_tokens": "8-128, drawn per request (seeded; the same requests for both paths of a round)",
        "max_in_flight": MAX_IN_FLIGHT,
        "rounds": rounds,
        "order": "interleaved: one round of each path in turn, the order rotated every round",
        "summary": summary,
        "rounds_by_path": rounds_by_path,
    }
