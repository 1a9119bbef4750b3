"""The ``python`` built-in tool (``calculator`` is :func:`rollout.tools.calculator.calculator`).

It runs inside a tool worker (:class:`rollout.tools.pool.ToolWorker`), which sets the
sandbox limits from ``tools.python`` when it starts.
"""

from __future__ import annotations

from rollout.tools.sandbox import SandboxLimits, run_python

_limits = SandboxLimits()


def configure(limits: SandboxLimits) -> None:
    """Set the sandbox limits of this process's ``python`` calls (a worker does, once)."""
    global _limits
    _limits = limits


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, no new processes, a temporary working
    directory, limited time and memory) and return what it printed."""
    return run_python(code, _limits).text()
