"""ReplicaLoad: one replica's load, as the replica reports it and as its readers (routers,
the autoscaler, the gauges, ``rollout status``) read it back."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from ray.serve._private.common import DeploymentID, ReplicaID

from rollout.config import load_config
from rollout.contracts.load import AUTOSCALING_METRICS, ReplicaLoad
from rollout.engine.adapter import EngineAdapter
from rollout.engine.replica import RolloutEngine
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import SyncGate
from rollout.engine.validation import ModelLimits
from rollout.metrics import EngineMetrics
from rollout.rewards import RewardScorer
from rollout.routing.router import AffinityRouter
from rollout.status import summarize

FULL = ReplicaLoad(
    replica_id="r1",
    running=3,
    waiting=2,
    kv_cache_usage=0.25,
    prefix_cache_queries=40,
    prefix_cache_hits=10,
    inflight_requests=5,
    unfinished_requests=4,
    weight_version="7",
    max_num_seqs=10,
    updated_at=1700000000.5,
)

# What RolloutClient.stats() has always returned (the former EngineStats), in this order.
PUBLIC_FIELDS = [
    "replica_id", "running", "waiting", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
    "inflight_requests", "unfinished_requests", "weight_version", "max_num_seqs", "updated_at",
    "kv_cache_usage_peak",  # added after them (issue 43)
    "sleep_level",  # then this (issue 42: a trainer's /sleep)
]


def test_routing_stats_round_trip_as_a_plain_dict():
    stats = FULL.to_routing_stats()
    assert "replica_id" not in stats, "Serve tells routers whose stats these are"
    assert json.loads(json.dumps(stats)) == stats, "plain values only: Serve sends them to every router"
    assert ReplicaLoad.from_routing_stats("r1", stats) == FULL
    assert (FULL.sequences, FULL.relative_load, FULL.prefix_cache_hit_rate) == (5, 0.5, 0.25)


def test_a_signal_not_reported_stays_missing():
    partial = ReplicaLoad(replica_id="r1", running=3, max_num_seqs=10)
    assert partial.to_routing_stats() == {"running": 3, "max_num_seqs": 10}
    back = ReplicaLoad.from_routing_stats("r1", partial.to_routing_stats())
    assert back == partial and back.waiting is None
    assert back.sequences is None and back.relative_load is None, "no waiting count: the load is unknown, not 0.3"
    assert partial.prefix_cache_hit_rate is None
    for before_the_first_report in ({}, None):
        assert ReplicaLoad.from_routing_stats("r2", before_the_first_report) == ReplicaLoad(replica_id="r2")
    assert partial.to_autoscaling_metrics() == {AUTOSCALING_METRICS["running"]: 3.0}


def test_a_field_this_code_cannot_read_is_dropped_not_the_whole_report():
    # The routing stats of a replica from before ReplicaLoad, met during a rolling update.
    older = {"running": 4, "waiting": 1, "inflight": 5, "max_num_seqs": 10, "kv_cache_usage": 0.5,
             "prefix_cache_hit_rate": 0.0, "weight_version": 0, "updated_at": 1.0}
    load = ReplicaLoad.from_routing_stats("r1", older)
    assert load.relative_load == 0.5 and load.kv_cache_usage == 0.5 and load.updated_at == 1.0
    assert load.weight_version is None and load.inflight_requests is None


def test_autoscaling_metrics_round_trip_through_what_serve_aggregates():
    metrics = FULL.to_autoscaling_metrics()
    assert metrics and all(type(v) is float for v in metrics.values()), "Serve disables custom metrics that are not numbers"
    replica = ReplicaID("r1", DeploymentID(name="engine", app_name="rollout"))
    # Serve hands the policy {metric: {ReplicaID: mean over the look-back window}}.
    loads = ReplicaLoad.from_autoscaling_metrics({metric: {replica: value} for metric, value in metrics.items()})
    assert loads == {replica: ReplicaLoad(replica_id="r1", running=3, waiting=2, kv_cache_usage=0.25)}
    assert loads[replica].sequences == 5


def test_autoscaling_metrics_keep_window_means_and_missing_replicas_missing():
    aggregated = {
        AUTOSCALING_METRICS["running"]: {"a": 2.5},
        AUTOSCALING_METRICS["waiting"]: {"a": 0.25},
        AUTOSCALING_METRICS["kv_cache_usage"]: {"a": 0.5, "b": 0.1},  # b: no sequence counts
    }
    loads = ReplicaLoad.from_autoscaling_metrics(aggregated)
    assert loads["a"].sequences == 2.75, "a mean over the window is kept, not rounded"
    assert loads["b"].sequences is None and loads["b"].kv_cache_usage == 0.1
    assert "c" not in loads and ReplicaLoad.from_autoscaling_metrics({}) == {}


# ---- the replica's side ----------------------------------------------------------


class FakeEngine:
    errored = False

    def get_num_unfinished_requests(self) -> int:
        return 4

    async def get_weight_version(self) -> str:
        return "default"

    def shutdown(self):
        pass


def replica(sync_version=None) -> RolloutEngine:
    r = object.__new__(RolloutEngine)  # the load reporting only: no vLLM engine behind it
    config = load_config({"model": {"path": "/models/x", "max_num_seqs": 8}}, environ={})
    sync = SimpleNamespace(version=sync_version, sleep_level=0, stop=lambda: None) if sync_version is not None else None
    adapter = EngineAdapter(FakeEngine(), None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), SchedulerSnapshot())
    r._assemble(config, "r", adapter, SyncGate.over(sync, config.sync, "r"), RewardScorer.from_config(config.rewards))
    return r


async def test_stats_keep_their_public_fields_and_types():
    r = replica()
    r.adapter.snapshot.running, r.adapter.snapshot.waiting, r.adapter.snapshot.kv_cache_usage = 3, 1, 0.5
    with r.admission.inflight.counted(2):
        s = await r.stats()
    assert list(s.model_dump()) == PUBLIC_FIELDS
    assert json.loads(s.model_dump_json()) == {
        "replica_id": "r", "running": 3, "waiting": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
        "inflight_requests": 2, "unfinished_requests": 4, "weight_version": "default", "max_num_seqs": 8, "updated_at": 0.0,
        "kv_cache_usage_peak": 0.0, "sleep_level": 0,
    }
    assert '"running":3,' in s.model_dump_json(), "counts stay integers"


def test_the_replica_reports_one_load_to_routers_and_to_the_autoscaler():
    r = replica(sync_version=3)
    r.adapter.snapshot.running, r.adapter.snapshot.waiting, r.adapter.snapshot.kv_cache_usage = 3, 1, 0.5
    with r.admission.inflight.counted(2):
        routed = ReplicaLoad.from_routing_stats("r", r.record_routing_stats())
        assert routed == r._load() and routed.relative_load == 0.5 and routed.weight_version == "3"
        scaled = r.record_autoscaling_stats()
    assert set(scaled) == set(AUTOSCALING_METRICS.values()) and all(type(v) is float for v in scaled.values())
    assert ReplicaLoad.from_autoscaling_metrics({m: {"r": v} for m, v in scaled.items()})["r"].sequences == 4


def test_an_idle_replica_reports_zeros_it_decided_on():
    # No request in flight and no engine step for over 2 s: the scheduler's last numbers
    # predate the final step, so the replica reports an empty engine (rollout.engine.replica).
    r = replica()
    r.adapter.snapshot.running, r.adapter.snapshot.kv_cache_usage = 5, 0.9
    r.adapter.snapshot.last_step_monotonic = time.monotonic() - 10
    load = ReplicaLoad.from_routing_stats("r", r.record_routing_stats())
    assert (load.running, load.waiting, load.kv_cache_usage, load.weight_version) == (0, 0, 0.0, "default")


def test_the_kv_cache_peak_is_that_of_the_current_run_of_requests_or_idle_of_the_last_one():
    """A burst's KV-cache use, which polling ``kv_cache_usage`` misses between engine steps
    (and an idle replica reports as 0): the highest the engine reported since requests
    last arrived at a replica serving none."""

    def step(usage: float, running: int) -> SimpleNamespace:
        return SimpleNamespace(prefix_cache_stats=None, num_running_reqs=running, num_waiting_reqs=0, num_skipped_waiting_reqs=0, kv_cache_usage=usage)

    r = replica()
    snapshot = r.adapter.snapshot
    with r.admission.inflight.counted(8):
        for usage, running in ((0.2, 8), (0.45, 8), (0.3, 4), (0.0, 0)):
            snapshot.update(step(usage, running))
        assert r._load().kv_cache_usage_peak == 0.45
    snapshot.last_step_monotonic = time.monotonic() - 10  # idle: the usage reads 0, the peak stays the last run's
    load = ReplicaLoad.from_routing_stats("r", r.record_routing_stats())
    assert (load.kv_cache_usage, load.kv_cache_usage_peak) == (0.0, 0.45)
    with r.admission.inflight.counted(1):  # the next run starts its own peak
        assert r._load().kv_cache_usage_peak == 0.0
        snapshot.update(step(0.1, 1))
        with r.admission.inflight.counted(1):  # a request joining a run does not restart it
            snapshot.update(step(0.05, 2))
        assert r._load().kv_cache_usage_peak == 0.1


async def test_the_router_ranks_replicas_by_their_reported_load():
    router = object.__new__(AffinityRouter)
    router.initialize_state(max_imbalance=0.25)

    def running(rid, stats):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)

    busy = ReplicaLoad(replica_id="busy", running=8, waiting=4, max_num_seqs=8).to_routing_stats()
    idle = ReplicaLoad(replica_id="idle", running=1, waiting=0, max_num_seqs=8).to_routing_stats()
    ranked = await router.choose_replicas([running("busy", busy), running("starting", {}), running("idle", idle)])
    assert [r.replica_id.unique_id for (r,) in ranked] == ["idle", "busy", "starting"]


async def test_a_retry_avoiding_the_replica_that_refused_it_goes_first_to_another_whatever_its_affinity():
    router = object.__new__(AffinityRouter)
    router.initialize_state(max_imbalance=0.25)
    replicas = [
        SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=ReplicaLoad(replica_id=rid, running=1, max_num_seqs=8).to_routing_stats())
        for rid in ("a", "b", "c")
    ]

    def pending(**kwargs):
        return SimpleNamespace(args=[{"session_id": "s-1"}], kwargs=kwargs)

    async def order(request) -> list[str]:
        return [r.replica_id.unique_id for (r,) in await router.choose_replicas(replicas, request)]

    preferred = (await order(pending()))[0]
    assert (await order(pending(avoid_replica=None)))[0] == preferred, "the same key keeps its replica"
    avoided = await order(pending(avoid_replica=preferred))
    assert avoided[-1] == preferred and sorted(avoided) == ["a", "b", "c"]
    assert await order(pending(avoid_replica="gone")) == await order(pending())


# ---- metrics and ``rollout status`` ------------------------------------------------


class FakeGauge:
    def __init__(self):
        self.values = []

    def set(self, value, tags=None):
        self.values.append(value)


def test_gauges_report_the_load_and_leave_out_what_is_missing():
    m = object.__new__(EngineMetrics)  # Ray's metric objects replaced by recorders
    m._tags = {}
    m.running, m.waiting, m.kv_usage, m.version, m.sandbox = FakeGauge(), FakeGauge(), FakeGauge(), FakeGauge(), FakeGauge()
    m._sandbox_label = None
    m.gauges(ReplicaLoad(replica_id="r", running=3, waiting=1, kv_cache_usage=0.5, weight_version="default"))
    assert m.sandbox.values == [], "no isolation reported before the replica's tools said one"
    m.tool_sandbox("bubblewrap+seccomp+cgroup-v1")
    m.gauges(ReplicaLoad(replica_id="r", running=2, weight_version="4"))
    assert (m.running.values, m.waiting.values, m.kv_usage.values, m.version.values) == ([3, 2], [1], [0.5], [0, 4])
    assert m.sandbox.values == [1, 1], "the isolation gauge is re-reported with the load, or Ray ages it out"


def test_status_reads_the_gauges_back_into_loads(monkeypatch):
    def series(**by_replica):
        return [({"replica": rid, "app": "rollout"}, value) for rid, value in by_replica.items()]

    first = {"ray_rollout_generated_tokens_total": series(a=100.0, b=50.0)}
    second = {
        "ray_rollout_generated_tokens_total": series(a=300.0, b=50.0),
        "ray_rollout_committed_weight_version": [({}, 2.0)],
        "ray_rollout_engine_running": series(a=3.0, b=0.0),
        "ray_rollout_engine_waiting": series(a=1.0),
        "ray_rollout_kv_cache_usage": series(a=0.125, b=0.0),
        "ray_rollout_replica_weight_version": series(a=2.0, b=0.0),
        "ray_rollout_weight_version_lag": series(a=0.0, b=2.0),
        "ray_rollout_tool_sandbox": [({"replica": "a", "isolation": "bubblewrap+seccomp+cgroup-v2"}, 1.0)],
    }
    scrapes = iter([first, second])
    monkeypatch.setattr("rollout.status.scrape", lambda url: next(scrapes))
    monkeypatch.setattr("rollout.status.time.sleep", lambda s: None)
    s = summarize("http://metrics", interval_s=2.0)
    assert s.replicas["a"].load == ReplicaLoad(replica_id="a", running=3, waiting=1, kv_cache_usage=0.125, weight_version="2")
    assert s.replicas["b"].load.waiting is None, "no waiting gauge from b: missing, not 0"
    lines = s.render().splitlines()
    # The row as `rollout status` has always printed it.
    # The row as `rollout status` has always printed it, then the python tool's isolation
    # ("-" where the replica did not report one).
    assert f"{'a':<12} {2:>7} {0:>4} {3:>8} {1:>8} {0.125:>6.1%} {100:>9,.0f}  bubblewrap+seccomp+cgroup-v2" in lines
    assert f"{'b':<12} {0:>7} {2:>4} {0:>8} {'-':>8} {0.0:>6.1%} {0:>9,.0f}  -" in lines
    assert s.committed_version == 2 and s.tokens_per_s == 100.0


def test_status_says_unknown_where_the_coordinators_gauges_are_missing(monkeypatch):
    first = {"ray_rollout_generated_tokens_total": [({"replica": "a"}, 10.0)]}
    second = {"ray_rollout_generated_tokens_total": [({"replica": "a"}, 10.0)], "ray_rollout_engine_running": [({"replica": "a"}, 1.0)]}
    scrapes = iter([first, second])
    monkeypatch.setattr("rollout.status.scrape", lambda url: next(scrapes))
    monkeypatch.setattr("rollout.status.time.sleep", lambda s: None)
    s = summarize("http://metrics", interval_s=2.0)
    assert s.committed_version is None and s.registered is None and s.replicas["a"].lag is None
    text = s.render()
    assert "committed weight version  unknown (not reported)" in text
    assert "1 reporting, unknown (not reported) registered for sync" in text
    assert f"{'a':<12} {'-':>7} {'-':>4} {1:>8}" in text
