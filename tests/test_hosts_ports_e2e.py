"""Which TCP ports the weight sync opens across hosts, pinned and firewalled.

Two parts, each in fresh network namespaces of its own, with nftables inside them
(tests/hosts_firewall.py): every new TCP connection is recorded per host and direction,
and with default-drop input the hosts admit exactly the ports docs/sync-ports.md
documents.

- A gloo group of two ranks on two bare hosts (no Ray): who listens and who connects
  (gloo's rule, read from its source: of a pair, the host with the higher address
  connects to the lower one's listener, whatever the ranks), and that
  ``net.ipv4.ip_local_port_range`` confines those listeners.
- The platform (tests/hosts.py: Ray head + ``rollout serve`` on the head host, a trainer
  outside the cluster): a ``WeightPublisher.http`` publish and a route session of a
  trainer written for ``vllm serve`` (vLLM's trainer-engine shape over the RL routes),
  measured, then through the documented rules only, then with one rule removed.

Needs root and nftables (``make netfilter``); skips without.

Also runs as ``python -m tests.test_hosts_ports_e2e route URL TOKEN MODEL_DIR SEED`` on
the trainer host: one route session (see :func:`route_session_main`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rollout.contracts.net import PortRange
from tests import hosts_firewall as fw
from tests.engines import TEST_MODEL
from tests.hosts import HEAD_ADDRESS, HTTP_PORT, ROOT, TRAINER_ADDRESS, CannotMakeHosts, Host, Hosts, _ip, made

API_KEY = "ports-key-0123456789"
SYNC_TOKEN = "ports-sync-token-0123456789"
SYNC_TIMEOUT_S = 15
START_TIMEOUT_S = 420
PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
N_TOKENS = 12

# The pins docs/sync-ports.md documents, as a deployment would set them:
HEAD_EPHEMERAL = PortRange(40000, 40999)  # engine pods: sysctl net.ipv4.ip_local_port_range
TRAINER_EPHEMERAL = PortRange(45000, 45999)  # trainer pods: the same sysctl
PUBLISHER_PORTS = PortRange(46000, 46009)  # trainer pods: ROLLOUT_PUBLISHER_PORTS
KEEPER_PORTS = PortRange(39000, 39009)  # the platform's sync.rendezvous_ports (inside the Ray cluster)

# The admitting rules' comments (each one documented in docs/sync-ports.md).
R_HTTP = "serve-http"
R_ENGINE_PAIRS = "gloo-pairs-engine"
R_RENDEZVOUS = "publisher-rendezvous"
R_TRAINER_PAIRS = "gloo-pairs-trainer"


def head_rules() -> list[fw.Allow]:
    return [
        fw.Allow(TRAINER_ADDRESS, HTTP_PORT, R_HTTP),
        # gloo's listeners on the engine side (replica workers, the coordinator's copy).
        fw.Allow(TRAINER_ADDRESS, HEAD_EPHEMERAL, R_ENGINE_PAIRS),
    ]


def trainer_rules() -> list[fw.Allow]:
    return [
        # The TCPStore of each round, of the copy group, of a route session.
        fw.Allow(HEAD_ADDRESS, PUBLISHER_PORTS, R_RENDEZVOUS),
        # gloo's listeners on the trainer (used where the trainer's address is the lower).
        fw.Allow(HEAD_ADDRESS, TRAINER_EPHEMERAL, R_TRAINER_PAIRS),
    ]


def crossing(conns: set[fw.Connection], source: str) -> set[fw.Connection]:
    return {c for c in conns if c.source == source}


# ---- part 1: a gloo group of two on two bare hosts ------------------------------------

LOW, HIGH = "10.233.1.1", "10.233.1.2"
LOW_EPHEMERAL, HIGH_EPHEMERAL = PortRange(41000, 41099), PortRange(42000, 42099)
STORE_PORT = 43000
PAIR_TIMEOUT_S = 5
GLOO_GIVES_UP_AFTER = 5  # times its timeout, for a connection whose SYNs are dropped (measured)
PAIR_SCRIPT = """
import json, sys, time, torch
from rollout.sync.backends.gloo_group import GlooGroup, Rendezvous
rank, master, port, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
t0 = time.monotonic()
try:
    g = GlooGroup(Rendezvous("ports", master, port, 2, timeout), rank)
    t = torch.arange(4, dtype=torch.float32) if rank == 0 else torch.zeros(4)
    g.broadcast(t)
    print(json.dumps({"tensor": t.tolist(), "elapsed_s": time.monotonic() - t0}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}", "elapsed_s": time.monotonic() - t0}))
"""


@pytest.fixture(scope="module")
def pair():
    """Two hosts joined by a veth pair, each its ephemeral range pinned: {address: Host}."""
    try:
        Hosts.check_possible()
        fw.check_possible()
    except (CannotMakeHosts, fw.NoNetfilter) as e:
        pytest.skip(str(e))
    tag = f"rolloutports{os.getpid()}"
    low, high = Host("low", f"{tag}-low", [LOW]), Host("high", f"{tag}-high", [HIGH])
    try:
        for h in (low, high):
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("link", "add", "eth0", "netns", low.ns, "type", "veth", "peer", "name", "eth0", "netns", high.ns)
        for h, ephemeral in ((low, LOW_EPHEMERAL), (high, HIGH_EPHEMERAL)):
            _ip("-n", h.ns, "addr", "add", f"{h.addresses[0]}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            fw.set_ephemeral_range(h, ephemeral)
        yield {LOW: low, HIGH: high}
    finally:
        for h in (low, high):
            h.stop_everything(grace_s=5)
            _ip("netns", "del", h.ns, check=False)


def run_pair(hosts: dict[str, Host], master: str) -> dict[int, dict]:
    """Rank 0 (the sender, hosting the store) on ``master``, rank 1 on the other host."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    env.pop("ROLLOUT_PUBLISHER_ADDRESS", None)
    worker = LOW if master == HIGH else HIGH
    procs = {}
    for rank, address in ((0, master), (1, worker)):
        argv = hosts[address].argv(sys.executable, "-c", PAIR_SCRIPT, str(rank), master, str(STORE_PORT), str(PAIR_TIMEOUT_S))
        procs[rank] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)
    out = {}
    for rank, p in procs.items():
        stdout, _ = p.communicate(timeout=PAIR_TIMEOUT_S * 4 + 60)
        out[rank] = json.loads(stdout.strip().splitlines()[-1])
    return out


