"""Across hosts (tests/hosts.py): a trainer that joins the Ray cluster as a driver, from a
host of its own, as docs/kubernetes.md ("A trainer pod") and k8s/examples/trainer-job.yaml
tell a trainer pod to: ``ray start --address=<head>:6379 --num-cpus=0 --num-gpus=0`` in the
pod, then a driver that publishes with ``WeightPublisher.connect`` (gloo), every Ray process
with ``RAY_ADDRESS``, ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN``.

The hosts share the machine's PIDs and /tmp, where a Ray driver would find the head's raylet
(by the process list and /tmp/ray) and attach to it, as no pod can. So the trainer's Ray node
and its driver run in a pod (``tests.hosts.pod_argv``): PID and mount namespaces of their
own, a private /tmp and /dev/shm, the trainer host's network. The head host runs the Ray head
and ``rollout serve`` (one replica); nothing else.

Runs alone (``make test-hosts``); needs root for network namespaces and skips without.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.hosts import HEAD_ADDRESS, HTTP_PORT, RAY_PORT, TRAINER_ADDRESS, Host, Hosts, Logged, Trainer, cmdline, greedy_rollouts, made, pod_argv

API_KEY = "hosts-key-0123456789"
SYNC_TOKEN = "hosts-sync-token-0123456789"
SYNC_TIMEOUT_S = 60
START_TIMEOUT_S = 420
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5]
N_TOKENS = 16
PERTURBED = 1
RAY = str(Path(sys.executable).with_name("ray"))
# The trainer pod's Ray node, as the example Job starts it (its stdout to stderr: the
# driver's stdout carries the test's JSON answers). No --node-ip-address, as the Job has
# none: Ray takes the address of the interface that routes to the GCS, the trainer host's
# 10.231.1.2 here (not the first interface's, nor the hostname's loopback), and the test
# checks that it did.
JOIN = f'{RAY} start --address="$RAY_ADDRESS" --num-cpus=0 --num-gpus=0 --disable-usage-stats'
REFUSED_WITHIN_S = 90


@pytest.fixture(scope="module")
def hosts():
    with made() as h:
        yield h


def pod_env(hosts: Hosts, **extra: str) -> dict[str, str]:
    """The example Job's environment: the head's GCS address, Ray's token settings, the
    sync token, HOME on the pod's own /tmp."""
    return hosts.cluster_env(RAY_ADDRESS=f"{HEAD_ADDRESS}:{RAY_PORT}", ROLLOUT_SYNC_TOKEN=SYNC_TOKEN, HOME="/tmp/home", **extra)


@pytest.fixture(scope="module")
def cluster(hosts, model_dir):
    """The Ray head and ``rollout serve`` (one replica) on the head host; the platform
    starts while the first scenario runs."""
    key_file = hosts.api_key_file(API_KEY)
    config = hosts.platform_config(model_dir, key_file, replicas=1, sync={"timeout_s": SYNC_TIMEOUT_S})
    env = hosts.cluster_env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN)
    head, serve = hosts.start_platform(config, env)
    try:
        yield SimpleNamespace(head=head, serve=serve, env=env)
    finally:
        serve.kill()  # the hosts are torn down next (Logged.kill)
        head.stop(grace_s=30)


@pytest.fixture(scope="module")
def pod(cluster, hosts, model_dir):
    """The trainer pod, once the platform serves: its Ray node joins the cluster, then the
    driver (tests/host_driver_trainer.py) loads the checkpoint and answers commands."""
    if not cluster.serve.wait_for("serving ", START_TIMEOUT_S):
        pytest.fail(f"the platform did not start within {START_TIMEOUT_S}s:\n{hosts.logs()}")
    driver = f"{JOIN} 1>&2 && exec {sys.executable} -u -m tests.host_driver_trainer http://{HEAD_ADDRESS}:{HTTP_PORT} {API_KEY} {model_dir}"
    trainer = Trainer(hosts.trainer, "", "", model_dir, hosts.dir / "trainer-pod.log", pod_env(hosts), argv=pod_argv(driver))
    try:
        assert trainer.answer(240) == {"ready": True}, hosts.logs()
        yield trainer
    finally:
        trainer.stop()  # its stdin closed: the driver ends, and with it (PID 1) the pod
        assert gone(hosts.trainer), f"the pod's processes outlived it: {[cmdline(p) for p in hosts.trainer.pids()]}"


