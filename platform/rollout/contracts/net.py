"""Which address and port a process advertises for a transfer group, and whether a peer can reach one.

The one owner of that choice: the publisher's rendezvous (``master_address``), and the
address every rank's transport binds to and announces to its peers (gloo's pairs), come
from :func:`choose`. A host whose hostname resolves to loopback (``/etc/hosts`` mapping it
to 127.0.0.1, or Debian's 127.0.1.1) must not make a process on it advertise loopback to
peers on other hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import sys
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Optional

# Set by the operator where the choice below is wrong (e.g. a trainer with several
# interfaces whose route to the ingress is not the one the replicas reach it by).
ADDRESS_ENV = "ROLLOUT_PUBLISHER_ADDRESS"
# Set by an engine replica for its vLLM engine processes: they are not Ray workers, so
# they cannot ask Ray for their node's address themselves (see export_node_address).
NODE_ADDRESS_ENV = "ROLLOUT_NODE_ADDRESS"

# How long a rank keeps trying to reach a rendezvous before it reports it unreachable.
# The publisher starts listening just after the round opens, while replicas pause: a
# connection refused in the first moments is not yet an answer.
PROBE_S = 5.0
PROBE_RETRY_S = 0.1


@dataclass(frozen=True)
class Choice:
    """An address this process advertises, and why it is that one (for error messages)."""

    address: str
    source: str


# The ports a publisher (the trainer's side) hosts its rendezvous on, "LOW-HIGH": the
# TCPStore of each round and of the coordinator's copy. Unset: one the kernel picks from
# its ephemeral range. The transports' own listeners (gloo's pairs, NCCL's bootstrap)
# bind to port 0 and have no setting of their own: only the kernel's
# ``net.ipv4.ip_local_port_range`` (per network namespace, so per pod) confines them.
PORTS_ENV = "ROLLOUT_PUBLISHER_PORTS"
EPHEMERAL_SYSCTL = "net.ipv4.ip_local_port_range"
TRANSPORT_PORTS_HINT = (
    f"gloo's pairs and NCCL's bootstrap listen on ports each host's kernel picks from {EPHEMERAL_SYSCTL}, "
    "and every host's firewall or NetworkPolicy must admit that range from its peers (docs/sync-ports.md)"
)
_EPHEMERAL_PATH = "/proc/sys/net/ipv4/ip_local_port_range"


@dataclass(frozen=True)
class PortRange:
    """Inclusive TCP port range, written ``LOW-HIGH`` (a single port is ``N``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, setting: str) -> "PortRange":
        """``LOW-HIGH`` or ``N``; a ``ValueError`` naming ``setting`` otherwise."""
        low, sep, high = str(text).strip().partition("-")
        try:
            r = cls(int(low), int(high) if sep else int(low))
        except ValueError:
            raise ValueError(f"{setting}: {text!r} is not a port range; write LOW-HIGH, e.g. 40000-40099") from None
        if not 1 <= r.low <= r.high <= 65535:
            raise ValueError(f"{setting}: {text!r} must satisfy 1 <= LOW <= HIGH <= 65535")
        return r

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.low <= port <= self.high

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def publisher_ports() -> Optional[PortRange]:
    """:data:`PORTS_ENV`'s range, or None when unset."""
    text = os.environ.get(PORTS_ENV, "").strip()
    return PortRange.parse(text, PORTS_ENV) if text else None


def ephemeral_ports() -> Optional[PortRange]:
    """The kernel's ephemeral range in this process's network namespace (what a bind to
    port 0 picks from), or None where it cannot be read."""
    try:
        low, high = open(_EPHEMERAL_PATH).read().split()
        return PortRange(int(low), int(high))
    except (OSError, ValueError):
        return None


class NoFreePort(RuntimeError):
    """No port of a configured range could be bound on this host."""


def free_port(ports: Optional[PortRange] = None, setting: str = PORTS_ENV, taken: Collection[int] = ()) -> int:
    """A TCP port free on this host now: one of ``ports`` (tried in random order, so
    publishers sharing a host rarely race for the same one), or the kernel's pick from
    its ephemeral range when None. ``setting`` names where ``ports`` came from, for the
    error when every port of it is taken. ``taken``: ports already promised to a
    rendezvous that does not listen yet (a round's copy, bound only after the round):
    free now, but not for this one."""
    if ports is None:
        while True:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            if port not in taken:
                return port
    candidates = [p for p in range(ports.low, ports.high + 1) if p not in taken]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise NoFreePort(f"no free TCP port in {ports} ({setting}) on {socket.gethostname()}: widen the range or end what holds it")


def describe_port(port: int, ports: Optional[PortRange], setting: str = PORTS_ENV) -> str:
    """Where ``port`` came from, for an error that must say which setting moves it."""
    if ports is not None:
        return f"port {port} from {setting}={ports}"
    ephemeral = ephemeral_ports()
    where = f" ({EPHEMERAL_SYSCTL} {ephemeral})" if ephemeral else ""
    return f"port {port}, picked by the kernel from its ephemeral range{where}; set {setting} to a range the replicas' path admits"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"


def _udp_sockets(host: str, port: int) -> Iterator[tuple[socket.socket, Any]]:
    """A UDP socket for each address ``host`` resolves to, with that address; none where it
    does not resolve. Connecting or binding one sends nothing."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            yield s, sockaddr


def route_address(host: str) -> Optional[str]:
    """The address of the local interface that routes to ``host``, or None when no route
    does. A UDP socket's ``connect()`` only consults the routing table."""
    for s, sockaddr in _udp_sockets(host, 9):
        try:
            s.connect(sockaddr)
        except OSError:
            continue
        address = s.getsockname()[0]
        if address not in ("0.0.0.0", "::"):
            return address
    return None