def pair_rules(listener: str, peer: str, ephemeral: PortRange, store_host: str) -> dict[str, list[fw.Allow]]:
    """The documented rules for a group of two: the store's port on rank 0's host, and the
    pinned ephemeral range on the pair's listening side (the lower address)."""
    rules: dict[str, list[fw.Allow]] = {LOW: [], HIGH: []}
    rules[store_host].append(fw.Allow(LOW if store_host == HIGH else HIGH, STORE_PORT, "store"))
    rules[listener].append(fw.Allow(peer, ephemeral, "pairs"))
    return rules


@pytest.mark.parametrize("master", [HIGH, LOW], ids=["sender-on-the-higher-address", "sender-on-the-lower-address"])
def test_gloo_pairs_connect_from_the_higher_address_to_a_listener_in_the_lower_ones_pinned_range(pair, master):
    for h in pair.values():
        fw.apply(h, [], enforce=False)  # measure only
    out = run_pair(pair, master)
    assert out[0].get("tensor") == out[1].get("tensor") == [0.0, 1.0, 2.0, 3.0], out
    low_in, _, _ = fw.seen(pair[LOW])
    high_in, _, _ = fw.seen(pair[HIGH])
    store = fw.Connection(LOW if master == HIGH else HIGH, master, STORE_PORT)
    assert store in (low_in | high_in), "the other rank connected to rank 0's store"
    pairs_in = crossing(low_in, HIGH) - {store}
    # gloo: the higher address connects, the lower one listens, whichever is rank 0.
    assert len(pairs_in) == 1 and crossing(high_in, LOW) - {store} == set(), (low_in, high_in)
    (conn,) = pairs_in
    assert conn.port in LOW_EPHEMERAL, f"gloo's listener bound port {conn.port}, outside the pinned {LOW_EPHEMERAL}"
    print(f"rank 0 on {master}: store {store}; gloo pair {conn.source} -> {conn.destination}:{conn.port} (pinned {LOW_EPHEMERAL})")


