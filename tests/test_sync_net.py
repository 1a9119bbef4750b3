"""Which address a process advertises for a transfer group (rollout.contracts.net), and the
probe that tells a replica in seconds that it cannot reach one. The choice across real
hosts (network namespaces) is in test_hosts_e2e.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
import types

import pytest

from rollout.contracts import net


@pytest.fixture
def host(monkeypatch):
    """A host whose hostname resolves to loopback, as /etc/hosts makes it on many machines,
    and whose interface toward 10.231.1.1 has 10.231.1.2; no Ray, nothing set."""
    for name in (net.ADDRESS_ENV, net.NODE_ADDRESS_ENV):
        # Set, then removed: monkeypatch restores what was there (nothing), also after
        # export_node_address() wrote it behind monkeypatch's back.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-7")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1" if name == "trainer-7" else pytest.fail(f"resolved {name}"))
    routes = {"10.231.1.1": "10.231.1.2", "127.0.0.1": "127.0.0.1"}
    monkeypatch.setattr(net, "route_address", lambda toward: routes.get(toward))
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    return monkeypatch


def test_a_publisher_outside_the_cluster_advertises_its_interface_toward_the_ingress_not_its_hostnames_address(host):
    chosen = net.choose(toward="10.231.1.1")
    assert chosen.address == "10.231.1.2"
    assert "routes to 10.231.1.1" in chosen.source


def test_an_ingress_reached_over_loopback_says_nothing_about_where_replicas_are_so_the_hostname_decides(host):
    chosen = net.choose(toward="127.0.0.1")
    assert chosen.address == "127.0.1.1" and "hostname 'trainer-7'" in chosen.source
    assert net.choose(toward="10.231.77.1").address == "127.0.1.1", "no route there: the hostname's"
    assert net.choose().address == "127.0.1.1"


def test_inside_the_ray_cluster_the_nodes_address_wins_over_the_route(host):
    ray = types.SimpleNamespace(is_initialized=lambda: True, util=types.SimpleNamespace(get_node_ip_address=lambda: "10.231.5.5"))
    host.setitem(sys.modules, "ray", ray)
    assert net.choose(toward="10.231.1.1") == net.Choice("10.231.5.5", "this node's address in the Ray cluster")
    # A replica hands it to vLLM's engine processes, which are not Ray workers.
    net.export_node_address()
    host.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    chosen = net.choose(toward="10.231.1.1")
    assert chosen.address == "10.231.5.5" and net.NODE_ADDRESS_ENV in chosen.source


def test_rollout_publisher_address_overrides_every_other_choice_and_says_so(host):
    host.setenv(net.NODE_ADDRESS_ENV, "10.231.5.5")
    host.setenv(net.ADDRESS_ENV, "10.231.9.9")
    chosen = net.choose(toward="10.231.1.1")
    assert chosen.address == "10.231.9.9" and net.ADDRESS_ENV in chosen.source


def unresolvable(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)  # no DNS query leaves this test


def test_the_route_is_read_from_the_routing_table(monkeypatch):
    assert net.route_address("127.0.0.1") == "127.0.0.1"
    unresolvable(monkeypatch)
    assert net.route_address("ingress.example") is None


def test_only_this_hosts_own_addresses_count_as_local(monkeypatch):
    assert net.is_local("127.0.0.1")
    assert not net.is_local("198.51.100.7")  # TEST-NET-2: on no interface here (only a bind is tried)
    unresolvable(monkeypatch)
    assert not net.is_local("trainer.example")


def test_every_rank_but_the_host_of_the_rendezvous_binds_gloo_to_the_chosen_address(host):
    from rollout.sync.backends.gloo_group import Rendezvous, local_address

    r = Rendezvous("g", "10.231.1.2", 4000, 3, 5.0)
    assert local_address(r, 0).address == "10.231.1.2", "rank 0 binds where it advertised"
    host.setenv(net.NODE_ADDRESS_ENV, "10.231.5.5")
    assert local_address(r, 1).address == "10.231.5.5", "an engine worker binds to its node's address"


def test_a_group_cannot_announce_an_address_of_another_host_and_says_which(monkeypatch):
    import torch.distributed as dist

    from rollout.sync.backends.gloo_group import GlooGroup, Rendezvous

    # 198.51.100.7 (TEST-NET-2) is on no interface here: gloo's bind fails, and before the
    # store, whose master would connect to that address (traffic to another host).
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: pytest.fail("the store was made before the address was checked"))
    with pytest.raises(RuntimeError, match=r"gloo cannot use '198.51.100.7' .*not an address of this host"):
        GlooGroup(Rendezvous("g", "198.51.100.7", net.free_port(), 2, 2.0), 0)


@pytest.fixture
def listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        yield s.getsockname()[1]


async def test_a_rendezvous_that_takes_a_connection_is_reachable_at_once(listening):
    t0 = time.monotonic()
    assert await net.unreachable("127.0.0.1", listening, within_s=5) is None
    assert time.monotonic() - t0 < 1


async def test_a_rendezvous_nobody_listens_at_is_unreachable_after_the_probe_window_not_the_rounds_deadline():
    port = net.free_port()
    t0 = time.monotonic()
    why = await net.unreachable("127.0.0.1", port, within_s=0.5)
    elapsed = time.monotonic() - t0
    assert why is not None and "ConnectionRefused" in why
    assert 0.4 <= elapsed < 1.5, elapsed
    with pytest.raises(net.RendezvousUnreachable, match=f"127.0.0.1:{port}") as e:
        await net.check_reachable("127.0.0.1", port, timeout_s=0.3)
    assert e.value.target == f"127.0.0.1:{port}"


async def test_a_listener_that_starts_a_moment_after_the_round_opens_is_still_reached():
    # The publisher starts listening just after the round opens, while replicas already probe.
    port = net.free_port()
    server = None

    async def listen_later():
        nonlocal server
        await asyncio.sleep(0.3)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)

    later = asyncio.create_task(listen_later())
    try:
        assert await net.unreachable("127.0.0.1", port, within_s=3) is None
    finally:
        await later
        server.close()


# ---- ports ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [("40000-40099", (40000, 40099)), (" 40000 - 40099 ", (40000, 40099)), ("40000", (40000, 40000))])
def test_a_port_range_is_low_dash_high_or_one_port(text, want):
    r = net.PortRange.parse(text, "the setting")
    assert (r.low, r.high) == want and str(r) == f"{want[0]}-{want[1]}"
    assert want[0] in r and want[1] in r and want[1] + 1 not in r and want[0] - 1 not in r


@pytest.mark.parametrize("text", ["", "abc", "40000-", "-5", "5-1", "0-10", "1-70000", "1.5-3"])
def test_a_bad_port_range_is_refused_naming_the_setting(text):
    with pytest.raises(ValueError, match=r"^ROLLOUT_PUBLISHER_PORTS: "):
        net.PortRange.parse(text, "ROLLOUT_PUBLISHER_PORTS")


def test_the_publishers_range_comes_from_its_environment_variable(monkeypatch):
    monkeypatch.delenv(net.PORTS_ENV, raising=False)
    assert net.publisher_ports() is None
    monkeypatch.setenv(net.PORTS_ENV, "46000-46009")
    assert net.publisher_ports() == net.PortRange(46000, 46009)
    monkeypatch.setenv(net.PORTS_ENV, "46009-46000")
    with pytest.raises(ValueError, match=net.PORTS_ENV):
        net.publisher_ports()


def free_run(n: int) -> int:
    """The first of ``n`` consecutive ports free now, below the kernel's ephemeral range
    (where connections of other tests beside this one do not take ports by themselves)."""
    import random

    low = 20000
    ephemeral = net.ephemeral_ports()
    high = min(29999, ephemeral.low - n) if ephemeral is not None else 29999
    for _ in range(200):
        base = random.randint(low, high)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in {low}-{high}")


def test_a_free_port_of_a_range_skips_the_ones_taken_and_says_which_setting_is_exhausted():
    base = free_run(3)
    held = []
    try:
        for port in (base, base + 1):
            s = socket.socket()
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                pytest.skip(f"port {port} is taken by something else")
            held.append(s)
        # Every port of the range but one taken: that one, every time.
        r = net.PortRange(base, base + 2)
        assert {net.free_port(r) for _ in range(10)} == {base + 2}
        with pytest.raises(net.NoFreePort, match=rf"no free TCP port in {base}-{base + 1} \(sync.rendezvous_ports\)"):
            net.free_port(net.PortRange(base, base + 1), "sync.rendezvous_ports")
    finally:
        for s in held:
            s.close()


def test_a_port_promised_to_a_rendezvous_not_listening_yet_is_not_picked_again():
    # The publisher names its copy's port before the round and binds it after: the
    # round's own rendezvous must not take it meanwhile (they shared one port in 1 of 10
    # publishes over a range of ten).
    base = free_run(2)
    r = net.PortRange(base, base + 1)
    assert {net.free_port(r, taken=(base,)) for _ in range(10)} == {base + 1}
    with pytest.raises(net.NoFreePort):
        net.free_port(r, taken=(base, base + 1))
    promised = net.free_port()
    assert all(net.free_port(taken=(promised,)) != promised for _ in range(20))


def test_without_a_range_the_kernel_picks_from_its_ephemeral_range():
    ephemeral = net.ephemeral_ports()
    assert ephemeral is not None, "Linux has /proc/sys/net/ipv4/ip_local_port_range"
    assert all(net.free_port() in ephemeral for _ in range(5))


def test_an_error_about_a_port_says_which_setting_moves_it():
    pinned = net.describe_port(46003, net.PortRange(46000, 46009))
    assert pinned == "port 46003 from ROLLOUT_PUBLISHER_PORTS=46000-46009"
    picked = net.describe_port(41234, None)
    assert "ephemeral range (net.ipv4.ip_local_port_range " in picked and "set ROLLOUT_PUBLISHER_PORTS" in picked


def test_a_publisher_takes_its_range_from_its_argument_or_the_environment(monkeypatch):
    from rollout.sync.publisher import WeightPublisher

    monkeypatch.setenv(net.PORTS_ENV, "46000-46009")
    assert WeightPublisher(None, "gloo", None).ports == net.PortRange(46000, 46009)
    assert WeightPublisher(None, "gloo", None, ports="47000-47001").ports == net.PortRange(47000, 47001)
    with pytest.raises(ValueError, match=r"^ports: '47001-47000'"):
        WeightPublisher(None, "gloo", None, ports="47001-47000")


def test_the_coordinators_rendezvous_range_is_checked_with_the_config():
    from pydantic import ValidationError

    from rollout.config import SyncConfig

    assert SyncConfig().rendezvous_port_range() is None
    assert SyncConfig(rendezvous_ports="39000-39009").rendezvous_port_range() == net.PortRange(39000, 39009)
    for bad in ("39009-39000", "39000-", "x"):
        with pytest.raises(ValidationError, match="rendezvous_ports"):
            SyncConfig(rendezvous_ports=bad)
