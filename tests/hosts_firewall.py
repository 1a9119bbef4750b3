"""Firewalls for the hosts of tests/hosts.py: nftables rules inside each network namespace.

One table per host, ``inet rollout_ports``:

- ``input``: new TCP connections are recorded (source, destination, port) in the set
  ``seen_in``, then admitted only by the rules given (each with a comment naming why),
  established traffic and loopback (a host's own address is reached over ``lo`` too);
  the rest is recorded in ``dropped`` and dropped, or accepted when the table only
  measures (``enforce=False``).
- ``output``: accepts everything, recording new connections in ``seen_out``.

So one table both measures which ports a round opens in each direction and enforces
exactly the documented ones. :func:`set_ephemeral_range` sets the namespace's
``net.ipv4.ip_local_port_range``, the only thing that confines ports gloo and NCCL bind
to 0.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from typing import Union

from rollout.contracts.net import EPHEMERAL_SYSCTL, PortRange
from tests.hosts import Host

TABLE = "rollout_ports"


class NoNetfilter(Exception):
    """nftables cannot be used here; the reason says why."""


@dataclass(frozen=True)
class Allow:
    """Admit new TCP connections from ``peer`` to ``ports``; ``why`` becomes the rule's comment."""

    peer: str
    ports: Union[int, PortRange]
    why: str

    def rule(self) -> str:
        ports = self.ports if isinstance(self.ports, int) else f"{self.ports.low}-{self.ports.high}"
        return f'ip saddr {self.peer} tcp dport {ports} accept comment "{self.why}"'


@dataclass(frozen=True)
class Connection:
    """A new TCP connection one table saw: ``source`` connected to ``destination:port``."""

    source: str
    destination: str
    port: int


def check_possible() -> None:
    if shutil.which("nft") is None:
        raise NoNetfilter("nftables' `nft` is not installed (`make netfilter` installs Debian's package)")


def _nft(host: Host, *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(host.argv("nft", *args), input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)} in {host.ns}: {done.stderr.strip()}")
    return done.stdout


def ruleset(allow: list[Allow], enforce: bool) -> str:
    key = "type ipv4_addr . ipv4_addr . inet_service; flags dynamic; size 65535;"
    rules = "\n".join(f"    {a.rule()}" for a in allow)
    record = "ct state new tcp flags syn add @{set} {{ ip saddr . ip daddr . tcp dport }}"
    return f"""
table inet {TABLE} {{
  set seen_in {{ {key} }}
  set seen_out {{ {key} }}
  set dropped {{ {key} }}
  chain input {{
    type filter hook input priority 0; policy {"drop" if enforce else "accept"};
    meta nfproto ipv4 {record.format(set="seen_in")}
    ct state established,related accept
    iif lo accept
{rules}
    meta l4proto tcp meta nfproto ipv4 {record.format(set="dropped")}
  }}
  chain output {{
    type filter hook output priority 0; policy accept;
    meta nfproto ipv4 {record.format(set="seen_out")}
  }}
}}
"""


def apply(host: Host, allow: list[Allow], enforce: bool = True) -> None:
    """Replace the host's table with one admitting ``allow`` (or, not enforcing, everything)."""
    check_possible()
    existing = _nft(host, "list", "tables")
    if f"inet {TABLE}" in existing:
        _nft(host, "delete", "table", "inet", TABLE)
    _nft(host, "-f", "-", stdin=ruleset(allow, enforce))


def remove(host: Host, why: str) -> None:
    """Delete the admitting rule whose comment is ``why``."""
    listed = json.loads(_nft(host, "-j", "-a", "list", "chain", "inet", TABLE, "input"))
    handles = [e["rule"]["handle"] for e in listed["nftables"] if "rule" in e and e["rule"].get("comment") == why]
    if len(handles) != 1:
        raise RuntimeError(f"{host.name}: {len(handles)} rules with the comment {why!r}")
    _nft(host, "delete", "rule", "inet", TABLE, "input", "handle", str(handles[0]))


def _elements(host: Host, name: str) -> set[Connection]:
    listed = json.loads(_nft(host, "-j", "list", "set", "inet", TABLE, name))
    found = set()
    for entry in listed["nftables"]:
        for element in entry.get("set", {}).get("elem", []):
            value = element["elem"]["val"] if isinstance(element, dict) and "elem" in element else element
            source, destination, port = value["concat"]
            found.add(Connection(source, destination, int(port)))
    return found


def seen(host: Host) -> tuple[set[Connection], set[Connection], set[Connection]]:
    """New TCP connections since the table was applied: (in, out, dropped)."""
    return _elements(host, "seen_in"), _elements(host, "seen_out"), _elements(host, "dropped")


def reset(host: Host) -> None:
    """Forget what the sets recorded (the rules stay)."""
    for name in ("seen_in", "seen_out", "dropped"):
        _nft(host, "flush", "set", "inet", TABLE, name)


def set_ephemeral_range(host: Host, ports: PortRange) -> None:
    """The namespace's ``net.ipv4.ip_local_port_range``: where a bind to port 0 lands."""
    done = subprocess.run(host.argv("sysctl", "-w", f"{EPHEMERAL_SYSCTL}={ports.low} {ports.high}"), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"sysctl in {host.ns}: {done.stderr.strip()}")


def listeners(host: Host) -> dict[int, str]:
    """TCP ports listening on a non-loopback address in the host's namespace, with the
    process holding each (``ss -tlnpH``)."""
    done = subprocess.run(host.argv("ss", "-tlnpH"), capture_output=True, text=True, timeout=30)
    out: dict[int, str] = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        if address.startswith("127.") or address in ("[::1]",):
            continue
        process = fields[5] if len(fields) > 5 else ""
        out[int(port)] = process.split('"')[1] if '"' in process else process
    return out