def _ray_node_address() -> Optional[str]:
    # Only where Ray is already up: importing it only to learn that it is not costs seconds.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return None


def choose(toward: Optional[str] = None) -> Choice:
    """The address peers reach this process at, first that applies:

    1. ``ROLLOUT_PUBLISHER_ADDRESS``;
    2. this node's address in the Ray cluster (a Ray worker, or an engine process of a
       replica: :data:`NODE_ADDRESS_ENV`), which the cluster's nodes reach each other by;
    3. the address of the interface that routes to ``toward`` (for a publisher outside the
       cluster, the ingress's host; for a rank, the rendezvous), unless that route is
       loopback: a peer reached over loopback says nothing about where the others are;
    4. the hostname's address.
    """
    explicit = os.environ.get(ADDRESS_ENV)
    if explicit:
        return Choice(explicit, f"set by {ADDRESS_ENV}")
    node = os.environ.get(NODE_ADDRESS_ENV)
    if node:
        return Choice(node, f"this replica's node address in the Ray cluster ({NODE_ADDRESS_ENV})")
    node = _ray_node_address()
    if node:
        return Choice(node, "this node's address in the Ray cluster")
    if toward:
        routed = route_address(toward)
        if routed and not _is_loopback(routed):
            return Choice(routed, f"the address of the interface that routes to {toward}")
    hostname = socket.gethostname()
    return Choice(socket.gethostbyname(hostname), f"the address the hostname {hostname!r} resolves to")


def is_local(address: str) -> bool:
    """Whether ``address`` belongs to this host: the transports bind to what they announce."""
    for s, sockaddr in _udp_sockets(address, 0):
        try:
            s.bind(sockaddr)
            return True
        except OSError:
            continue
    return False


def own_address(toward: Optional[str] = None) -> str:
    """:func:`choose`'s address."""
    return choose(toward).address


def export_node_address() -> None:
    """Hand this process's node address to the child processes it starts that are not Ray
    workers (vLLM's engine core and its workers inherit the environment), so the transfer
    groups they join bind to it rather than to whatever the hostname resolves to."""
    node = _ray_node_address()
    if node and NODE_ADDRESS_ENV not in os.environ:
        os.environ[NODE_ADDRESS_ENV] = node


async def unreachable(address: str, port: int, within_s: float = PROBE_S) -> Optional[str]:
    """Why ``address:port`` cannot be reached over TCP, or None once a connection opens.

    Keeps trying for ``within_s`` (the listener may come up a moment after the round
    opens); each attempt has at most a second, so an address that drops packets fails
    in ``within_s`` too, not after the kernel's minutes of SYN retries.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        attempt = max(0.05, min(1.0, deadline - loop.time()))
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address, port), attempt)
        except asyncio.TimeoutError:
            why = f"no answer within {attempt:.1f}s"
        except OSError as e:
            why = f"{type(e).__name__}: {e.strerror or e}"
        else:
            writer.close()
            return None
        if loop.time() + PROBE_RETRY_S >= deadline:
            return why
        await asyncio.sleep(PROBE_RETRY_S)


class RendezvousUnreachable(Exception):
    """A transfer group's rendezvous (``target``, "address:port") took no connection."""

    def __init__(self, target: str, why: str, within_s: float):
        self.target = target
        super().__init__(f"cannot reach the transfer group's rendezvous at {target} from {socket.gethostname()} (tried for {within_s:.0f}s: {why})")


async def check_reachable(address: str, port: int, timeout_s: float) -> None:
    """Raise :class:`RendezvousUnreachable` unless ``address:port`` takes a connection
    within :data:`PROBE_S` (or ``timeout_s``, the round's deadline, when shorter).

    Joining a group whose rendezvous cannot be reached waits out the round's whole
    deadline (the store's timeout) and then fails without saying where it tried; this
    fails in seconds, naming the address, so the round aborts while the publisher waits.
    """
    within_s = min(PROBE_S, timeout_s)
    why = await unreachable(address, port, within_s)
    if why is not None:
        raise RendezvousUnreachable(f"{address}:{port}", why, within_s)


# NCCL picks its own interface for the bootstrap and socket transport (InfiniBand first,
# then any but loopback and docker), not the address a rank advertised: on a trainer
# whose first interface leads elsewhere it announces an address the replicas cannot
# reach, and every rank waits out the round. NCCL reads this once, at a process's first
# communicator, so it is set before that and never over an operator's own choice.
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"


def interface_of(address: str) -> Optional[str]:
    """The name of the local interface that holds ``address``, or None."""
    import psutil  # vLLM's dependency: present wherever an NCCL group is formed

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == address for a in addrs):
            return name
    return None


def pin_nccl_interface(choice: Choice) -> Optional[str]:
    """Make NCCL use the interface holding ``choice``'s address, unless the operator set
    :data:`NCCL_IFNAME_ENV` (kept as it is); returns the value set, or None where none was.
    Loopback is never pinned: a single-host group needs no choice made for it."""
    if os.environ.get(NCCL_IFNAME_ENV) or _is_loopback(choice.address):
        return None
    name = interface_of(choice.address)
    if name is None:
        raise RuntimeError(f"no interface of this host holds {choice.address} ({choice.source}): NCCL cannot be pointed at it; set {ADDRESS_ENV} to an address of this host")
    # "=" makes it an exact name, not a prefix (eth1 would also match eth10).
    os.environ[NCCL_IFNAME_ENV] = f"={name}"
    return os.environ[NCCL_IFNAME_ENV]
