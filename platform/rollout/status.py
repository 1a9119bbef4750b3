"""``rollout status``: a one-screen summary read from the platform's metrics endpoint.

Reads the Prometheus text exposition of Ray's metrics agent twice, ``interval_s``
apart, so counters become rates; no Prometheus server is needed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rollout.contracts.load import ReplicaLoad

# The gauges a replica sets from its load (rollout.metrics.EngineMetrics.gauges), by the
# ReplicaLoad field each one carries. The version gauge holds the policy version's
# number; its decimal spelling is a label rollout.contracts.version reads as that version.
LOAD_GAUGES = (
    ("ray_rollout_engine_running", "running", int),
    ("ray_rollout_engine_waiting", "waiting", int),
    ("ray_rollout_kv_cache_usage", "kv_cache_usage", float),
    ("ray_rollout_replica_weight_version", "weight_version", lambda v: str(int(v))),
)


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
    load: ReplicaLoad  # what the replica's own gauges say
    lag: Optional[int] = None  # versions behind the committed one, from the coordinator's gauge (None: not reported)
    tokens_per_s: float = 0.0  # from two reads of the generated-tokens counter
    sandbox: Optional[str] = None  # the python tool's isolation (rollout_tool_sandbox's label; None: not reported)


def _cell(value: Optional[Any], width: int, spec: str = "") -> str:
    # A gauge a replica did not report shows as missing, not as a made-up zero.
    return format(value, f">{width}{spec}") if value is not None else "-".rjust(width)


def _known(value: Optional[int]) -> str:
    return "unknown (not reported)" if value is None else str(value)


def _max_gauge(samples, name: str) -> Optional[int]:
    values = [v for _, v in samples.get(name, [])]
    return int(max(values)) if values else None


@dataclass
class Summary:
    # None: the coordinator's gauge is missing (no coordinator, or not scraped yet): unknown, not 0.
    committed_version: Optional[int] = None
    registered: Optional[int] = None
    tokens_per_s: float = 0.0
    replicas: dict[str, ReplicaRow] = field(default_factory=dict)

    def render(self) -> str:
        lines = [
            f"committed weight version  {_known(self.committed_version)}",
            f"replicas                  {len(self.replicas)} reporting, {_known(self.registered)} registered for sync",
            f"generated tokens/s        {self.tokens_per_s:,.0f}",
            "",
            f"{'replica':<12} {'version':>7} {'lag':>4} {'running':>8} {'waiting':>8} {'KV use':>7} {'tok/s':>9}  python tool sandbox",
        ]
        for r in sorted(self.replicas.values(), key=lambda r: r.load.replica_id):
            load = r.load
            lines.append(
                f"{load.replica_id:<12} {_cell(load.weight_version, 7)} {_cell(r.lag, 4)} {_cell(load.running, 8)} "
                f"{_cell(load.waiting, 8)} {_cell(load.kv_cache_usage, 6, '.1%')} {r.tokens_per_s:>9,.0f}  {r.sandbox or '-'}"
            )
        return "\n".join(lines)


def _by_replica(samples, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        if "replica" in labels:
            out[labels["replica"]] += value
    return out


def sandboxes(samples) -> dict[str, str]:
    """Each replica's python tool isolation, from the label of its rollout_tool_sandbox gauge."""
    return {labels["replica"]: labels["isolation"] for labels, value in samples.get("ray_rollout_tool_sandbox", []) if value == 1 and "replica" in labels and "isolation" in labels}


def replica_loads(samples) -> dict[str, ReplicaLoad]:
    """Each replica's load as its gauges last said, by replica id: the replicas whose
    running gauge is there, with only the gauges that are."""
    gauges = [(field_name, _by_replica(samples, name), cast) for name, field_name, cast in LOAD_GAUGES]
    running = _by_replica(samples, "ray_rollout_engine_running")
    return {rid: ReplicaLoad(replica_id=rid, **{f: cast(values[rid]) for f, values, cast in gauges if rid in values}) for rid in running}


def summarize(url: str, interval_s: float = 2.0) -> Summary:
    first = scrape(url)
    time.sleep(interval_s)
    second = scrape(url)
    s = Summary()
    s.committed_version = _max_gauge(second, "ray_rollout_committed_weight_version")
    s.registered = _max_gauge(second, "ray_rollout_sync_replicas")
    before = _by_replica(first, "ray_rollout_generated_tokens_total")
    after = _by_replica(second, "ray_rollout_generated_tokens_total")
    lags = _by_replica(second, "ray_rollout_weight_version_lag")
    isolation = sandboxes(second)
    for rid, load in replica_loads(second).items():
        tokens = max(0.0, after.get(rid, 0.0) - before.get(rid, 0.0))
        lag = lags.get(rid)
        s.replicas[rid] = ReplicaRow(load=load, lag=None if lag is None else int(lag), tokens_per_s=tokens / interval_s, sandbox=isolation.get(rid))
    s.tokens_per_s = sum(r.tokens_per_s for r in s.replicas.values())
    return s


def engine_health(url: str) -> str:
    """What the platform's ``/healthz`` says of its engines: that none answers, the engine
    deaths since it was deployed (the last one's error) and a crash loop; empty when all is well."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/healthz", timeout=10)
    except httpx.HTTPError as e:
        return f"health                    {url}/healthz did not answer: {e}"
    try:
        body = resp.json()
    except ValueError:
        body = {}
    lines = []
    if resp.status_code != 200:
        lines.append(f"health                    {resp.status_code}: {body.get('error', {}).get('message', resp.text)}")
    deaths = body.get("engine_deaths")
    if deaths:
        lines.append(f"engine deaths             {deaths['count']}; last: {deaths['last']}")
    if body.get("crash_loop"):
        lines.append(f"CRASH LOOP                {body['crash_loop']}")
    return "\n".join(lines)
