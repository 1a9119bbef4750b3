"""Across hosts, on one machine (tests/hosts.py): a Ray head host, a Ray worker host and a
trainer outside the Ray cluster, on a switch. The trainer's hostname resolves to loopback
and its first interface leads nowhere the replicas reach. Real Ray, Serve and vLLM (CPU);
nothing crosses hosts over loopback.

One replica runs on each Ray host (each offers the one Ray CPU a replica asks for). The
worker host joins late: until then the second replica waits for room, and the first
scenarios see one replica on the head. When the worker joins, its replica starts after
several commits and must catch up before its first request. Which replica served a
request is in its result (``replica_id``); which host that replica runs on, the replica
itself says (``Hosts.replica_nodes``); which replica the affinity router prefers for a
prompt follows from rendezvous hashing of the prompt's prefix and the replica ids
(rollout.routing.affinity), so the prompts each host must serve are picked, not hoped for.

Runs alone (``make test-hosts``); needs root for network namespaces and skips without.
Its platform is its own (``rollout serve`` on the head host), started and stopped here.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from rollout.routing.affinity import _score, affinity_key
from tests.conftest import PROBE_DEADLINES
from tests.hosts import HEAD_ADDRESS, SIDE_TRAINER_ADDRESS, TRAINER_ADDRESS, WORKER_ADDRESS, greedy_rollouts, last_json, made

API_KEY = "hosts-key-0123456789"
SYNC_TOKEN = "hosts-sync-token-0123456789"
SYNC_TIMEOUT_S = 60  # the default deadline: what a publish that cannot work used to wait out
START_TIMEOUT_S = 420
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5]
N_TOKENS = 16
# Prompts of distinct prefixes: each host's replica is preferred for about half of them.
CANDIDATES = [[k, k + 1, k + 2, k + 3] for k in range(11, 51)]
PER_HOST = 3
PREFIX_TOKENS = 32  # deployment.routing.prefix_tokens's default
PERTURBED = 1  # the seed of the "trained" weights the reference engine loads
# Serve's queue-length probe, with deadlines a loaded machine meets (tests/conftest.py says
# why): under the other lane's load one prompt of six once went to the other host's replica.


@pytest.fixture(scope="module")
def hosts():
    with made(worker=True) as h:
        yield h


@pytest.fixture(scope="module")
def platform(hosts, model_dir):
    """The Ray head and ``rollout serve`` (two replicas) on the head host, a trainer
    process on the trainer host (it answers commands: tests/host_trainer.py) and, beside
    it, a fresh reference engine on the perturbed weights. The worker host is not up yet."""
    key_file = hosts.api_key_file(API_KEY)
    # One request per handle call, so the router places each by its own prefix.
    config = hosts.platform_config(model_dir, key_file, replicas=2, sync={"timeout_s": SYNC_TIMEOUT_S}, deployment={"client_batch_size": 1})
    env = hosts.cluster_env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN, **PROBE_DEADLINES)
    head, serve = hosts.start_platform(config, env)
    # The trainer loads torch and the checkpoint, and the reference engine starts, while
    # the platform does.
    trainer = hosts.trainer_process(API_KEY, model_dir, hosts.env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN))
    reference = hosts.reference_process(model_dir, PERTURBED, PROMPTS + CANDIDATES, N_TOKENS, hosts.env())
    worker = None
    try:
        assert trainer.answer(120) == {"ready": True}, hosts.logs()
        # `rollout serve` waits for both replicas; the head's serves alone until then.
        up = trainer.call(timeout_s=START_TIMEOUT_S + 30, op="wait", within_s=START_TIMEOUT_S)
        assert "tokens" in up, f"the platform did not serve within {START_TIMEOUT_S}s: {up}\n{hosts.logs()}"
        print(f"the head's replica served after {up['elapsed_s']:.0f}s")
        state = SimpleNamespace(trainer=trainer, serve=serve, env=env, reference=reference, worker=None)
        yield state
        worker = state.worker
    finally:
        trainer.stop()
        serve.kill()  # the hosts are torn down next (Logged.kill)
        reference.stop(grace_s=10)
        if worker is not None:
            worker.stop(grace_s=30)
        head.stop(grace_s=30)


@pytest.fixture(scope="module")
def served():
    """What earlier scenarios saw served, for later ones: tokens by weights published,
    replica ids by host."""
    return {}


def generate(trainer, hosts, prompts=PROMPTS) -> dict:
    """Greedy rollouts from the trainer host: their tokens, the version that made them
    (one each) and the replica that served each."""
    return greedy_rollouts(trainer, hosts, prompts, N_TOKENS)


def publish(trainer, hosts, seed: int, publisher_address: str | None = None) -> dict:
    return trainer.call(timeout_s=4 * SYNC_TIMEOUT_S, op="publish", seed=seed, publisher_address=publisher_address)


def reference_tokens(platform, hosts) -> dict[str, list[int]]:
    """The fresh engine's greedy tokens on the perturbed weights, by prompt."""
    if not platform.reference.wait_for('{"tokens"', 600):
        pytest.fail(f"the reference engine gave no answer:\n{platform.reference.tail()}")
    tokens = last_json(platform.reference.text())["tokens"]
    return {json.dumps(p): t for p, t in zip(PROMPTS + CANDIDATES, tokens)}


