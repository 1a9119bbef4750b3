"""Generated tokens/s: bare vLLM ``AsyncLLM`` vs our Serve handle vs our HTTP API.

All three use the same engine arguments, the same Ray CPU reservation and the same
``SamplingParams``; they run one after another so they never share the two cores.
Each point is the median of ``ROUNDS`` measured rounds after a warm-up round.
"""

from __future__ import annotations

import asyncio
import platform as _stdlib_platform
import statistics
import time
from pathlib import Path
from typing import Any

import ray

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.config import PlatformConfig
from rollout.local import cpu_config, local_platform

CONCURRENCY = (64, 256)
MAX_TOKENS = 128
ROUNDS = 3


def _requests(n: int) -> list[RolloutRequest]:
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True, seed=None)
    return [RolloutRequest(prompt_token_ids=[10 + (i * 7 + j) % 1000 for j in range(16)], sampling=sampling) for i in range(n)]


@ray.remote
class BareEngine:
    """vLLM ``AsyncLLM`` in a plain Ray actor: the floor our service is measured against."""

    def __init__(self, config: dict[str, Any]):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.engine.args import engine_kwargs

        cfg = PlatformConfig.model_validate(config)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg.model, "cpu")))

    async def run(self, requests: list[RolloutRequest]) -> tuple[int, float]:
        from rollout.engine.convert import to_sampling_params

        async def one(i: int, r: RolloutRequest) -> int:
            params = to_sampling_params(r.sampling, r.n)
            final = None
            async for out in self.engine.generate({"prompt_token_ids": r.prompt_token_ids}, params, f"bare-{i}-{time.monotonic_ns()}"):
                final = out
            return sum(len(c.token_ids) for c in final.outputs)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        return sum(counts), time.perf_counter() - t0


def _measure(fn, n: int) -> dict[str, Any]:
    fn(_requests(n))  # warm-up
    rates = []
    for _ in range(ROUNDS):
        tokens, wall = fn(_requests(n))
        rates.append(tokens / wall)
    return {"concurrency": n, "tokens_per_s": statistics.median(rates), "rounds": rates, "tokens_per_round": tokens}


def _client_fn(client: RolloutClient):
    def fn(reqs):
        t0 = time.perf_counter()
        results = client.generate_sync(reqs)
        return sum(len(s.token_ids) for r in results for s in r.samples), time.perf_counter() - t0

    return fn


def run(model_dir: Path) -> dict[str, Any]:
    cfg = cpu_config(model_dir, http={"port": 8765})
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False)
    try:
        bare = BareEngine.options(num_cpus=cfg.deployment.num_cpus).remote(cfg.model_dump(mode="json"))
        bare_fn = lambda reqs: ray.get(bare.run.remote(reqs))  # noqa: E731
        bare_results = {n: _measure(bare_fn, n) for n in CONCURRENCY}
        ray.kill(bare)
        time.sleep(2)  # let the bare engine's processes exit before the service starts

        with local_platform(cfg):
            handle = RolloutClient.connect(app_name=cfg.app_name, batch_size=cfg.deployment.client_batch_size)
            http = RolloutClient.http(f"http://127.0.0.1:{cfg.http.port}")
            handle_results = {n: _measure(_client_fn(handle), n) for n in CONCURRENCY}
            http_results = {n: _measure(_client_fn(http), n) for n in CONCURRENCY}
            handle.close()
            http.close()
    finally:
        ray.shutdown()

    points = []
    for n in CONCURRENCY:
        floor = bare_results[n]["tokens_per_s"]
        points.append(
            {
                "concurrency": n,
                "bare_vllm_tokens_per_s": floor,
                "handle_tokens_per_s": handle_results[n]["tokens_per_s"],
                "http_tokens_per_s": http_results[n]["tokens_per_s"],
                "handle_vs_bare": handle_results[n]["tokens_per_s"] / floor,
                "http_vs_bare": http_results[n]["tokens_per_s"] / floor,
                "rounds": {"bare": bare_results[n]["rounds"], "handle": handle_results[n]["rounds"], "http": http_results[n]["rounds"]},
            }
        )
    return {
        "benchmark": "engine_throughput",
        "model": str(model_dir),
        "max_tokens": MAX_TOKENS,
        "client_batch_size": cfg.deployment.client_batch_size,
        "machine": {"cpus": __import__("os").cpu_count(), "python": _stdlib_platform.python_version()},
        "target": "handle_vs_bare >= 0.95 at concurrency 64",
        "target_met": points[0]["handle_vs_bare"] >= 0.95,
        "points": points,
    }
