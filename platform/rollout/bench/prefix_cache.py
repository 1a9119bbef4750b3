"""Prefix-cache hits around a weight update: ``sync.prefix_cache`` ``salt`` against ``flush``.

Both keep KV computed under older weights from serving requests started after a commit;
``flush`` by clearing vLLM's prefix cache at every update, ``salt`` by giving every request
a salt naming the version it starts under (:mod:`rollout.sync.salt`). What the bench asks
is where the two leave different hits.

One replica of the demo model per mode (the mode is the app's configuration, so each
mode is an app of its own, one after the other in one Ray and Serve). Hits and queries
are prompt tokens from vLLM's own prefix-cache counters (through Ray's metrics, as
``scaling`` reads them): they depend on what is cached, not on the machine's speed, so
the modes need no interleaving, and a rerun gives the same counts. Each event has a
prompt of its own (two whole KV blocks and one token: the most a CPU block of 128 tokens
lets hit), cached under the served version by a call before the event, and a second
call shows the cache holds it (``before``). After the event: the first call (``after``:
what the event left it) and a second (``again``: what the first cached).

Events, in this order, on one replica:

* ``commit``: a publish of new weights. Both modes must compute the prompt again.
* ``same_weights``: a publish of the weights already served (a new version, the same
  bytes): both compute it again too; neither compares bytes across versions.
* ``aborted_round``: a publish that aborts after the replica loaded its bytes (the
  replica's received bytes corrupted through the digest test hook,
  :data:`rollout.sync.digest.CORRUPT_MARKER`, so the coordinator refuses the round); the
  replica restores the committed version from the coordinator's copy, checked against
  its digests. The version served is the one before the round, byte for byte.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import ray
import torch
from ray import serve

from rollout.api import RolloutRequest, SamplingConfig
from rollout.app import deploy
from rollout.bench.machine import machine
from rollout.bench.scaling import CPU_KV_BLOCK_TOKENS, best_hit_rate, group_prompts, settled_prefix_counters
from rollout.client import RolloutClient
from rollout.contracts.net import free_port
from rollout.local import cpu_config
from rollout.sync import SyncError, WeightPublisher, digest

MODES = ("salt", "flush")
EVENTS = ("commit", "same_weights", "aborted_round")
RESTORE_TIMEOUT_S = 300.0


def _weights(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The served weights perturbed two ways (seeded): the next version, and the one the
    aborted round tries to publish."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        out.append({n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in base.items()})
    return out[0], out[1]


def _sampling() -> SamplingConfig:
    return SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True)


class _Replica:
    """The app of one mode: its client, publisher and prefix-cache counters."""

    def __init__(self, app: str, metrics_url: str):
        self.app, self.metrics_url = app, metrics_url
        self.client = RolloutClient.connect(app_name=app)
        self.publisher = WeightPublisher.connect(app_name=app)

    async def counters(self) -> tuple[float, float]:
        return await settled_prefix_counters(self.metrics_url, self.app)

    async def call(self, prompt: list[int]) -> int:
        """One call of ``prompt``; the version that served it."""
        (r,) = await self.client.generate([RolloutRequest(prompt_token_ids=prompt, sampling=_sampling())])
        return r.samples[0].weight_versions[0].version

    async def measured(self, prompt: list[int]) -> dict[str, Any]:
        """One call of ``prompt`` between two settled reads of the counters."""
        h0, q0 = await self.counters()
        version = await self.call(prompt)
        h1, q1 = await self.counters()
        return {"hits": int(h1 - h0), "queries": int(q1 - q0), "computed": int((q1 - q0) - (h1 - h0)), "version": version}

    async def aborted_round(self, tensors: dict[str, torch.Tensor]) -> str:
        """A publish the replica's corrupted receive aborts; returns once the replica has
        restored the committed version and serves again. The round's error."""
        status = await asyncio.to_thread(self.publisher.status)
        (replica,) = status["replicas"]
        marker = digest.replica_dir(replica) / digest.CORRUPT_MARKER
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        try:
            await asyncio.to_thread(self.publisher.publish, tensors)
        except SyncError as e:
            error = str(e)
        else:
            raise RuntimeError("the round with corrupted bytes committed: the digest test hook did not fire")
        finally:
            marker.unlink(missing_ok=True)
        aborted = self.publisher.last_outcome.round_id
        deadline = time.monotonic() + RESTORE_TIMEOUT_S
        while True:  # the restore round is the one decided after the aborted one
            s = await asyncio.to_thread(self.publisher.status)
            ids = [o["round_id"] for o in s["recent_rounds"]]
            later = s["recent_rounds"][ids.index(aborted) + 1 :] if aborted in ids else []
            if s["round_in_progress"] is None and any(o["committed"] for o in later):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica did not restore within {RESTORE_TIMEOUT_S:.0f} s after {aborted}")
            await asyncio.sleep(0.5)
        # A call of another prompt returns once generation has resumed after the restore.
        await self.call(group_prompts(1, seed=20)[0])
        return error


async def _mode(mode: str, model_dir: Path, metrics_port: int, http_port: int, next_weights, aborted_weights) -> dict[str, Any]:
    cfg = cpu_config(model_dir, app_name=f"bench-prefix-{mode}", http={"port": http_port}, metrics={"port": metrics_port}, sync={"prefix_cache": mode})
    await asyncio.to_thread(deploy, cfg)
    replica = _Replica(cfg.app_name, f"http://127.0.0.1:{metrics_port}/metrics")
    await replica.call([5, 6, 7, 8])  # warm-up
    events: dict[str, Callable[[], Awaitable[Any]]] = {
        "commit": lambda: asyncio.to_thread(replica.publisher.publish, next_weights),
        "same_weights": lambda: asyncio.to_thread(replica.publisher.publish, next_weights),
        "aborted_round": lambda: replica.aborted_round(aborted_weights),
    }
    out = {}
    for k, (name, event) in enumerate(events.items()):
        prompt = group_prompts(1, seed=10 + k)[0]  # a prompt no other event cached
        await replica.call(prompt)  # cached under the version served now
        before = await replica.measured(prompt)
        happened = await event()
        out[name] = {
            "before": before,
            "after": await replica.measured(prompt),
            "again": await replica.measured(prompt),
            **({"round_error": happened} if isinstance(happened, str) else {}),
        }
    serve.delete(cfg.app_name)
    return out


def run(model_dir: Path) -> dict[str, Any]:
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "bench")
    next_weights, aborted_weights = _weights(model_dir)
    metrics_port, http_port = free_port(), free_port()
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False, _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        modes = {mode: asyncio.run(_mode(mode, model_dir, metrics_port, http_port, next_weights, aborted_weights)) for mode in MODES}
    finally:
        serve.shutdown()
        ray.shutdown()
    prompt_tokens = len(group_prompts(1)[0])
    differ = [e for e in EVENTS if modes["salt"][e]["after"]["hits"] != modes["flush"][e]["after"]["hits"]]
    return {
        "benchmark": "prefix_cache",
        "model": str(model_dir),
        "replicas": 1,
        "prompt_tokens": prompt_tokens,
        "block_tokens": CPU_KV_BLOCK_TOKENS,
        "best_possible_hits": round(best_hit_rate(prompt_tokens) * prompt_tokens),
        "order": "the modes one after the other (token counts, not times: the machine's speed does not move them)",
        "events": list(EVENTS),
        "modes": modes,
        "events_where_the_modes_differ": differ,
        "machine": machine(),
    }