def preferred(prompt: list[int], replica_ids) -> str:
    """The replica the affinity router sends ``prompt`` to while loads are even."""
    key = affinity_key({"prompt_token_ids": prompt}, PREFIX_TOKENS, 128)
    return max(replica_ids, key=lambda rid: _score(key, rid))


def test_rollouts_from_the_trainer_host_are_served(platform, hosts, served):
    trainer = platform.trainer
    where = trainer.call(op="addresses")
    # The host is the one the issue describes: its hostname resolves to loopback.
    assert where["hostname"] == "127.0.0.1", where
    assert where["advertised"] == TRAINER_ADDRESS, f"the interface that routes to {HEAD_ADDRESS}, not the hostname's or the first one's: {where}"
    first = generate(trainer, hosts)
    again = generate(trainer, hosts)
    assert again["tokens"] == first["tokens"], "greedy rollouts of the same weights are the same tokens"
    assert len(first["version_set"]) == 1
    assert len(set(first["replicas"] + again["replicas"])) == 1, "one replica runs until the worker host joins"
    served["checkpoint"] = first["tokens"]
    served["head replica"] = first["replicas"][0]


def test_a_publish_from_the_trainer_host_without_the_setting_commits_and_generation_follows_the_weights(platform, hosts, served):
    trainer = platform.trainer
    first = publish(trainer, hosts, seed=PERTURBED)
    assert first.get("version") == 1, f"{first}\n{hosts.logs()}"
    out = generate(trainer, hosts)
    assert out["version_set"] == {1}
    assert out["tokens"] != served["checkpoint"], "the perturbed weights serve other tokens"
    assert out["tokens"] == [reference_tokens(platform, hosts)[json.dumps(p)] for p in PROMPTS], "the tokens of a fresh engine on the published weights"
    served["seed-1"] = out["tokens"]
    # The checkpoint's own weights back: exactly the tokens served before any publish, so
    # what arrived is the weights as sent, and every token came from them.
    second = publish(trainer, hosts, seed=0)
    assert second.get("version") == 2, f"{second}\n{hosts.logs()}"
    out = generate(trainer, hosts)
    assert out["version_set"] == {2} and out["tokens"] == served["checkpoint"]


def test_a_publish_to_an_address_the_replicas_cannot_reach_fails_in_seconds_and_the_replica_keeps_its_version(platform, hosts, served):
    trainer = platform.trainer
    # The trainer's other interface: an address of its own, but the head has no route to it.
    failed = publish(trainer, hosts, seed=PERTURBED, publisher_address=SIDE_TRAINER_ADDRESS)
    assert failed.get("error_type") == "PublisherUnreachableError", f"{failed}\n{hosts.logs()}"
    assert failed["elapsed_s"] < 15, f"took {failed['elapsed_s']:.1f}s of the {SYNC_TIMEOUT_S}s deadline"
    assert failed["address"] == SIDE_TRAINER_ADDRESS
    message = failed["message"]
    assert f"{SIDE_TRAINER_ADDRESS}:{failed['port']}" in message and "ROLLOUT_PUBLISHER_ADDRESS" in message, message
    assert "keep version 2" in message, message
    out = generate(trainer, hosts)
    assert out["version_set"] == {2} and out["tokens"] == served["checkpoint"], "still the last committed version"
    # Without the setting the next publish goes through: the failed round left nothing behind.
    recovered = publish(trainer, hosts, seed=PERTURBED)
    assert recovered.get("version") == 3, f"{recovered}\n{hosts.logs()}"
    out = generate(trainer, hosts)
    assert out["version_set"] == {3} and out["tokens"] == served["seed-1"], "the same weights as version 1: the same tokens"
    print(f"the unreachable publish failed in {failed['elapsed_s']:.1f}s; the next one committed in {recovered['elapsed_s']:.1f}s")


