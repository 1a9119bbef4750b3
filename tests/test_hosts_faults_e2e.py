"""Across hosts, when things break (tests/hosts.py with a Ray worker host): a trainer written
for ``vllm serve`` drives vLLM's RL routes into replicas on two Ray hosts; the worker host
is lost mid-publish (its Ray killed hard, then its link cut); the trainer's own link is cut
mid-publish. Real Ray, Serve, vLLM (CPU) and gloo; nothing crosses hosts over loopback.

"Mid-publish" is made deterministic, not a race: the trainer (tests/host_routes_trainer.py)
holds its transfer once the first bucket has reached every replica (the round is open,
every member joined the group and is receiving) and says so; the test then breaks the
host or the link and lets the transfer go on.

Each failure asserts what the publisher was told and how soon (within the round's
deadline: three sync steps of ``sync.timeout_s``), the tokens every surviving replica
serves (the committed version's), that no vLLM engine process of a lost replica outlives
it, and that a lost replica is replaced on its host once the host is back and catches up
before it serves.

Needs root for network namespaces; skips without. Runs alone (``make test-hosts``).
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import yaml

from tests.hosts import HEAD_ADDRESS, HTTP_PORT, RAY_PROCESS, WORKER_ADDRESS, Hosts, Trainer, cmdline, made

API_KEY = "faults-key-0123456789"
SYNC_TOKEN = "faults-sync-token-0123456789"
SYNC_TIMEOUT_S = 20  # sync.timeout_s: every step's deadline
ROUND_DEADLINE_S = 3 * SYNC_TIMEOUT_S  # the coordinator decides every round by then
BUCKET_BYTES = 1 << 18  # the 2.7 MB demo model in about ten buckets: a transfer has a middle
START_TIMEOUT_S = 420
ORPHAN_GRACE_S = 30  # after a replica is gone, for the kernel to deliver its engine's parent-death signal
# Ray only on the head offers it, so the ingress and the coordinator stay there
# (deployment.control_resource) and losing the worker host loses one replica, nothing else.
CONTROL_RESOURCE = "rollout-control"
# Shorter than Ray's defaults (about 30 s and 60 s) so a lost host is noticed within a
# sync step: the GCS declares a silent node dead after 5 missed health checks a second apart, and a
# raylet cut off from the GCS for 10 s exits (its workers, then their engines, with it).
HEAD_RAY_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000", "RAY_health_check_failure_threshold": "5"}
WORKER_RAY_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "10"}
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42] * 5]
N_TOKENS = 12


class FaultTrainer(Trainer):
    """tests/host_routes_trainer.py on the trainer host (the harness's Trainer runs
    tests/host_trainer.py)."""

    def __init__(self, hosts: Hosts, model_dir, env: dict[str, str]):
        import queue
        import subprocess
        import threading

        from tests.hosts import ROOT

        self.log = hosts.dir / "faults-trainer.log"
        self._err = open(self.log, "w")
        url = f"http://{HEAD_ADDRESS}:{HTTP_PORT}"
        argv = hosts.trainer.argv(sys.executable, "-u", "-m", "tests.host_routes_trainer", url, API_KEY, str(model_dir))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env, cwd=ROOT)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()


class Cluster:
    """The hosts, the platform on them and the trainer, for the module's scenarios."""

    def __init__(self, hosts: Hosts, trainer: FaultTrainer, env: dict[str, str]):
        self.hosts, self.trainer, self.env = hosts, trainer, env
        self.worker_ray = None
        self.starts = 0
        self.tokens: dict[int, list[list[int]]] = {}  # weights published (seed) -> greedy tokens per prompt
        self.seed = 0  # the seed of the committed version's weights

    def start_worker(self) -> None:
        self.starts += 1
        self.worker_ray = self.hosts.start_ray_worker({**self.env, **WORKER_RAY_ENV}, name=f"ray-worker-{self.starts}")
        assert self.worker_ray.wait_for("Ray runtime started", 120), self.hosts.logs()

    def status(self) -> dict:
        out = self.trainer.call(op="status", timeout_s=60)
        assert "committed_version" in out, out
        return out

    def generate(self, tag: str, rounds: int = 4) -> list[dict]:
        out = self.trainer.call(op="generate", prompts=PROMPTS, max_tokens=N_TOKENS, rounds=rounds, tag=tag, timeout_s=240)
        assert "results" in out, f"{out}\n{self.hosts.logs()}"
        return out["results"]

    def wait_until(self, what: str, check, timeout_s: float, every_s: float = 2.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            time.sleep(every_s)
        pytest.fail(f"{what}: not within {timeout_s:.0f}s\n{self.hosts.logs()}")

    def nodes_of_replicas(self) -> dict[str, str]:
        return self.hosts.replica_nodes(self.env)


def served(results: list[dict], version: int) -> tuple[list[list[int]], set[str]]:
    """The tokens each prompt got (the same from every replica and every round: greedy),
    checking that every token came from ``version``; and the replicas that served."""
    by_prompt: dict[int, list[int]] = {}
    for r in results:
        assert r["versions"] == [[version, 0, N_TOKENS]], f"every token from version {version}: {r}"
        want = by_prompt.setdefault(r["prompt"], r["tokens"])
        assert r["tokens"] == want, f"prompt {r['prompt']}: replica {r['replica']} served other tokens than another replica or round"
    return [by_prompt[i] for i in range(len(PROMPTS))], {r["replica"] for r in results}


@pytest.fixture(scope="module")
def cluster(model_dir):
    with made(worker=True) as hosts:
        started = []
        try:
            key_file = hosts.dir / "api-key"
            key_file.write_text(API_KEY + "\n")
            config = hosts.platform_config(
                model_dir, key_file, replicas=2,
                sync={"timeout_s": SYNC_TIMEOUT_S, "bucket_bytes": BUCKET_BYTES},
                # Serve's own health checks of the replicas, also shorter than the defaults (10 s, 30 s).
                deployment={"control_resource": CONTROL_RESOURCE, "health_check_period_s": 2.0, "health_check_timeout_s": 10.0},
            )  # fmt: skip
            config_path = hosts.dir / "rollout.yaml"
            config_path.write_text(yaml.safe_dump(config))
            env = hosts.cluster_env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN)
            head = hosts.start_ray_head({**env, **HEAD_RAY_ENV, "RAY_OVERRIDE_RESOURCES": json.dumps({CONTROL_RESOURCE: 1})})
            started.append(head)
            assert head.wait_for("Ray runtime started", 120), f"the Ray head did not start:\n{hosts.logs()}"
            trainer = FaultTrainer(hosts, model_dir, hosts.env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN))
            c = Cluster(hosts, trainer, env)
            c.start_worker()
            serve = hosts.serve(config_path, env)
            started.append(serve)
            assert serve.wait_for("serving ", START_TIMEOUT_S), f"rollout serve did not start within {START_TIMEOUT_S}s:\n{hosts.logs()}"
            assert trainer.answer(120) == {"ready": True}, hosts.logs()
            yield c
        finally:
            for p in reversed(started):
                if p is head:
                    p.stop(grace_s=30)
                else:
                    p.kill()  # `rollout serve`: the hosts are torn down next (Logged.kill)