def test_a_gloo_group_forms_through_the_documented_rules_and_fails_within_its_timeout_without_the_pair_rule(pair):
    rules = pair_rules(LOW, HIGH, LOW_EPHEMERAL, store_host=HIGH)
    for address, h in pair.items():
        fw.apply(h, rules[address])
    out = run_pair(pair, HIGH)
    assert out[0].get("tensor") == out[1].get("tensor") == [0.0, 1.0, 2.0, 3.0], out
    assert all(fw.seen(h)[2] == set() for h in pair.values()), "nothing was dropped"

    fw.remove(pair[LOW], "pairs")
    out = run_pair(pair, HIGH)
    for rank in (0, 1):
        assert "error" in out[rank], out
        # Bounded, but not by the group's timeout alone: measured here, gloo gives up a
        # dropped pair connection after about five times it (4 s: 20-22 s; 10 s: 50-51 s).
        assert out[rank]["elapsed_s"] < GLOO_GIVES_UP_AFTER * PAIR_TIMEOUT_S + 10, out
        # The error names this rank's address, the sysctl and the range to admit.
        assert "could not connect gloo's pairs" in out[rank]["error"] and f"{fw.EPHEMERAL_SYSCTL} (here " in out[rank]["error"], out
    _, _, dropped = fw.seen(pair[LOW])
    assert {c.port for c in dropped} <= set(range(LOW_EPHEMERAL.low, LOW_EPHEMERAL.high + 1)) and dropped, dropped
    print(f"without the pair rule: {out}")


# ---- part 2: the platform ------------------------------------------------------------


@pytest.fixture(scope="module")
def hosts():
    try:
        fw.check_possible()
    except fw.NoNetfilter as e:
        pytest.skip(str(e))
    with made() as h:
        # Before anything starts: every port bound to 0 from here on lands in these.
        fw.set_ephemeral_range(h.head, HEAD_EPHEMERAL)
        fw.set_ephemeral_range(h.trainer, TRAINER_EPHEMERAL)
        fw.apply(h.head, head_rules(), enforce=False)
        fw.apply(h.trainer, trainer_rules(), enforce=False)
        yield h


@pytest.fixture(scope="module")
def trainer(hosts, model_dir):
    key_file = hosts.api_key_file(API_KEY)
    config = {
        "model": {"path": str(model_dir), "device": "cpu", "dtype": "float32", **TEST_MODEL},
        "http": {"host": "0.0.0.0", "port": HTTP_PORT, "api_key_file": str(key_file)},
        "sync": {"timeout_s": SYNC_TIMEOUT_S, "rendezvous_ports": str(KEEPER_PORTS)},
        "metrics": {"enabled": False},
    }
    env = hosts.cluster_env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN)
    head, serve = hosts.start_platform(config, env)
    process = hosts.trainer_process(API_KEY, model_dir, hosts.env(ROLLOUT_SYNC_TOKEN=SYNC_TOKEN, ROLLOUT_PUBLISHER_PORTS=str(PUBLISHER_PORTS)))
    try:
        if not serve.wait_for("serving ", START_TIMEOUT_S):
            pytest.fail(f"rollout serve did not start within {START_TIMEOUT_S}s:\n{hosts.logs()}")
        assert process.answer(120) == {"ready": True}, hosts.logs()
        yield process
    finally:
        process.stop()
        serve.kill()  # the hosts are torn down next (Logged.kill)
        head.stop(grace_s=30)


@pytest.fixture(scope="module")
def served():
    return {}


def generate(trainer, hosts) -> tuple[list[list[int]], set[int]]:
    out = trainer.call(op="generate", prompts=PROMPTS, max_tokens=N_TOKENS)
    assert "tokens" in out, f"{out}\n{hosts.logs()}"
    return out["tokens"], {spans[0][0] for spans in out["versions"]}


def publish(trainer, seed: int) -> dict:
    return trainer.call(timeout_s=6 * SYNC_TIMEOUT_S + 60, op="publish", seed=seed)


def measured(hosts) -> dict[str, set[fw.Connection]]:
    head_in, _, head_dropped = fw.seen(hosts.head)
    trainer_in, _, trainer_dropped = fw.seen(hosts.trainer)
    return {
        "trainer->head": crossing(head_in, TRAINER_ADDRESS),
        "head->trainer": crossing(trainer_in, HEAD_ADDRESS),
        "dropped": head_dropped | trainer_dropped,
    }