def test_a_replica_that_starts_on_the_worker_host_after_several_commits_catches_up_before_its_first_request(platform, hosts, served):
    trainer = platform.trainer
    status = trainer.call(op="status")
    assert status["committed_version"] == 3 and list(status["replicas"]) == [served["head replica"]], status
    t0 = time.monotonic()
    platform.worker = hosts.start_ray_worker(platform.env)
    assert platform.worker.wait_for("Ray runtime started", 120), hosts.logs()
    # `rollout serve` reports serving once both replicas run.
    assert platform.serve.wait_for("serving ", START_TIMEOUT_S), f"the worker's replica did not start:\n{hosts.logs()}"
    print(f"the worker's replica started {time.monotonic() - t0:.0f}s after its host")
    nodes = hosts.replica_nodes(platform.env)
    assert nodes.get(served["head replica"]) == HEAD_ADDRESS and sorted(nodes.values()) == [HEAD_ADDRESS, WORKER_ADDRESS], nodes
    (late,) = [rid for rid, address in nodes.items() if address == WORKER_ADDRESS]
    served["replicas"] = {HEAD_ADDRESS: served["head replica"], WORKER_ADDRESS: late}
    served["prompts"] = {
        address: [p for p in CANDIDATES if preferred(p, nodes) == rid][:PER_HOST] for address, rid in served["replicas"].items()
    }
    assert all(len(p) == PER_HOST for p in served["prompts"].values()), served["prompts"]
    # Its first requests: the committed version's weights (the perturbed ones, as a fresh
    # engine on them serves), not the checkpoint it loaded.
    prompts = served["prompts"][WORKER_ADDRESS]
    out = generate(trainer, hosts, prompts)
    assert out["replicas"] == [late] * PER_HOST, f"the router's preferred replica for these prompts: {out['replicas']}"
    assert out["version_set"] == {3}, out["versions"]
    reference = reference_tokens(platform, hosts)
    assert out["tokens"] == [reference[json.dumps(p)] for p in prompts]
    status = trainer.call(op="status")
    assert status["committed_version"] == 3 and {r: v["version"] for r, v in status["replicas"].items()} == {rid: 3 for rid in nodes}, status


def test_rollouts_from_the_trainer_host_reach_replicas_on_both_hosts_by_prefix_affinity(platform, hosts, served):
    trainer = platform.trainer
    reference = reference_tokens(platform, hosts)
    prompts = served["prompts"][HEAD_ADDRESS] + served["prompts"][WORKER_ADDRESS]
    expected = [served["replicas"][HEAD_ADDRESS]] * PER_HOST + [served["replicas"][WORKER_ADDRESS]] * PER_HOST
    # One batch, interleaved, twice: each prompt goes to its replica wherever it sits in it.
    order = [i for pair in zip(range(PER_HOST), range(PER_HOST, 2 * PER_HOST)) for i in pair]
    for _ in range(2):
        out = generate(trainer, hosts, [prompts[i] for i in order])
        assert out["replicas"] == [expected[i] for i in order], "each prompt's prefix picks its replica, on either host"
        assert out["version_set"] == {3}
        assert out["tokens"] == [reference[json.dumps(prompts[i])] for i in order], "both hosts serve the committed weights"


def test_a_publish_from_the_trainer_host_commits_into_replicas_on_both_hosts(platform, hosts, served):
    trainer = platform.trainer
    reference = reference_tokens(platform, hosts)
    prompts = served["prompts"][HEAD_ADDRESS] + served["prompts"][WORKER_ADDRESS]
    expected = [served["replicas"][HEAD_ADDRESS]] * PER_HOST + [served["replicas"][WORKER_ADDRESS]] * PER_HOST
    back = publish(trainer, hosts, seed=0)
    assert back.get("version") == 4, f"{back}\n{hosts.logs()}"
    out = generate(trainer, hosts, prompts)
    assert out["replicas"] == expected and out["version_set"] == {4}
    changed = [t != reference[json.dumps(p)] for p, t in zip(prompts, out["tokens"])]
    assert changed[:PER_HOST].count(True) and changed[PER_HOST:].count(True), "both hosts left the perturbed weights"
    again = publish(trainer, hosts, seed=PERTURBED)
    assert again.get("version") == 5, f"{again}\n{hosts.logs()}"
    out = generate(trainer, hosts, prompts)
    assert out["replicas"] == expected and out["version_set"] == {5}
    assert out["tokens"] == [reference[json.dumps(p)] for p in prompts], "greedy on both hosts equals a fresh engine on the published weights"
    status = trainer.call(op="status")
    assert {r: v["version"] for r, v in status["replicas"].items()} == {rid: 5 for rid in expected}, status
    print(f"publishes into replicas on two hosts committed in {back['elapsed_s']:.1f}s and {again['elapsed_s']:.1f}s")
