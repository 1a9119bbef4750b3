"""cgroup limits for one ``python`` tool call: memory (tmpfs and memfd pages included),
processes and CPU, counted by the kernel for the call's whole process tree.

The rlimits the sandbox sets are per process; a cgroup is what bounds the tree. A tool
worker may create groups only where the host delegates them: cgroup v2 with ``memory`` and
``pids`` enabled below the worker's own group (or enableable by moving the worker into a
leaf of its own), or cgroup v1 hierarchies of those controllers that it may write.
:func:`detect` says which, or why neither; :class:`CallGroup` makes one call's group,
kills what is left in it and removes it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"
GROUP = "rollout-python"  # the worker's sub-tree of call groups


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    max_processes: int
    cpus: float = 1.0


class CgroupsUnavailable(RuntimeError):
    pass


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's group path, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Hierarchy:
    """Where call groups are made, and how limits are spelled there."""

    version = ""

    def make(self, name: str, limits: CgroupLimits) -> list[str]:
        raise NotImplementedError

    def procs_files(self, dirs: list[str]) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dirs]


class V2(Hierarchy):
    version = "v2"

    def __init__(self, base: str):
        self.base = base

    def make(self, name: str, limits: CgroupLimits) -> list[str]:
        d = os.path.join(self.base, name)
        os.mkdir(d)
        _write(os.path.join(d, "memory.max"), str(limits.memory_bytes))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
            _write(os.path.join(d, "memory.swap.max"), "0")
        _write(os.path.join(d, "pids.max"), str(limits.max_processes))
        if os.path.exists(os.path.join(d, "cpu.max")):
            _write(os.path.join(d, "cpu.max"), f"{int(limits.cpus * 100_000)} 100000")
        return [d]

    @classmethod
    def detect(cls) -> "V2":
        own = _own_paths().get("")
        if own is None or not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
            raise CgroupsUnavailable("no cgroup v2 hierarchy at /sys/fs/cgroup")
        mine = os.path.join(ROOT, own.lstrip("/"))
        base = os.path.join(mine, GROUP)
        with open(os.path.join(mine, "cgroup.controllers")) as f:
            offered = set(f.read().split())
        if not {"memory", "pids"} <= offered:
            raise CgroupsUnavailable(f"cgroup v2 offers {sorted(offered) or 'no controllers'} to {mine}, not memory and pids")
        try:
            os.makedirs(base, exist_ok=True)
            # A group with processes cannot hand controllers down ("no internal
            # processes"): the worker moves into a leaf of its own first.
            leaf = os.path.join(mine, "rollout-tool-worker")
            os.makedirs(leaf, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
            wanted = " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in offered)
            _write(os.path.join(mine, "cgroup.subtree_control"), wanted)
            _write(os.path.join(base, "cgroup.subtree_control"), wanted)
        except OSError as e:
            raise CgroupsUnavailable(f"cannot delegate cgroup v2 controllers below {mine}: {e}") from None
        return cls(base)


class V1(Hierarchy):
    version = "v1"

    def __init__(self, bases: dict[str, str]):
        self.bases = bases  # controller -> directory of this worker's call groups

    def make(self, name: str, limits: CgroupLimits) -> list[str]:
        dirs = {c: os.path.join(b, name) for c, b in self.bases.items()}
        for d in dirs.values():
            os.mkdir(d)
        mem = dirs["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(limits.memory_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(limits.memory_bytes))
        _write(os.path.join(dirs["pids"], "pids.max"), str(limits.max_processes))
        if "cpu" in dirs:
            _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), "100000")
            _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), str(int(limits.cpus * 100_000)))
        return list(dirs.values())

    @classmethod
    def detect(cls) -> "V1":
        own = _own_paths()
        bases = {}
        for c in ("memory", "pids", "cpu"):
            mount = os.path.join(ROOT, c)
            if c not in own or not os.path.exists(os.path.join(mount, "cgroup.procs")):
                if c == "cpu":
                    continue  # CPU time is bounded by RLIMIT_CPU in any case
                raise CgroupsUnavailable(f"no cgroup v1 {c} hierarchy at {mount}")
            base = os.path.join(mount, own[c].lstrip("/"), GROUP)
            try:
                os.makedirs(base, exist_ok=True)
                probe = os.path.join(base, f"probe-{uuid.uuid4().hex[:8]}")
                os.mkdir(probe)
                os.rmdir(probe)
            except OSError as e:
                if c == "cpu":
                    continue
                raise CgroupsUnavailable(f"cannot create cgroup v1 {c} groups under {os.path.dirname(base)}: {e}") from None
            bases[c] = base
        return cls(bases)


def detect() -> Hierarchy:
    """The hierarchy this process may make call groups in; CgroupsUnavailable says why none."""
    reasons = []
    for kind in (V2, V1):
        try:
            return kind.detect()
        except (CgroupsUnavailable, OSError) as e:
            reasons.append(str(e))
    raise CgroupsUnavailable("; ".join(reasons))


class CallGroup:
    """One call's groups: made before the sandbox starts, emptied and removed after."""

    def __init__(self, hierarchy: Hierarchy, limits: CgroupLimits):
        self.dirs = hierarchy.make(f"call-{uuid.uuid4().hex[:12]}", limits)
        self.version = hierarchy.version

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def join(self, pid: int) -> bool:
        """Move ``pid`` into the call's groups; False (logged) where the kernel refused."""
        try:
            for procs in self.procs_files:
                _write(procs, str(pid))
        except OSError as e:
            logger.warning("cannot move the sandbox's init %d into %s: %s", pid, self.dirs, e)
            return False
        return True

    def out_of_memory(self) -> bool:
        for d in self.dirs:
            for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                try:
                    with open(os.path.join(d, name)) as f:
                        for line in f:
                            k, _, v = line.partition(" ")
                            if k == key and int(v) > 0:
                                return True
                except (OSError, ValueError):
                    pass
        return False

    def close(self) -> None:
        """Kill whatever is left in the groups, then remove them."""
        deadline = time.monotonic() + 10
        for d in self.dirs:
            kill = os.path.join(d, "cgroup.kill")
            if os.path.exists(kill):
                try:
                    _write(kill, "1")
                except OSError:
                    pass
            while True:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                except OSError:
                    pids = []
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if time.monotonic() > deadline:
                    logger.warning("cgroup %s still holds %s after SIGKILL; leaving it", d, pids)
                    break
                time.sleep(0.01)
            try:
                os.rmdir(d)
            except OSError as e:
                logger.warning("cannot remove cgroup %s: %s", d, e)


def optional(mode: str) -> tuple[Optional[Hierarchy], str]:
    """The hierarchy for ``tools.python.cgroups`` = mode, and a line saying what was chosen.
    ``required`` raises CgroupsUnavailable where none can be had."""
    if mode == "off":
        return None, "cgroups off (tools.python.cgroups=off): rlimits only"
    try:
        h = detect()
    except CgroupsUnavailable as e:
        if mode == "required":
            raise
        return None, f"no cgroups ({e}): rlimits only"
    return h, f"cgroup {h.version}"
