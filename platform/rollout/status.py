"""``rollout status``: a one-screen summary read from the platform's metrics endpoint.

Reads the Prometheus text exposition of Ray's metrics agent twice, ``interval_s``
apart, so counters become rates; no Prometheus server is needed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    resp = httpx.get(url, timeout=10)
    resp.raise_for_status()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def prefix_cache_counters(url: str, app: str) -> tuple[float, float]:
    """(hits, queries) of the prefix caches of ``app``'s replicas, summed."""
    samples = scrape(url)

    def total(name: str) -> float:
        return sum(v for labels, v in samples.get(name, []) if labels.get("app") == app)

    return total("ray_rollout_prefix_cache_hits_total"), total("ray_rollout_prefix_cache_queries_total")


@dataclass
class ReplicaRow:
    replica: str
    version: int = 0
    lag: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class Summary:
    committed_version: int = 0
    registered: int = 0
    tokens_per_s: float = 0.0
    replicas: dict[str, ReplicaRow] = field(default_factory=dict)

    def render(self) -> str:
        lines = [
            f"committed weight version  {self.committed_version}",
            f"replicas                  {len(self.replicas)} reporting, {self.registered} registered for sync",
            f"generated tokens/s        {self.tokens_per_s:,.0f}",
            "",
            f"{'replica':<12} {'version':>7} {'lag':>4} {'running':>8} {'waiting':>8} {'KV use':>7} {'tok/s':>9}",
        ]
        for r in sorted(self.replicas.values(), key=lambda r: r.replica):
            lines.append(f"{r.replica:<12} {r.version:>7} {r.lag:>4} {r.running:>8} {r.waiting:>8} {r.kv_usage:>6.1%} {r.tokens_per_s:>9,.0f}")
        return "\n".join(lines)


def _by_replica(samples, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        if "replica" in labels:
            out[labels["replica"]] += value
    return out


def summarize(url: str, interval_s: float = 2.0) -> Summary:
    first = scrape(url)
    time.sleep(interval_s)
    second = scrape(url)
    s = Summary()
    committed = second.get("ray_rollout_committed_weight_version", [])
    s.committed_version = int(max((v for _, v in committed), default=0))
    s.registered = int(max((v for _, v in second.get("ray_rollout_sync_replicas", [])), default=0))
    before = _by_replica(first, "ray_rollout_generated_tokens_total")
    after = _by_replica(second, "ray_rollout_generated_tokens_total")
    for rid, running in _by_replica(second, "ray_rollout_engine_running").items():
        s.replicas[rid] = ReplicaRow(replica=rid, running=int(running))
    for name, attr, cast in (
        ("ray_rollout_engine_waiting", "waiting", int),
        ("ray_rollout_kv_cache_usage", "kv_usage", float),
        ("ray_rollout_replica_weight_version", "version", int),
        ("ray_rollout_weight_version_lag", "lag", int),
    ):
        for rid, value in _by_replica(second, name).items():
            if rid in s.replicas:
                setattr(s.replicas[rid], attr, cast(value))
    for rid, row in s.replicas.items():
        row.tokens_per_s = max(0.0, after.get(rid, 0.0) - before.get(rid, 0.0)) / interval_s
    s.tokens_per_s = sum(r.tokens_per_s for r in s.replicas.values())
    return s
