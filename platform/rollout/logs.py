"""The platform's own log lines in its Serve processes.

Serve configures only the ``ray.serve`` logger in a replica; the root logger stays at
WARNING, so ``rollout.*`` INFO lines (a replica's KV-cache size, registrations, sync
rounds, catch-up) would be dropped. Each deployment calls :func:`show_platform_logs`
first; the lines go to the process's stderr, which Ray keeps in the replica's log file
and streams to the driver.
"""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"


def show_platform_logs(level: int = logging.INFO) -> None:
    """Emit ``rollout.*`` records at ``level`` and above (idempotent). A handler of our own
    (stderr) is added only where the process's root logger has none: a host that logs
    already (a test run, an application embedding the classes) keeps getting the records
    through its own handlers."""
    ours = logging.getLogger("rollout")
    ours.setLevel(level)
    if logging.getLogger().handlers or any(getattr(h, "_rollout", False) for h in ours.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._rollout = True  # type: ignore[attr-defined]
    ours.addHandler(handler)