def gone(host: Host, within_s: float = 15) -> bool:
    """Whether every process of ``host`` ended within ``within_s`` (a pod's end with its
    PID 1: the kernel kills the rest of its PID namespace)."""
    deadline = time.monotonic() + within_s
    while host.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not host.pids()


def generate(trainer: Trainer, hosts: Hosts) -> dict:
    """Greedy rollouts from the trainer pod over HTTP: their tokens and the one version that
    made each."""
    return greedy_rollouts(trainer, hosts, PROMPTS, N_TOKENS)


def test_a_trainer_pod_without_ray_auth_mode_is_refused_when_it_joins(cluster, hosts):
    """The docs' claim: the token alone is not enough. Ray turns token authentication on by
    itself only for a cluster it finds locally; a node joining by address with
    ``RAY_AUTH_TOKEN`` but no ``RAY_AUTH_MODE`` never sends the token, and the GCS refuses
    it: the pod's ``ray start`` fails, the driver never runs."""
    env = {k: v for k, v in pod_env(hosts).items() if k != "RAY_AUTH_MODE"}
    t0 = time.monotonic()
    join = Logged(hosts.trainer, pod_argv(JOIN), hosts.dir / "trainer-pod-no-mode.log", env)
    try:
        code = join.proc.wait(REFUSED_WITHIN_S)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - t0
    join.stop(grace_s=5)
    text = join.text()
    assert code is not None and code != 0, f"ray start without RAY_AUTH_MODE: exit {code} after {elapsed:.0f}s\n{text[-3000:]}"
    assert "InvalidAuthToken" in text, text[-3000:]
    assert gone(hosts.trainer), "nothing of the refused pod is left"
    print(f"the pod's ray start without RAY_AUTH_MODE was refused after {elapsed:.0f}s (exit {code})")


def test_a_trainer_pod_joins_as_a_driver_and_publishes_through_weight_publisher_connect(pod, hosts):
    joined = pod.call(timeout_s=180, op="connect")
    assert "error_type" not in joined, f"{joined}\n{hosts.logs()}"
    # The driver attached to its own pod's Ray node, the only raylet it can see, whose
    # address is the trainer host's: the one the replicas connect back to.
    assert len(joined["raylets_seen"]) == 1, joined
    assert joined["node_address"] == TRAINER_ADDRESS and joined["advertised"] == TRAINER_ADDRESS, joined
    assert joined["nodes"] == sorted([HEAD_ADDRESS, TRAINER_ADDRESS]), joined
    checkpoint = generate(pod, hosts)
    assert generate(pod, hosts)["tokens"] == checkpoint["tokens"], "greedy rollouts of the same weights are the same tokens"
    first = pod.call(timeout_s=4 * SYNC_TIMEOUT_S, op="publish", seed=PERTURBED)
    assert first.get("version") == 1, f"{first}\n{hosts.logs()}"
    out = generate(pod, hosts)
    assert out["version_set"] == {1} and out["tokens"] != checkpoint["tokens"], "the perturbed weights serve other tokens"
    # The checkpoint's own weights back: exactly its tokens, so what arrived is the weights
    # as sent and every token came from them.
    second = pod.call(timeout_s=4 * SYNC_TIMEOUT_S, op="publish", seed=0)
    assert second.get("version") == 2, f"{second}\n{hosts.logs()}"
    out = generate(pod, hosts)
    assert out["version_set"] == {2} and out["tokens"] == checkpoint["tokens"]
    print(f"joined in {joined['join_s']:.1f}s; publishes committed in {first['elapsed_s']:.1f}s and {second['elapsed_s']:.1f}s")
