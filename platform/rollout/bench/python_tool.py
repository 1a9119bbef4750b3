"""What one ``python`` tool call costs: the old sandbox (a plain child process) against
the new one (bubblewrap namespaces, seccomp and cgroups), per program.

* ``bare``: what the tool did before bubblewrap: ``python -I`` in a child process in a
  fresh temporary working directory, the sandbox's boot setting the same rlimits and then
  running the code, output over pipes. (The old boot
  also tried a user+network namespace and installed an audit hook; both are left out, so
  ``bare`` is the floor of what the old sandbox cost.)
* ``bubblewrap``: :meth:`rollout.tools.sandbox.Sandbox.run`, everything a call does today:
  the code into descriptors, the call's cgroup (where the host has them: ``auto``), the
  namespaces, the seccomp filter, the supervised pipes and the cleanup.

Each call is timed from the call to its result, and its output is checked (a path that
failed fast would look cheap). No model, no Ray. The paths take turns, the order rotated
every round, so drift of the machine hits both. Each timed call follows an untimed one of
its own path: a tool worker runs one sandbox call after call, and a call right after the
other path's is slower for it. The overhead is paired (each round's bubblewrap call minus
the bare call next to it), with a bootstrap 90% interval of its median.
"""

from __future__ import annotations

import json
import os
import platform as _stdlib_platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any, Callable

from rollout.bench.machine import machine
from rollout.stats_summary import median_interval, paired_ratios
from rollout.tools.sandbox import BOOT, Sandbox, SandboxLimits

ROUNDS = 30

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


def run(rounds: int = ROUNDS) -> dict[str, Any]:
    limits = SandboxLimits()
    sandbox = Sandbox(limits, cgroup_mode="auto")  # checked once when built, as a tool worker does
    paths = {"bare": lambda code: bare_run(code, limits), "bubblewrap": _sandbox_fn(sandbox)}
    names = list(paths)
    load_before = os.getloadavg()
    wall: dict[str, dict[str, list[float]]] = {p: {n: [] for n in names} for p in PROGRAMS}
    for program, (code, expected) in PROGRAMS.items():
        for name in names:
            _timed(paths[name], code, expected)  # warm-up: page cache, first cgroup, first bwrap
    for r in range(rounds):
        for program, (code, expected) in PROGRAMS.items():
            for name in names[r % len(names):] + names[: r % len(names)]:
                # Untimed, so that the timed call follows one of its own path, as in a tool
                # worker: a call right after the other path's ran several ms slower (each
                # leaves the kernel and caches in a state the other pays for).
                _timed(paths[name], code, expected)
                wall[program][name].append(round(_timed(paths[name], code, expected), 2))
    points = []
    for program in PROGRAMS:
        bare, bwrap = wall[program]["bare"], wall[program]["bubblewrap"]
        overhead = [b - a for a, b in zip(bare, bwrap)]
        ratios = paired_ratios(bwrap, bare)
        points.append(
            {
                "program": program,
                "wall_ms": {name: _summary(wall[program][name]) for name in names},
                "overhead_ms": _summary(overhead),
                "bubblewrap_vs_bare": _summary(ratios),
                "rounds_ms": wall[program],
            }
        )
    return {
        "benchmark": "python_tool",
        "rounds": rounds,
        "order": "interleaved: two calls of each path in turn (the second timed), the order rotated every round",
        "overhead": "paired: each round's bubblewrap call minus the bare call next to it; interval_90 is a bootstrap 90% interval of the median",
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
