"""Tool calls run on a pool of Ray actors, never on a replica's event loop.

Each replica starts its pool when it starts (``tools.workers`` actors, no CPU reserved:
they mostly wait on a sandboxed child) and asks every worker what its ``python`` sandbox
gives; a worker that cannot build one fails the replica's start with the reason. A
worker runs one call at a time; a call waits for an idle worker. A call past
``tools.timeout_s`` gets an error output and its worker is killed (Ray starts it again),
so a tool stuck in native code cannot hold the pool. Whatever a tool does, the model gets
text back: its output, or the error.

Workers start with the platform's secrets (``ROLLOUT_API_KEY``, the sync token) blanked
in their environment by the actor's runtime environment, so neither a tool nor anything
that escapes a tool finds them there; with ``tools.worker_resource`` they run only on
nodes offering that resource (the chart's hardened tool worker group).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from rollout.tools import call_tool
from rollout.tools.sandbox import Isolation, SandboxLimits, SandboxUnavailable

logger = logging.getLogger(__name__)


# A worker's share of ``tools.worker_resource``: small, so a node offering it hosts many.
RESOURCE_SHARE = 0.001


@dataclass(frozen=True)
class ToolOutcome:
    output: str  # what the model reads back
    error: Optional[str] = None


@dataclass(frozen=True)
class SandboxReport:
    """A worker's answer to "what does your python sandbox give?": one of the two."""

    isolation: Optional[Isolation] = None
    unavailable: Optional[str] = None


@dataclass(frozen=True)
class PythonSandboxSpec:
    """How a worker builds its ``python`` sandbox (None in the pool: no python tool)."""

    limits: SandboxLimits
    bwrap: str = "bwrap"
    cgroups: str = "auto"
    uid_base: int = 200_000
    uid_count: int = 256


class ToolWorker:
    """A Ray actor that runs tool calls (see :class:`ToolPool`)."""

    def __init__(self, python: Optional[PythonSandboxSpec], output_chars: int, secret_env: tuple[str, ...] = ()):
        import os

        from rollout.tools import builtins

        for name in secret_env:  # blanked by the runtime environment; gone from os.environ too
            os.environ.pop(name, None)
        if python is not None:
            builtins.configure(python.limits, python.bwrap, python.cgroups, python.uid_base, python.uid_count)
        self.output_chars = output_chars
        self._functions: dict[str, Any] = {}

    def sandbox(self) -> SandboxReport:
        from rollout.tools import builtins

        try:
            return SandboxReport(isolation=builtins.isolation())
        except SandboxUnavailable as e:
            return SandboxReport(unavailable=str(e))

    def run(self, path: str, arguments: str) -> ToolOutcome:
        from rollout.rewards import import_function

        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return _failed(f"the arguments are not JSON: {e}")
        if not isinstance(args, dict):
            return _failed(f"the arguments must be a JSON object, got {type(args).__name__}")
        try:
            fn = self._functions.get(path) or self._functions.setdefault(path, import_function(path))
            out = call_tool(fn, args)
        except Exception as e:  # the tool failed: the model reads why
            return _failed(f"{type(e).__name__}: {e}")
        return ToolOutcome(clip(out if isinstance(out, str) else json.dumps(out, default=str), self.output_chars))


def clip(text: str, limit: int) -> str:
    """At most ``limit`` characters: the head and the tail (where a traceback says what
    went wrong), with what was cut in between."""
    if len(text) <= limit:
        return text
    note = f"\n[... {len(text) - limit} characters cut ...]\n"
    head = max(0, (limit - len(note)) // 2)
    return text[:head] + note + text[len(text) - (limit - len(note) - head):]


def _failed(error: str) -> ToolOutcome:
    return ToolOutcome(f"error: {error}", error=error[:2000])


class ToolPool:
    """One replica's tool workers."""

    def __init__(
        self,
        workers: int,
        timeout_s: float,
        python: Optional[PythonSandboxSpec],
        output_chars: int,
        secret_env: tuple[str, ...] = (),
        resource: Optional[str] = None,
    ):
        self.size = workers
        self.timeout_s = timeout_s
        self.python = python
        self.output_chars = output_chars
        self.secret_env = tuple(secret_env)
        self.resource = resource
        self._idle: Optional[asyncio.Queue] = None
        self._workers: list[Any] = []
        self.isolation: Optional[Isolation] = None  # the python sandbox, once start() has checked it

    @classmethod
    def from_config(cls, cfg, secret_env: tuple[str, ...] = ()) -> "ToolPool":
        p = cfg.python
        python = None
        if p.enabled:
            limits = SandboxLimits(
                wall_time_s=p.wall_time_s,
                cpu_time_s=p.cpu_time_s,
                memory_bytes=p.memory_mb << 20,
                file_bytes=p.file_mb << 20,
                disk_bytes=p.disk_mb << 20,
                max_processes=p.max_processes,
                output_chars=cfg.output_chars,
            )
            python = PythonSandboxSpec(limits, p.bwrap, p.cgroups, p.uid_base, p.uid_count)
        return cls(cfg.workers, cfg.timeout_s, python, cfg.output_chars, secret_env, cfg.worker_resource)

    def _start(self) -> asyncio.Queue:
        import ray

        options: dict[str, Any] = dict(num_cpus=0, max_restarts=-1, max_task_retries=0)
        # Blank, not unset: Ray merges a runtime environment's variables into the one the
        # worker process is started with, so these are empty from its first instruction.
        options["runtime_env"] = {"env_vars": {name: "" for name in self.secret_env}}
        if self.resource:
            options["resources"] = {self.resource: RESOURCE_SHARE}
        actor = ray.remote(ToolWorker).options(**options)
        idle: asyncio.Queue = asyncio.Queue()
        self._workers = [actor.remote(self.python, self.output_chars, self.secret_env) for _ in range(self.size)]
        for w in self._workers:
            idle.put_nowait(w)
        logger.info("started %d tool workers%s", self.size, f" on nodes offering {self.resource!r}" if self.resource else "")
        return idle

    async def start(self) -> Optional[Isolation]:
        """Start the workers and, with the python tool on, check every worker's sandbox:
        SandboxUnavailable (the first worker's reason) when any cannot build one."""
        if self._idle is None:
            self._idle = self._start()
        if self.python is None:
            return None
        reports: list[SandboxReport] = await asyncio.gather(*(w.sandbox.remote() for w in self._workers))
        for r in reports:
            if r.unavailable is not None:
                raise SandboxUnavailable(f"the python tool cannot start: {r.unavailable}")
        kinds = {r.isolation for r in reports}
        if len(kinds) > 1:
            logger.warning("tool workers differ in their sandboxes: %s", "; ".join(sorted(k.describe() for k in kinds)))
        self.isolation = reports[0].isolation
        logger.info("python tool sandbox: %s", self.isolation.describe())
        return self.isolation

    async def run(self, path: str, arguments: str) -> ToolOutcome:
        import ray

        if self._idle is None:
            self._idle = self._start()
        worker = await self._idle.get()
        try:
            return await asyncio.wait_for(worker.run.remote(path, arguments), self.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("a tool call ran past tools.timeout_s=%s; restarting its worker", self.timeout_s)
            ray.kill(worker, no_restart=False)
            return _failed(f"timed out after tools.timeout_s={self.timeout_s:g} s")
        except ray.exceptions.RayActorError as e:  # the worker died (Ray starts it again)
            return _failed(f"the tool worker died: {e}"[:500])
        finally:
            self._idle.put_nowait(worker)

    def close(self) -> None:
        import ray

        while self._idle is not None and not self._idle.empty():
            ray.kill(self._idle.get_nowait())
