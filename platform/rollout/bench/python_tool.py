"""What one ``python`` tool call costs: the old sandbox (a plain child process), the
bubblewrap sandbox as its previous pass left it, and today's, per program.

* ``bare``: what the tool did before bubblewrap: ``python -I`` in a child process in a
  fresh temporary working directory, the sandbox's boot setting the same rlimits and then
  running the code, output over pipes. (The old boot
  also tried a user+network namespace and installed an audit hook; both are left out, so
  ``bare`` is the floor of what the old sandbox cost.)
* ``bubblewrap-before``: the bubblewrap sandbox as the previous pass left it (git
  ``bd40811``), kept here for comparison only (:class:`PreviousPass`): bubblewrap run as the
  worker itself (under a root worker, kuid 0), ``/proc`` unmasked, a ``/dev`` of
  bubblewrap's usual nodes, the code under a reaper of bubblewrap's, the process group killed
  at the end. It shares today's seccomp filter, boot script, cgroup hierarchy and binds, so
  what differs is what the second pass added around them.
* ``bubblewrap``: :meth:`rollout.tools.sandbox.Sandbox.run`, everything a call does today:
  the code into descriptors, the call's cgroup (where the host has them: ``auto``), the
  call's host uid (``setpriv`` under a root worker), the namespaces with ``/proc`` and
  ``/dev`` covered, the code as its namespace's init held by a pidfd, the seccomp filter,
  the supervised pipes and the cleanup.

Each call is timed from the call to its result, and its output is checked (a path that
failed fast would look cheap). No model, no Ray. The paths take turns, the order rotated
every round, so drift of the machine hits all of them. Each timed call follows an untimed
one of its own path: a tool worker runs one sandbox call after call, and a call right after
another path's is slower for it. Overheads are paired (each round's bubblewrap call minus
the bare call, or the previous pass's call, of the same round), with a bootstrap 90%
interval of their median. The second pass's goal (:data:`GOAL_MS`): at most that much over
the previous pass on ``print(6*7)``.
"""

from __future__ import annotations

import json
import os
import platform as _stdlib_platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

from rollout.bench.machine import machine
from rollout.stats_summary import median_interval, paired_ratios
from rollout.tools import cgroups
from rollout.tools.sandbox import BOOT, CGROUP_SLACK_BYTES, CGROUP_SLACK_PROCESSES, NOBODY, WORKDIR, Sandbox, SandboxLimits, _python_paths, _top_level_layout
from rollout.tools.seccomp_filter import compile_filter, program_fd

ROUNDS = 30
# The second pass's goal: today's sandbox at most this much slower than the previous pass's
# on GOAL_PROGRAM (median of the paired differences, judged by its 90% interval).
GOAL_MS = 5.0
GOAL_PROGRAM = "print(6*7)"
PATHS = ("bare", "bubblewrap-before", "bubblewrap")

# name -> (code, what it must print): a trivial call, a common import, a working-directory file.
PROGRAMS: dict[str, tuple[str, str]] = {
    "print(6*7)": ("print(6*7)", "42\n"),
    "import json, math": ("import json, math\nprint(json.dumps({'pi': round(math.pi, 4)}))", '{"pi": 3.1416}\n'),
    "write+read 1 MiB file": (
        "data = b'x' * (1 << 20)\n"
        "with open('blob.bin', 'wb') as f:\n    f.write(data)\n"
        "with open('blob.bin', 'rb') as f:\n    print(len(f.read()))",
        "1048576\n",
    ),
}