def test_rollouts_reach_replicas_on_both_ray_hosts(cluster):
    nodes = cluster.nodes_of_replicas()
    assert sorted(nodes.values()) == [HEAD_ADDRESS, WORKER_ADDRESS], f"one replica on each Ray host: {nodes}"
    tokens, replicas = served(cluster.generate("v0"), version=0)
    assert replicas == set(nodes), f"requests reached only {replicas} of {nodes}"
    cluster.tokens[0] = tokens


def test_a_trainer_written_for_vllm_serve_drives_the_routes_into_both_hosts(cluster):
    nodes = cluster.nodes_of_replicas()
    first = cluster.trainer.call(op="routes", seed=1, timeout_s=300)
    assert first.get("version") == "1", f"{first}\n{cluster.hosts.logs()}"
    # The trainer counts every inference rank: a replica on each host and the coordinator's copy.
    assert first["world_size"] == 3 and first["master_address"] == "10.231.1.2", first
    tokens, replicas = served(cluster.generate("routes-1"), version=1)
    assert replicas == set(nodes)
    assert tokens != cluster.tokens[0], "the perturbed weights serve other tokens"
    cluster.tokens[1] = tokens
    # The checkpoint back through the same routes: exactly the tokens served before any
    # update, on both hosts, so what arrived is the weights as sent.
    second = cluster.trainer.call(op="routes", seed=0, timeout_s=300)
    assert second.get("version") == "2", f"{second}\n{cluster.hosts.logs()}"
    tokens, replicas = served(cluster.generate("routes-0"), version=2)
    assert replicas == set(nodes) and tokens == cluster.tokens[0]
    print(f"route publishes across hosts: {first['elapsed_s']:.1f}s, {second['elapsed_s']:.1f}s")


