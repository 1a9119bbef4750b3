"""The affinity decision and the engine-load autoscaling policy, as pure functions."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from rollout.routing.affinity import ReplicaLoad, affinity_key, rank
from rollout.scaling import KV_USAGE, SEQUENCES, engine_load_policy


def test_same_key_always_prefers_the_same_replica_and_keys_spread():
    replicas = [ReplicaLoad(f"r{i}", 0.1) for i in range(4)]
    firsts = {rank(f"session:{k}", replicas, 0.25)[0] for k in range(50)}
    assert len(firsts) == 4, "keys spread over all replicas"
    for k in range(20):
        assert len({rank(f"session:{k}", replicas, 0.25)[0] for _ in range(5)}) == 1


def test_removing_a_replica_only_moves_its_own_keys():
    four = [ReplicaLoad(f"r{i}", 0.1) for i in range(4)]
    three = four[:3]
    for k in range(100):
        before = rank(f"k{k}", four, 0.25)[0]
        if before != "r3":
            assert rank(f"k{k}", three, 0.25)[0] == before


def test_overloaded_preferred_replica_yields_to_the_least_loaded():
    replicas = [ReplicaLoad("a", 0.0), ReplicaLoad("b", 0.0)]
    key = next(f"k{i}" for i in range(100) if rank(f"k{i}", replicas, 0.25)[0] == "b")
    assert rank(key, [ReplicaLoad("a", 0.1), ReplicaLoad("b", 0.3)], 0.25)[0] == "b"  # within the gap
    assert rank(key, [ReplicaLoad("a", 0.1), ReplicaLoad("b", 0.9)], 0.25)[0] == "a"  # over it


def test_replicas_without_stats_keep_affinity_but_are_never_the_least_loaded(caplog):
    with caplog.at_level(logging.INFO):
        assert rank(None, [ReplicaLoad("new", None), ReplicaLoad("old", 0.5)], 0.25) == ["old", "new"]
    assert "no engine stats" in caplog.text
    both_unknown = [ReplicaLoad("x", None), ReplicaLoad("y", None)]
    firsts = {rank(f"k{i}", both_unknown, 0.25)[0] for i in range(40)}
    assert firsts == {"x", "y"}, "affinity still spreads keys when no replica reports yet"


def test_affinity_key_prefers_session_then_prompt_prefix():
    assert affinity_key({"session_id": "ep-1", "prompt": "x"}, 4, 8) == "session:ep-1"
    assert affinity_key({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, 4, 8) == "tokens:1,2,3,4"
    assert affinity_key({"prompt": "a long shared system prompt"}, 4, 8) == "text:a long s"
    assert affinity_key({}, 4, 8) is None


def _ctx(current, sequences, target=8.0, kv=None):
    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: target)
    metrics = {SEQUENCES: sequences, KV_USAGE: kv or {r: 0.1 for r in sequences}}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, running_replicas=list(sequences), aggregated_metrics=metrics, config=cfg)


def test_policy_sizes_the_deployment_from_engine_sequences():
    assert engine_load_policy(_ctx(1, {"a": 32.0}))[0] == 4.0
    assert engine_load_policy(_ctx(2, {"a": 4.0, "b": 4.0}))[0] == 1.0
    assert engine_load_policy(_ctx(2, {"a": 8.0, "b": 8.0}))[0] == 2.0  # steady load, steady count


def test_policy_adds_a_replica_under_kv_pressure_and_keeps_count_without_reports():
    assert engine_load_policy(_ctx(2, {"a": 1.0, "b": 1.0}, kv={"a": 0.99, "b": 0.2}))[0] == 3
    silent = SimpleNamespace(current_num_replicas=2, target_num_replicas=2, running_replicas=["a", "b"], aggregated_metrics={}, config=SimpleNamespace(get_target_ongoing_requests=lambda: 8.0))
    assert engine_load_policy(silent)[0] == 2
