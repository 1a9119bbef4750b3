"""Tool calls run on a pool of Ray actors, never on a replica's event loop.

Each replica starts its pool on the first tool call (``tools.workers`` actors, no CPU
reserved: they mostly wait on a sandboxed child). A worker runs one call at a time; a
call waits for an idle worker. A call past ``tools.timeout_s`` gets an error output and
its worker is killed (Ray starts it again), so a tool stuck in native code cannot hold
the pool. Whatever a tool does, the model gets text back: its output, or the error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

from rollout.tools import call_tool
from rollout.tools.sandbox import SandboxLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolOutcome:
    output: str  # what the model reads back
    error: Optional[str] = None


class ToolWorker:
    """A Ray actor that runs tool calls (see :class:`ToolPool`)."""

    def __init__(self, sandbox: dict[str, Any], output_chars: int):
        from rollout.tools import builtins

        builtins.configure(SandboxLimits(**sandbox))
        self.output_chars = output_chars
        self._functions: dict[str, Any] = {}

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

    def __init__(self, workers: int, timeout_s: float, sandbox: SandboxLimits, output_chars: int):
        self.size = workers
        self.timeout_s = timeout_s
        self._init = (asdict(sandbox), output_chars)
        self._idle: Optional[asyncio.Queue] = None

    @classmethod
    def from_config(cls, cfg) -> "ToolPool":
        p = cfg.python
        limits = SandboxLimits(
            wall_time_s=p.wall_time_s, cpu_time_s=p.cpu_time_s, memory_bytes=p.memory_mb << 20, file_bytes=p.file_mb << 20, output_chars=cfg.output_chars
        )
        return cls(cfg.workers, cfg.timeout_s, limits, cfg.output_chars)

    def _start(self) -> asyncio.Queue:
        import ray

        actor = ray.remote(ToolWorker).options(num_cpus=0, max_restarts=-1, max_task_retries=0)
        idle: asyncio.Queue = asyncio.Queue()
        for _ in range(self.size):
            idle.put_nowait(actor.remote(*self._init))
        logger.info("started %d tool workers", self.size)
        return idle

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