def publish_held(cluster, seed: int, fault) -> tuple[dict, str, int]:
    """Publish ``seed``'s weights, break something with the transfer held mid-way, let it go
    on; the publisher's answer, the held round and the version committed before it."""
    before = cluster.status()["committed_version"]
    cluster.trainer.send(op="publish", seed=seed, hold=True)
    held = cluster.trainer.answer(120)
    assert "held" in held, f"the transfer was to be held after its first bucket: {held}\n{cluster.hosts.logs()}"
    status = cluster.status()
    assert status["round_in_progress"] == held["held"], f"the round is open while held: {status}"
    fault()
    cluster.trainer.send(op="release")
    answer = cluster.trainer.answer(ROUND_DEADLINE_S + 60)
    return answer, held["held"], before


def check_decided(cluster, answer: dict, round_id: str, before: int, seed: int) -> int:
    """The publisher's answer came within the round's deadline, and is the decision: a
    committed version or a typed SyncError; returns the committed version."""
    assert answer["since_release_s"] < ROUND_DEADLINE_S, f"{answer}\n{cluster.hosts.logs()}"
    status = cluster.status()
    outcome = next((r for r in status["recent_rounds"] if r["round_id"] == round_id), None)
    # (A restore round may follow an abort: a member that received part of it reloads the committed weights.)
    assert outcome is not None and status["round_in_progress"] != round_id, f"{round_id} is decided: {status}"
    if "version" in answer:
        assert outcome["committed"] and answer["version"] == before + 1 == status["committed_version"], (answer, status)
        cluster.seed = seed
    else:
        assert "SyncError" in answer["error_types"], f"a typed error: {answer}"
        assert not outcome["committed"] and status["committed_version"] == before, (answer, status)
    return status["committed_version"]