def assert_within_documented(m: dict[str, set[fw.Connection]]) -> None:
    for c in m["trainer->head"]:
        assert c.port == HTTP_PORT or c.port in HEAD_EPHEMERAL, f"trainer -> head on an undocumented port: {c}"
    for c in m["head->trainer"]:
        assert c.port in PUBLISHER_PORTS or c.port in TRAINER_EPHEMERAL, f"head -> trainer on an undocumented port: {c}"


def test_a_publish_opens_only_the_documented_ports(trainer, hosts, served):
    served["checkpoint"], _ = generate(trainer, hosts)
    fw.reset(hosts.head)
    fw.reset(hosts.trainer)
    out = publish(trainer, seed=1)
    assert out.get("version") == 1, f"{out}\n{hosts.logs()}"
    time.sleep(2)  # the coordinator's copy goes after publish() returns (close() waits for it)
    m = measured(hosts)
    assert_within_documented(m)
    to_head = {c.port for c in m["trainer->head"]}
    to_trainer = {c.port for c in m["head->trainer"]}
    assert HTTP_PORT in to_head and {p for p in to_head if p in HEAD_EPHEMERAL}, f"HTTP and gloo's listeners on the head: {m}"
    # The round's store and the copy group's: both in ROLLOUT_PUBLISHER_PORTS.
    assert len({p for p in to_trainer if p in PUBLISHER_PORTS}) == 2, m
    # The trainer's address is the higher one: no gloo pair connects to it.
    assert not {p for p in to_trainer if p in TRAINER_EPHEMERAL}, m
    tokens, versions = generate(trainer, hosts)
    assert versions == {1} and tokens != served["checkpoint"]
    served["seed-1"] = tokens
    print(f"publish: trainer->head ports {sorted(to_head)}; head->trainer ports {sorted(to_trainer)}")


