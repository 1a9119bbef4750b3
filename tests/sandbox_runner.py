"""A tool worker's sandbox in a process of its own, for tests that attack it as a given
host user: ``python -m tests.sandbox_runner CGROUPS``, run as root or through ``setpriv``
as an unprivileged uid (as the chart runs its tool workers).

It builds one :class:`~rollout.tools.sandbox.Sandbox`, prints its isolation as a JSON
line, then runs each line of standard input (JSON: ``{"code": ...}``) and prints each
result as a JSON line. Nothing here checks anything: the test process does, from the host.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from rollout.tools.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(wall_time_s=60, cpu_time_s=5, memory_bytes=256 << 20, disk_bytes=8 << 20, max_processes=16, output_chars=20_000)


def main() -> None:
    try:
        sandbox = Sandbox(LIMITS, cgroup_mode=sys.argv[1])
    except SandboxUnavailable as e:
        print(json.dumps({"unavailable": str(e)}), flush=True)
        return
    print(json.dumps({"isolation": dataclasses.asdict(sandbox.isolation)}), flush=True)
    for line in sys.stdin:
        result = sandbox.run(json.loads(line)["code"])
        print(json.dumps({**dataclasses.asdict(result), "text": result.text()}), flush=True)


if __name__ == "__main__":
    main()