def check_orphans(cluster, since: float) -> float:
    """No Ray or vLLM engine process of the worker host outlives its replica; the seconds
    from ``since`` until none was left."""
    hosts = cluster.hosts

    def none_left():
        left = hosts.engine_processes(hosts.worker) + hosts.worker.processes(RAY_PROCESS)
        return time.monotonic() if not left else None

    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (gone := none_left()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if gone is None:
        left = {pid: cmdline(pid)[:120] for pid in hosts.engine_processes(hosts.worker) + hosts.worker.processes(RAY_PROCESS)}
        pytest.fail(f"{len(left)} processes of the lost replica's host outlived it by {ORPHAN_GRACE_S}s: {left}\n{hosts.logs()}")
    return gone - since


def check_replaced(cluster, version: int, tag: str) -> None:
    """The worker host's replica is back on it, caught up before its first request, and
    both replicas serve the committed version's tokens."""
    # The coordinator's status first: one HTTP call, where listing the replicas' nodes starts
    # a Ray driver (seconds), asked only once the status holds.
    cluster.wait_until(
        "a replica on the worker host registered at the committed version",
        lambda: (s := cluster.status())
        and len(s["replicas"]) == 2
        and all(r["version"] == version for r in s["replicas"].values())
        and sorted(cluster.nodes_of_replicas().values()) == [HEAD_ADDRESS, WORKER_ADDRESS],
        START_TIMEOUT_S,
        every_s=1.0,
    )
    nodes = cluster.nodes_of_replicas()
    # Serve routes to the new replica once its constructor (which caught it up) returned
    # and the routers heard of it: until then the head's serves alone. Every token either
    # serves must be the committed version's.
    reached: set[str] = set()
    deadline = time.monotonic() + 120
    while reached != set(nodes) and time.monotonic() < deadline:
        tokens, replicas = served(cluster.generate(f"{tag}-{len(reached)}-{time.monotonic():.0f}"), version=version)
        assert tokens == cluster.tokens[cluster.seed]
        reached |= replicas
    assert reached == set(nodes), f"requests reached only {reached} of {nodes}"


def test_the_worker_host_s_ray_killed_mid_publish(cluster):
    hosts = cluster.hosts
    (lost,) = [rid for rid, ip in cluster.nodes_of_replicas().items() if ip == WORKER_ADDRESS]
    killed_at = {}

    def kill():
        assert hosts.engine_processes(hosts.worker), "the worker's replica runs its engine there"
        hosts.kill_ray(hosts.worker)
        killed_at["t"] = time.monotonic()

    seed = 1 - cluster.seed
    answer, round_id, before = publish_held(cluster, seed, kill)
    version = check_decided(cluster, answer, round_id, before, seed)
    orphans_s = check_orphans(cluster, killed_at["t"])
    # Every surviving replica serves the committed version.
    tokens, replicas = served(cluster.generate("after-kill"), version=version)
    assert lost not in replicas and len(replicas) == 1, replicas
    assert tokens == cluster.tokens[cluster.seed]
    print(f"worker's Ray killed mid-publish: {answer} {answer['since_release_s']:.1f}s after; engine processes gone {orphans_s:.1f}s after")
    # The host comes back: its replica is replaced there and catches up first.
    cluster.worker_ray.stop(grace_s=10)  # its `ray start` died with the rest
    cluster.start_worker()
    check_replaced(cluster, version, "after-kill-back")


def test_the_worker_host_s_link_cut_mid_publish(cluster):
    hosts = cluster.hosts
    (lost,) = [rid for rid, ip in cluster.nodes_of_replicas().items() if ip == WORKER_ADDRESS]
    seed = 1 - cluster.seed
    mended = None
    try:
        answer, round_id, before = publish_held(cluster, seed, lambda: hosts.cut(hosts.worker))
        version = check_decided(cluster, answer, round_id, before, seed)
        # The head's Ray declared the silent node dead (health checks): Serve routes around it.
        tokens, replicas = served(cluster.generate("after-cut"), version=version)
        assert lost not in replicas and len(replicas) == 1, replicas
        assert tokens == cluster.tokens[cluster.seed]
    finally:
        hosts.mend(hosts.worker)
        mended = time.monotonic()
    # Cut off, the host's raylet hears nothing (no RST on a dropped link), so its replica
    # runs on, unreachable; once the link is back it learns the cluster declared it dead
    # and exits, and its workers and their vLLM engines go with it.
    orphans_s = check_orphans(cluster, mended)
    print(f"worker's link cut mid-publish: {answer} {answer['since_release_s']:.1f}s after; its processes gone {orphans_s:.1f}s after the link came back")
    cluster.worker_ray.stop(grace_s=10)
    cluster.start_worker()
    check_replaced(cluster, version, "after-cut-back")


def test_the_trainer_host_s_link_cut_mid_publish(cluster):
    hosts = cluster.hosts
    seed = 1 - cluster.seed
    try:
        answer, round_id, before = publish_held(cluster, seed, lambda: hosts.cut(hosts.trainer))
        # The publisher cannot hear the decision: it gives up with a typed error, in time.
        assert answer.get("error_type") == "CoordinatorUnreachableError" and "SyncError" in answer["error_types"], f"{answer}\n{hosts.logs()}"
        assert answer["since_release_s"] < ROUND_DEADLINE_S, answer
        assert round_id in answer["message"] and "aborts at its deadline" in answer["message"], answer
    finally:
        hosts.mend(hosts.trainer)
    status = cluster.status()
    outcome = next(r for r in status["recent_rounds"] if r["round_id"] == round_id)
    assert not outcome["committed"] and status["committed_version"] == before, status
    tokens, replicas = served(cluster.generate("after-trainer-cut"), version=before)
    assert len(replicas) == 2 and tokens == cluster.tokens[cluster.seed], "the replicas kept the committed version"
    # With the link back, the next publish commits, and generation follows it.
    again = cluster.trainer.call(op="publish", seed=seed, timeout_s=ROUND_DEADLINE_S + 60)
    assert again.get("version") == before + 1, f"{again}\n{hosts.logs()}"
    cluster.seed = seed
    tokens, replicas = served(cluster.generate("after-trainer-mend"), version=before + 1)
    assert len(replicas) == 2 and tokens == cluster.tokens[seed]
    print(f"trainer's link cut mid-publish: {answer['error_type']} {answer['since_release_s']:.1f}s after; the next publish committed")