def bare_run(code: str, limits: SandboxLimits) -> str:
    """The old sandbox's cost: a child process in a fresh working directory; its stdout."""
    with tempfile.TemporaryDirectory(prefix="rollout-bench-python-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        # The sandbox's own boot (the same rlimits), run with no sandbox around it.
        proc = subprocess.run(
            [sys.executable, "-I", BOOT, json.dumps(asdict(limits)), "main.py"],
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=limits.wall_time_s,
            start_new_session=True,  # as the old sandbox: its own process group
        )
    if proc.returncode != 0:
        raise RuntimeError(f"bare call failed ({proc.returncode}): {proc.stderr[-400:]}")
    return proc.stdout


class PreviousPass:
    """The bubblewrap sandbox as its previous pass (git ``bd40811``) ran a call, for the
    benchmark only: that pass's command line and supervision, with today's seccomp filter,
    boot script, cgroup hierarchy and interpreter binds (``Sandbox`` no longer builds this)."""

    def __init__(self, sandbox: Sandbox):
        self.bwrap = sandbox.bwrap
        self._cgroups = sandbox._cgroups  # the hierarchy today's sandbox detected: the same groups
        self._seccomp = compile_filter()
        with open(BOOT, "rb") as f:
            self._boot = f.read()
        self._layout = _top_level_layout()
        self._python = [arg for path in _python_paths() for arg in ("--ro-bind", path, path)]

    def _command(self, fds: dict[str, int], limits: SandboxLimits) -> list[str]:
        env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [self.bwrap]  # as the worker itself
        cmd += ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--disable-userns"]
        cmd += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
        cmd += ["--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
        cmd += ["--ro-bind", "/usr", "/usr", *self._layout]
        if os.path.exists("/etc/ld.so.cache"):
            cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        cmd += ["--size", str(limits.disk_bytes), "--perms", "0700", "--tmpfs", WORKDIR, "--chdir", WORKDIR]
        cmd += self._python
        cmd += ["--ro-bind-data", str(fds["boot"]), "/sandbox/boot.py", "--ro-bind-data", str(fds["code"]), "/sandbox/main.py"]
        cmd += ["--seccomp", str(fds["seccomp"]), "--remount-ro", "/"]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        return cmd + [sys.executable, "-I", "-B", "-X", "utf8", "/sandbox/boot.py", json.dumps(asdict(limits))]

    def run(self, code: str, limits: SandboxLimits) -> str:
        """One call; its stdout (raises when it did not exit 0)."""
        fds = {"boot": program_fd(self._boot), "code": program_fd(code.encode()), "seccomp": program_fd(self._seccomp)}
        group = None
        try:
            cmd = self._command(fds, limits)
            if self._cgroups is not None:
                group = cgroups.CallGroup(
                    self._cgroups,
                    cgroups.CgroupLimits(memory_bytes=limits.memory_bytes + limits.disk_bytes + CGROUP_SLACK_BYTES, max_processes=limits.max_processes + CGROUP_SLACK_PROCESSES),
                )
                join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
                cmd = ["/bin/sh", "-c", join, "sh", *group.procs_files, "--", *cmd]
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=list(fds.values()), env={"PATH": "/usr/bin:/bin"}, start_new_session=True
            )
            try:
                stdout, stderr = proc.communicate(timeout=limits.wall_time_s)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # that pass's end: the process group
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        finally:
            for fd in fds.values():
                os.close(fd)
            if group is not None:
                group.close()
        if proc.returncode != 0:
            raise RuntimeError(f"previous pass's call failed ({proc.returncode}): {stderr[-400:]!r}")
        return stdout.decode()


def _sandbox_fn(sandbox: Sandbox) -> Callable[[str], str]:
    def fn(code: str) -> str:
        result = sandbox.run(code)
        if not result.ok:
            raise RuntimeError(f"bubblewrap call failed: {result.text()[-400:]}")
        return result.stdout

    return fn


def _timed(fn: Callable[[str], str], code: str, expected: str) -> float:
    """Milliseconds of one call, from the call to its checked result. (Wall time only: the
    sandbox kills its process group before bubblewrap reaps the code's process, so the
    children's CPU time is not reliably counted on this side.)"""
    t0 = time.perf_counter()
    out = fn(code)
    ms = (time.perf_counter() - t0) * 1000
    if out != expected:
        raise RuntimeError(f"expected {expected!r}, got {out!r}")
    return ms


def _summary(values: list[float]) -> dict[str, Any]:
    lo, hi = median_interval(values)
    return {"median": round(statistics.median(values), 2), "interval_90": [round(lo, 2), round(hi, 2)]}


def _goal_met(overhead_interval: list[float]) -> Optional[bool]:
    """Whether today's sandbox stays within :data:`GOAL_MS` of the previous pass: True when
    the paired overhead's 90% interval lies at or under it, False when it lies over it, None
    when it spans it (this run does not tell)."""
    low, high = overhead_interval
    if low > GOAL_MS:
        return False
    return True if high <= GOAL_MS else None


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    limits = SandboxLimits()
    sandbox = Sandbox(limits, cgroup_mode="auto")  # checked once when built, as a tool worker does
    before = PreviousPass(sandbox)
    paths = {"bare": lambda code: bare_run(code, limits), "bubblewrap-before": lambda code: before.run(code, limits), "bubblewrap": _sandbox_fn(sandbox)}
    names = list(PATHS)
    load_before = os.getloadavg()
    wall: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in PROGRAMS}
    try:
        for program, (code, expected) in PROGRAMS.items():
            for name in names:
                _timed(paths[name], code, expected)  # warm-up: page cache, first cgroup, first bwrap
        for r in range(rounds):
            for program, (code, expected) in PROGRAMS.items():
                for name in names[r % len(names):] + names[: r % len(names)]:
                    # Untimed, so that the timed call follows one of its own path, as in a tool
                    # worker: a call right after another path's ran several ms slower (each
                    # leaves the kernel and caches in a state the other pays for).
                    _timed(paths[name], code, expected)
                    wall[program][name].append(round(_timed(paths[name], code, expected), 2))
    finally:
        sandbox.close()  # the uid lease, under a root worker
    points = []
    for program in PROGRAMS:
        bare, previous, bwrap = (wall[program][name] for name in PATHS)
        point = {
            "program": program,
            "wall_ms": {name: _summary(wall[program][name]) for name in names},
            "overhead_ms": _summary([b - a for a, b in zip(bare, bwrap)]),
            "bubblewrap_vs_bare": _summary(paired_ratios(bwrap, bare)),
            "before_overhead_ms": _summary([b - a for a, b in zip(bare, previous)]),
            "vs_before_ms": _summary([b - a for a, b in zip(previous, bwrap)]),
            "rounds_ms": wall[program],
        }
        points.append(point)
    goal_point = next(p for p in points if p["program"] == GOAL_PROGRAM)
    return {
        "benchmark": "python_tool",
        "rounds": rounds,
        "order": "interleaved: two calls of each path in turn (the second timed), the order rotated every round",
        "overhead": "paired: each round's bubblewrap call minus the bare call next to it; interval_90 is a bootstrap 90% interval of the median",
        "vs_before": "paired: each round's bubblewrap call minus the bubblewrap-before call (the previous pass, git bd40811) of the same round",
        "goal": f"today's sandbox at most +{GOAL_MS:g} ms over the previous pass on {GOAL_PROGRAM}",
        "goal_met": _goal_met(goal_point["vs_before_ms"]["interval_90"]),
        "limits": asdict(limits),
        "bubblewrap": sandbox.version,
        "isolation": sandbox.isolation.label,
        "isolation_detail": sandbox.isolation.describe(),
        # Only what this benchmark runs on: no vLLM, torch or Ray is involved.
        "machine": {**machine(packages=False), "kernel": _stdlib_platform.release()},
        # Calls of tens of ms move with whatever else the machine runs: say how busy it was.
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "points": points,
    }
