"""``make demo``: the platform on the built model, a few hundred rollouts, a summary."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from tqdm import tqdm

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import RolloutClient
from rollout.local import cpu_config, local_platform
from rollout.modelbuild import build_model, is_built
from rollout.stats_summary import percentiles


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the policy reward model answer question value action state group replica weight update".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(n)]


async def _run(client: RolloutClient, prompts: list[str], concurrency: int) -> tuple[list[float], int, float]:
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0
    bar = tqdm(total=len(prompts), desc="rollouts", unit="req")

    async def one(p: str) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            (res,) = await client.generate([RolloutRequest(prompt=p, sampling=SamplingConfig(max_tokens=64, temperature=1.0))])
            latencies.append(time.perf_counter() - t0)
            tokens += sum(len(s.token_ids) for s in res.samples)
            bar.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    bar.close()
    return latencies, tokens, time.perf_counter() - t0


def run_demo(model_dir: Path, requests: int = 300, concurrency: int = 64) -> int:
    if not is_built(model_dir):
        print(f"building the demo model in {model_dir} ...")
        build_model(model_dir)
    cfg = cpu_config(model_dir)
    print("starting Ray and the platform (about a minute on 2 cores) ...")
    with local_platform(cfg):
        client = RolloutClient.connect(app_name=cfg.app_name)
        prompts = _prompts(requests)
        client.generate_sync([RolloutRequest(prompt=p, sampling=SamplingConfig(max_tokens=8)) for p in prompts[:16]])  # warm-up
        latencies, tokens, wall = asyncio.run(_run(client, prompts, concurrency))
        p = percentiles(latencies)
        print()
        print("summary")
        print(f"  requests        {len(latencies)} ({concurrency} concurrent)")
        print(f"  generated       {tokens} tokens in {wall:.1f} s = {tokens / wall:,.0f} tokens/s")
        print(f"  latency         p50 {p['p50']*1000:.0f} ms   p90 {p['p90']*1000:.0f} ms   p99 {p['p99']*1000:.0f} ms")
    return 0
