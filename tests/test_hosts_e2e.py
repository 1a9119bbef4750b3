"""Across hosts, on one machine (tests/hosts.py): a trainer outside the Ray cluster, on a
host whose hostname resolves to loopback and whose first interface leads nowhere the
replicas reach, rolls out and publishes weights over HTTP (gloo) to ``rollout serve`` on
another host: real Ray, Serve and vLLM (CPU). Nothing crosses hosts over loopback.

Runs alone (``make test-hosts``); needs root for network namespaces and skips without.
Its platform is its own (``rollout serve`` on the head host), started and stopped here.
"""

from __future__ import annotations

import pytest
import yaml

from tests.hosts import HEAD_ADDRESS, HTTP_PORT, SIDE_TRAINER_ADDRESS, TRAINER_ADDRESS, CannotMakeHosts, Hosts

API_KEY = "hosts-key-0123456789"
SYNC_TOKEN = "hosts-sync-token-0123456789"
SYNC_TIMEOUT_S = 60  # the default deadline: what a publish that cannot work used to wait out
START_TIMEOUT_S = 420
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5]
N_TOKENS = 16


@pytest.fixture(scope="module")
def hosts():
    h = Hosts()
    try:
        h.create()
    except CannotMakeHosts as e:
        h.remove_files()
        pytest.skip(str(e))
    try:
        yield h
    finally:
        h.destroy()
        h.remove_files()


@pytest.fixture(scope="module")
def trainer(hosts, model_dir):
    """The platform on the head host and a trainer process on the trainer host (it answers
    commands: tests/host_trainer.py)."""
    key_file = hosts.dir / "api-key"
    key_file.write_text(API_KEY + "\n")
    config = {
        "model": {"path": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20},
        "http": {"host": "0.0.0.0", "port": HTTP_PORT, "api_key_file": str(key_file)},
        "sync": {"timeout_s": SYNC_TIMEOUT_S},
        "metrics": {"enabled": False},
    }
    config_path = hosts.dir / "rollout.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = hosts.cluster_env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN)
    head = hosts.start_ray_head(env)
    if not head.wait_for("Ray runtime started", 120):
        pytest.fail(f"the Ray head did not start:\n{hosts.logs()}")
    serve = hosts.serve(config_path, env)
    # The trainer loads torch and the checkpoint while the platform starts.
    process = hosts.trainer_process(API_KEY, model_dir, hosts.env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN))
    try:
        if not serve.wait_for("serving ", START_TIMEOUT_S):
            pytest.fail(f"rollout serve did not start within {START_TIMEOUT_S}s:\n{hosts.logs()}")
        assert process.answer(120) == {"ready": True}, hosts.logs()
        yield process
    finally:
        process.stop()
        serve.stop()
        head.stop(grace_s=30)


@pytest.fixture(scope="module")
def served():
    """What earlier scenarios saw served, for later ones: tokens by weights published."""
    return {}


def generate(trainer, hosts) -> tuple[list[list[int]], set[str]]:
    """Greedy rollouts from the trainer host: their tokens and the versions that made them."""
    out = trainer.call(op="generate", prompts=PROMPTS, max_tokens=N_TOKENS)
    assert "tokens" in out, f"{out}\n{hosts.logs()}"
    assert [len(t) for t in out["tokens"]] == [N_TOKENS] * len(PROMPTS)
    for spans in out["versions"]:
        assert len(spans) == 1 and spans[0][1:] == [0, N_TOKENS], f"one version made every token: {spans}"
    return out["tokens"], {spans[0][0] for spans in out["versions"]}


def publish(trainer, hosts, seed: int, publisher_address: str | None = None) -> dict:
    return trainer.call(timeout_s=4 * SYNC_TIMEOUT_S, op="publish", seed=seed, publisher_address=publisher_address)


def test_rollouts_from_the_trainer_host_are_served(trainer, hosts, served):
    where = trainer.call(op="addresses")
    # The host is the one the issue describes: its hostname resolves to loopback.
    assert where["hostname"] == "127.0.0.1", where
    assert where["advertised"] == TRAINER_ADDRESS, f"the interface that routes to {HEAD_ADDRESS}, not the hostname's or the first one's: {where}"
    tokens, versions = generate(trainer, hosts)
    again, _ = generate(trainer, hosts)
    assert again == tokens, "greedy rollouts of the same weights are the same tokens"
    assert len(versions) == 1
    served["checkpoint"] = tokens


def test_a_publish_from_the_trainer_host_without_the_setting_commits_and_generation_follows_the_weights(trainer, hosts, served):
    first = publish(trainer, hosts, seed=1)
    assert first.get("version") == 1, f"{first}\n{hosts.logs()}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {"1"}
    assert tokens != served["checkpoint"], "the perturbed weights serve other tokens"
    served["seed-1"] = tokens
    # The checkpoint's own weights back: exactly the tokens served before any publish, so
    # what arrived is the weights as sent, and every token came from them.
    second = publish(trainer, hosts, seed=0)
    assert second.get("version") == 2, f"{second}\n{hosts.logs()}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {"2"} and tokens == served["checkpoint"]


def test_a_publish_to_an_address_the_replicas_cannot_reach_fails_in_seconds_and_the_replica_keeps_its_version(trainer, hosts, served):
    # The trainer's other interface: an address of its own, but the head has no route to it.
    failed = publish(trainer, hosts, seed=1, publisher_address=SIDE_TRAINER_ADDRESS)
    assert failed.get("error_type") == "PublisherUnreachableError", f"{failed}\n{hosts.logs()}"
    assert failed["elapsed_s"] < 15, f"took {failed['elapsed_s']:.1f}s of the {SYNC_TIMEOUT_S}s deadline"
    assert failed["address"] == SIDE_TRAINER_ADDRESS
    message = failed["message"]
    assert f"{SIDE_TRAINER_ADDRESS}:{failed['port']}" in message and "ROLLOUT_PUBLISHER_ADDRESS" in message, message
    assert "keep version 2" in message, message
    tokens, versions = generate(trainer, hosts)
    assert versions == {"2"} and tokens == served["checkpoint"], "still the last committed version"
    # Without the setting the next publish goes through: the failed round left nothing behind.
    recovered = publish(trainer, hosts, seed=1)
    assert recovered.get("version") == 3, f"{recovered}\n{hosts.logs()}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {"3"} and tokens == served["seed-1"], "the same weights as version 1: the same tokens"
    print(f"the unreachable publish failed in {failed['elapsed_s']:.1f}s; the next one committed in {recovered['elapsed_s']:.1f}s")
