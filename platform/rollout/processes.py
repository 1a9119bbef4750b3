"""Ending a child process the same way everywhere: ask it to stop, wait, then force it."""

from __future__ import annotations

import subprocess


def end(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, up to ``grace_s`` seconds for ``proc`` to exit, then SIGKILL; its exit
    status. A process that already exited is only reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
