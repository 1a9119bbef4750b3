"""Generated tokens/s: bare vLLM ``AsyncLLM`` vs our Serve handle vs our HTTP API.

All three use the same engine arguments, the same Ray CPU reservation and the same
``SamplingParams``. The bare engine and the platform are up together and take turns batch
by batch (bare, handle, HTTP; the order rotates at every batch), so drift of the machine
hits every path alike and no two paths ever share the cores. Every batch starts after a
quiet gap (``QUIET_S``): vLLM's queue readers busy-poll for a second after their last
message, and a batch started sooner would share the cores with the previous batch's engine
whenever that engine is another one (always for bare, never for HTTP after the handle,
which share one engine): a bias between the paths. After a warm-up batch of each path, ``ROUNDS``
rounds; every round is in the JSON. Every round generates the same number of tokens at
every concurrency: at 64 concurrent, a round is several batches of 64 requests per path.

The ratios are paired: each round of a path over the bare round of the same batches'
turns, then the median of those ratios, with a bootstrap 90% interval of that median. On
two cores the machine's speed drifts by half over tens of seconds; pairing neighbouring
batches takes out the drift both paths see, and the interval says how far a rerun may land.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import ray

from rollout.api import RolloutRequest, SamplingConfig
from rollout.bench.cpu import cpu_while
from rollout.bench.machine import machine
from rollout.client import RolloutClient
from rollout.config import PlatformConfig
from rollout.local import cpu_config, local_platform
from rollout.stats_summary import median_interval, paired_ratios

CONCURRENCY = (64, 256)
MAX_TOKENS = 128
ROUNDS = 21
ROUND_TOKENS = 32768  # generated tokens a round, every concurrency (see batches_per_round)
# vLLM's shared-memory queue readers busy-poll for a second after their last message
# (SpinCondition.busy_loop_s): a batch started sooner shares the cores with the engine that ran before it.
QUIET_S = 1.2


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


def batches_per_round(n: int) -> int:
    """Batches of ``n`` concurrent requests each path runs a round (taking turns with the
    other paths), so that every round generates about ``ROUND_TOKENS`` per path: a round of
    one small batch lasts about a second, and a burst of background work on two cores moves
    it far more than a longer one."""
    return max(1, round(ROUND_TOKENS / (n * MAX_TOKENS)))


def _interleaved(fns: dict[str, Callable], n: int, rounds: int) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """tokens/s of each path over ``rounds`` rounds, and each path's median CPU seconds per
    round by process role.

    The paths take turns batch by batch (the order rotated at every batch), so the batches a
    round compares ran within seconds of each other: on two cores the machine's speed drifts
    by half over tens of seconds, and only neighbours see the same machine. Every batch starts
    after ``QUIET_S`` idle, so none of them shares the cores with the previous batch's
    engine still busy-polling its queue."""
    names = list(fns)
    for name in names:
        fns[name](_requests(n))  # warm-up
    batches = batches_per_round(n)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    turn = 0
    for _ in range(rounds):
        tokens = dict.fromkeys(names, 0)
        wall = dict.fromkeys(names, 0.0)
        spent: dict[str, collections.Counter] = {name: collections.Counter() for name in names}
        for _ in range(batches):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                time.sleep(QUIET_S)
                (t, w), s = cpu_while(lambda: fns[name](_requests(n)))
                assert t == n * MAX_TOKENS, f"{name}: {t} tokens, expected {n * MAX_TOKENS}"
                tokens[name] += t
                wall[name] += w
                spent[name].update(s)
            turn += 1
        for name in names:
            rates[name].append(round(tokens[name] / wall[name], 1))
            cpu[name].append(dict(spent[name]))
    medians = {}
    for name, per_round in cpu.items():
        roles = {role for spent in per_round for role in spent}
        medians[name] = dict(sorted(((role, round(statistics.median(s.get(role, 0.0) for s in per_round), 3)) for role in roles), key=lambda kv: -kv[1]))
    return rates, medians


def _client_fn(client: RolloutClient):
    def fn(reqs):
        t0 = time.perf_counter()
        results = client.generate_sync(reqs)
        return sum(len(s.token_ids) for r in results for s in r.samples), time.perf_counter() - t0

    return fn


def run(model_dir: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    cfg = cpu_config(model_dir, http={"port": 8765})
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False)
    try:
        bare = BareEngine.options(num_cpus=cfg.deployment.num_cpus).remote(cfg.model_dump(mode="json"))
        ray.get(bare.__ray_ready__.remote())
        with local_platform(cfg):
            handle = RolloutClient.connect(app_name=cfg.app_name, batch_size=cfg.deployment.client_batch_size)
            http = RolloutClient.http(f"http://127.0.0.1:{cfg.http.port}")
            fns = {"bare": lambda reqs: ray.get(bare.run.remote(reqs)), "handle": _client_fn(handle), "http": _client_fn(http)}
            measured = {n: _interleaved(fns, n, rounds) for n in CONCURRENCY}
            handle.close()
            http.close()
        ray.kill(bare)
    finally:
        ray.shutdown()

    points = []
    for n, (rates, cpu) in measured.items():
        med = {name: statistics.median(r) for name, r in rates.items()}
        ratios = {name: paired_ratios(rates[name], rates["bare"]) for name in ("handle", "http")}
        points.append(
            {
                "concurrency": n,
                "bare_vllm_tokens_per_s": med["bare"],
                "handle_tokens_per_s": med["handle"],
                "http_tokens_per_s": med["http"],
                "handle_vs_bare": round(statistics.median(ratios["handle"]), 3),
                "http_vs_bare": round(statistics.median(ratios["http"]), 3),
                "vs_bare_interval_90": {name: [round(v, 3) for v in median_interval(r)] for name, r in ratios.items()},
                "paired_ratios": {name: [round(v, 3) for v in r] for name, r in ratios.items()},
                "spread": {name: [min(r), max(r)] for name, r in rates.items()},
                "rounds": rates,
                "cpu_s_per_round": cpu,
            }
        )
    return {
        "benchmark": "engine_throughput",
        "model": str(model_dir),
        "max_tokens": MAX_TOKENS,
        "rounds": rounds,
        "batches_per_round": {str(n): batches_per_round(n) for n in CONCURRENCY},
        "order": "interleaved: one batch of each path in turn, the order rotated at every batch, each batch after a quiet gap",
        "quiet_s": QUIET_S,
        "client_batch_size": cfg.deployment.client_batch_size,
        "machine": machine(),
        "ratios": "paired: the median of each round's path / bare round of the same batches' turns; vs_bare_interval_90 is a bootstrap interval of that median",
        "target": "handle_vs_bare and http_vs_bare >= 0.95 at every concurrency",
        "target_met": all(p["handle_vs_bare"] >= 0.95 and p["http_vs_bare"] >= 0.95 for p in points),
        "points": points,
    }
