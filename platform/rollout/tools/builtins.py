"""The ``python`` built-in tool (``calculator`` is :func:`rollout.tools.calculator.calculator`).

It runs inside a tool worker (:class:`rollout.tools.pool.ToolWorker`), which builds the
sandbox from ``tools.python`` when it starts. Where the sandbox cannot be built, the
worker keeps the reason: every call fails with it (and the replica, which asks each
worker first, refuses to start), so no call ever runs unsandboxed.
"""

from __future__ import annotations

from typing import Optional

from rollout.tools.sandbox import Isolation, Sandbox, SandboxLimits, SandboxUnavailable

_sandbox: Optional[Sandbox] = None
_unavailable: Optional[str] = "the python tool's sandbox was not configured in this process"


def configure(limits: SandboxLimits, bwrap: str = "bwrap", cgroup_mode: str = "auto", uid_base: int = 200_000, uid_count: int = 256) -> None:
    """Build this process's sandbox (a worker does, once); a failure is kept, not raised."""
    global _sandbox, _unavailable
    try:
        _sandbox, _unavailable = Sandbox(limits, bwrap, cgroup_mode, uid_base, uid_count), None
    except SandboxUnavailable as e:
        _sandbox, _unavailable = None, str(e)


def isolation() -> Isolation:
    """What this process's sandbox gives; SandboxUnavailable says why there is none."""
    if _sandbox is None:
        raise SandboxUnavailable(_unavailable)
    return _sandbox.isolation


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, no new privileges, a private temporary
    working directory, limited time and memory). Returns JSON: "status" ("ok", "exit code N"
    or "stopped: ... limit"), "stdout", and "stderr" and "truncated" when there are any."""
    if _sandbox is None:
        raise SandboxUnavailable(_unavailable)
    return _sandbox.run(code).text(_sandbox.limits.output_chars)
