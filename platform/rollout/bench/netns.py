"""Hosts on one machine for benchmarks: Linux network namespaces joined by veth pairs.

Each namespace is a host with its own interfaces and addresses; traffic between two of
them crosses a veth pair, so it goes through every layer a real link does above the
wire (addresses, routes, TCP), and nothing can use loopback to reach another host.
Everything a namespace runs is found by ``ip netns pids`` and ended by id, so a host is
torn down whole, also after a failure. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def why_not() -> Optional[str]:
    """Why network namespaces cannot be made here, or None where they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    return None


class Namespace:
    """One host: a network namespace with loopback up and, under ``/etc/netns/<name>/``,
    an ``/etc/hosts`` of its own (``ip netns exec`` mounts it over the machine's)."""

    def __init__(self, name: str):
        self.name = name

    def create(self, hosts_file: str) -> None:
        _ip("netns", "add", self.name)
        etc = Path("/etc/netns") / self.name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)
        _ip("-n", self.name, "link", "set", "lo", "up")

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        done = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def _signal_all(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.pids()

    def stop_everything(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every process here, SIGKILL to those left after ``grace_s``."""
        self._signal_all(signal.SIGTERM)
        if not self._wait_empty(grace_s):
            self._signal_all(signal.SIGKILL)
            self._wait_empty(10.0)

    def destroy(self) -> None:
        self.stop_everything()
        _ip("netns", "del", self.name, check=False)
        shutil.rmtree(Path("/etc/netns") / self.name, ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()  # only when empty: nobody else's
        except OSError:
            pass


def link(a: Namespace, a_address: str, b: Namespace, b_address: str, prefix: int = 24, device: str = "eth0") -> None:
    """A veth pair between ``a`` and ``b`` (``device`` on both sides), addressed and up."""
    _ip("link", "add", device, "netns", a.name, "type", "veth", "peer", "name", device, "netns", b.name)
    for ns, address in ((a, a_address), (b, b_address)):
        _ip("-n", ns.name, "addr", "add", f"{address}/{prefix}", "dev", device)
        _ip("-n", ns.name, "link", "set", device, "up")