def run_route_session(hosts, model_dir, seed: int) -> dict:
    argv = hosts.trainer.argv(sys.executable, "-m", "tests.test_hosts_ports_e2e", "route", f"http://{HEAD_ADDRESS}:{HTTP_PORT}", SYNC_TOKEN, str(model_dir), str(seed))
    env = hosts.env(ROLLOUT_PUBLISHER_PORTS=str(PUBLISHER_PORTS))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=6 * SYNC_TIMEOUT_S + 120)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the route trainer printed nothing (rc {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_a_route_session_opens_only_the_documented_ports(trainer, hosts, served, model_dir):
    fw.reset(hosts.head)
    fw.reset(hosts.trainer)
    out = run_route_session(hosts, model_dir, seed=0)
    assert out.get("version") == 2, f"{out}\n{hosts.logs()}"
    m = measured(hosts)
    assert_within_documented(m)
    to_head = {c.port for c in m["trainer->head"]}
    to_trainer = {c.port for c in m["head->trainer"]}
    # The session's store (the trainer picked it from ROLLOUT_PUBLISHER_PORTS); the
    # replica's and the coordinator's copy's gloo listeners on the head.
    assert to_trainer == {out["master_port"]} and out["master_port"] in PUBLISHER_PORTS, m
    assert len({p for p in to_head if p in HEAD_EPHEMERAL}) >= 2, f"the replica's and the copy's listeners: {m}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {2} and tokens == served["checkpoint"], "the checkpoint's own weights serve its tokens"
    print(f"route session: trainer->head ports {sorted(to_head)}; head->trainer ports {sorted(to_trainer)}")


def test_publishing_works_through_exactly_the_documented_rules(trainer, hosts, served):
    fw.apply(hosts.head, head_rules(), enforce=True)
    fw.apply(hosts.trainer, trainer_rules(), enforce=True)
    out = publish(trainer, seed=1)
    assert out.get("version") == 3, f"{out}\n{hosts.logs()}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {3} and tokens == served["seed-1"]
    m = measured(hosts)
    assert m["dropped"] == set(), f"nothing the sync needs was dropped: {m['dropped']}"


def test_without_the_rendezvous_rule_a_publish_fails_fast_naming_the_address_port_and_setting(trainer, hosts, served):
    fw.remove(hosts.trainer, R_RENDEZVOUS)
    try:
        out = publish(trainer, seed=0)
    finally:
        fw.apply(hosts.trainer, trainer_rules(), enforce=True)
    assert out.get("error_type") == "PublisherUnreachableError", f"{out}\n{hosts.logs()}"
    assert out["elapsed_s"] < SYNC_TIMEOUT_S, f"took {out['elapsed_s']:.1f}s of the {SYNC_TIMEOUT_S}s deadline"
    assert out["address"] == TRAINER_ADDRESS and out["port"] in PUBLISHER_PORTS, out
    message = out["message"]
    assert f"{TRAINER_ADDRESS}:{out['port']}" in message and f"ROLLOUT_PUBLISHER_PORTS={PUBLISHER_PORTS}" in message, message
    assert "keep version 3" in message, message
    tokens, versions = generate(trainer, hosts)
    assert versions == {3} and tokens == served["seed-1"], "still the committed version"
    print(f"without {R_RENDEZVOUS}: {out['error_type']} in {out['elapsed_s']:.1f}s: {message}")


def test_without_the_engine_pair_rule_a_publish_fails_within_the_deadline_and_replicas_keep_their_version(trainer, hosts, served):
    fw.remove(hosts.head, R_ENGINE_PAIRS)
    try:
        out = publish(trainer, seed=0)
        _, _, dropped = fw.seen(hosts.head)
    finally:
        fw.apply(hosts.head, head_rules(), enforce=True)
    assert out.get("error_type") in ("SyncError", "PublisherUnreachableError"), f"{out}\n{hosts.logs()}"
    # The round's deadline bounds it (the publisher's send waits at most twice it).
    assert out["elapsed_s"] < 3 * SYNC_TIMEOUT_S, out
    assert "keep version 3" in out["message"], out
    # Names what to admit: the rendezvous answered, the transport's pairs did not.
    assert "the rendezvous answered" in out["message"] and "net.ipv4.ip_local_port_range" in out["message"], out
    assert dropped and all(c.port in HEAD_EPHEMERAL for c in dropped), dropped
    tokens, versions = generate(trainer, hosts)
    assert versions == {3} and tokens == served["seed-1"], "still the committed version"
    # With the rule back, the next publish commits.
    again = publish(trainer, seed=0)
    assert again.get("version") == 4, f"{again}\n{hosts.logs()}"
    tokens, versions = generate(trainer, hosts)
    assert versions == {4} and tokens == served["checkpoint"]
    print(f"without {R_ENGINE_PAIRS}: {out['error_type']} in {out['elapsed_s']:.1f}s: {out['message']}")


# ---- the route-session trainer (runs on the trainer host) -----------------------------


def route_session_main(url: str, token: str, model_dir: str, seed: int) -> None:
    """One session of a trainer written for ``vllm serve``: vLLM's HTTP weight-sync client
    shape (ours adds the sync token), the gloo trainer engine, its store on a port of
    ``ROLLOUT_PUBLISHER_PORTS``; prints the committed version and that port."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from rollout.contracts import net
    from rollout.sync.backends.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
    from rollout.sync.route_client import WeightRoutesClient
    from rollout.vllm_compat import tensors_source

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    if seed:
        g = torch.Generator().manual_seed(seed)
        tensors = {n: t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.1 if t.is_floating_point() else t for n, t in tensors.items()}

    routes = WeightRoutesClient(url, token=token, timeout=120)
    host = url.split("//", 1)[1].rsplit(":", 1)[0]
    port = net.free_port(net.publisher_ports())
    t0 = time.monotonic()
    try:
        world = routes.get_world_size()
        info = GlooTrainerInitInfo(master_address=net.own_address(toward=host), master_port=port, world_size=1 + world, rank=0, timeout_s=SYNC_TIMEOUT_S)
        engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=routes, source=tensors_source(tensors))
        engine.send_weights()
        engine.shutdown()
        print(json.dumps({"version": int(routes.weight_version()), "master_port": port, "elapsed_s": time.monotonic() - t0}), flush=True)
    except Exception as e:
        print(json.dumps({"error_type": type(e).__name__, "message": str(e), "master_port": port}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["route"]:
        sys.exit("usage: python -m tests.test_hosts_ports_e2e route URL TOKEN MODEL_DIR SEED")
    route_session_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
