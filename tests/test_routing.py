"""The affinity decision and the engine-load autoscaling policy, as pure functions."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from rollout.contracts.load import ReplicaLoad
from rollout.routing.affinity import affinity_key, rank
from rollout.scaling import engine_load_policy


def loaded(replica_id: str, relative_load: float | None) -> ReplicaLoad:
    """A replica whose (running + waiting) / max_num_seqs is ``relative_load``; None: no report."""
    if relative_load is None:
        return ReplicaLoad(replica_id=replica_id)
    return ReplicaLoad(replica_id=replica_id, running=round(relative_load * 100), waiting=0, max_num_seqs=100)


def serve_aggregated(loads: dict[str, ReplicaLoad]) -> dict[str, dict[str, float]]:
    """What Serve hands the policy for replicas that reported ``loads`` over the whole window."""
    out: dict[str, dict[str, float]] = {}
    for rid, load in loads.items():
        for metric, value in load.to_autoscaling_metrics().items():
            out.setdefault(metric, {})[rid] = value
    return out


def test_same_key_always_prefers_the_same_replica_and_keys_spread():
    replicas = [loaded(f"r{i}", 0.1) for i in range(4)]
    firsts = {rank(f"session:{k}", replicas, 0.25)[0] for k in range(50)}
    assert len(firsts) == 4, "keys spread over all replicas"
    for k in range(20):
        assert len({rank(f"session:{k}", replicas, 0.25)[0] for _ in range(5)}) == 1


def test_removing_a_replica_only_moves_its_own_keys():
    four = [loaded(f"r{i}", 0.1) for i in range(4)]
    three = four[:3]
    for k in range(100):
        before = rank(f"k{k}", four, 0.25)[0]
        if before != "r3":
            assert rank(f"k{k}", three, 0.25)[0] == before


def test_overloaded_preferred_replica_yields_to_the_least_loaded():
    replicas = [loaded("a", 0.0), loaded("b", 0.0)]
    key = next(f"k{i}" for i in range(100) if rank(f"k{i}", replicas, 0.25)[0] == "b")
    assert rank(key, [loaded("a", 0.1), loaded("b", 0.3)], 0.25)[0] == "b"  # within the gap
    assert rank(key, [loaded("a", 0.1), loaded("b", 0.9)], 0.25)[0] == "a"  # over it


def test_replicas_without_stats_keep_affinity_but_are_never_the_least_loaded(caplog):
    with caplog.at_level(logging.INFO):
        assert rank(None, [loaded("new", None), loaded("old", 0.5)], 0.25) == ["old", "new"]
    assert "no engine stats" in caplog.text
    both_unknown = [loaded("x", None), loaded("y", None)]
    firsts = {rank(f"k{i}", both_unknown, 0.25)[0] for i in range(40)}
    assert firsts == {"x", "y"}, "affinity still spreads keys when no replica reports yet"


def test_affinity_key_prefers_session_then_prompt_prefix():
    assert affinity_key({"session_id": "ep-1", "prompt": "x"}, 4, 8) == "session:ep-1"
    assert affinity_key({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, 4, 8) == "tokens:1,2,3,4"
    assert affinity_key({"prompt": "a long shared system prompt"}, 4, 8) == "text:a long s"
    assert affinity_key({}, 4, 8) is None


def _ctx(current, sequences, target=8.0, kv=None, waiting=None):
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    kv = kv or {r: 0.1 for r in sequences}
    waiting = waiting or {r: 0.0 for r in sequences}
    loads = {r: ReplicaLoad(replica_id=r, running=n, waiting=waiting[r], kv_cache_usage=kv[r]) for r, n in sequences.items()}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, running_replicas=list(sequences), aggregated_metrics=serve_aggregated(loads), config=cfg)


def test_policy_sizes_the_deployment_from_engine_sequences():
    assert engine_load_policy(_ctx(1, {"a": 32.0}))[0] == 4.0
    assert engine_load_policy(_ctx(2, {"a": 4.0, "b": 4.0}))[0] == 1.0
    assert engine_load_policy(_ctx(2, {"a": 8.0, "b": 8.0}))[0] == 2.0  # steady load, steady count


def test_policy_adds_a_replica_under_kv_pressure_and_keeps_count_without_reports():
    assert engine_load_policy(_ctx(2, {"a": 1.0, "b": 1.0}, kv={"a": 0.99, "b": 0.2}))[0] == 3
    silent = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, running_replicas=["a", "b"], aggregated_metrics={}, config=SimpleNamespace(get_target_ongoing_requests=lambda: 8.0))
    assert engine_load_policy(silent)[0] == 2


def test_policy_counts_waiting_sequences_and_silent_replicas_at_the_target_load():
    assert engine_load_policy(_ctx(1, {"a": 16.0}, waiting={"a": 16.0}))[0] == 4.0
    # c runs but has not reported: it is counted at the target load, not at zero.
    ctx = _ctx(2, {"a": 16.0, "b": 0.0})
    ctx.running_replicas.append("c")
    assert engine_load_policy(ctx)[0] == 3.0
    # A report without sequence counts is no report of them.
    partial = _ctx(2, {"a": 16.0})
    partial.running_replicas.append("b")
    partial.aggregated_metrics = serve_aggregated(
        {"a": ReplicaLoad(replica_id="a", running=16.0, waiting=0.0), "b": ReplicaLoad(replica_id="b", kv_cache_usage=0.3)}
    )
    assert engine_load_policy(partial)[0] == 3.0
