"""The ``python`` built-in tool (``calculator`` is :func:`rollout.tools.calculator.calculator`).

It runs inside a tool worker (:class:`rollout.tools.pool.ToolWorker`), which sets the
sandbox limits from ``tools.python`` when it starts.
"""

from __future__ import annotations

import logging

from rollout.tools.sandbox import SandboxLimits, run_python

logger = logging.getLogger(__name__)
_limits = SandboxLimits()
_told_isolation = False  # the isolation is said once per worker


def configure(limits: SandboxLimits) -> None:
    """Set the sandbox limits of this process's ``python`` calls (a worker does, once)."""
    global _limits
    _limits = limits


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, no new processes, a temporary working
    directory, limited time and memory) and return what it printed."""
    result = run_python(code, _limits)
    global _told_isolation
    if not _told_isolation and result.isolation is not None:
        _told_isolation = True
        if result.isolation == "audit":
            logger.warning("python tool: this kernel allows no network namespace; the audit hook alone refuses network access")
        else:
            logger.info("python tool: each call runs in a network namespace of its own")
    return result.text()
