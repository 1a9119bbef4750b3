"""How long a replica took to start, phase by phase (issue 41).

A replica's start is Serve placing its actor, then the constructor: vLLM's imports, its own
setup, the engine's config, the ``AsyncLLM`` (engine core process, model load, compile,
KV cache, CUDA graphs), the tokenizer, the tool workers, the coordinator's registration and
vLLM's OpenAI app. Each phase is logged at INFO as it ends, and the whole at the end in one
line; with metrics on, each phase is observed in ``rollout_replica_start_seconds{phase}``.

The first phase, ``process``, is the replica process's age when the constructor began:
Ray starting the worker, importing the deployment's module and handing it the arguments.
A worker Ray had started before the replica was placed (a prestarted idle worker) shows
more than that; the other phases are the constructor's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)

# Every cache an engine start fills, by its variable and a directory under one root: the chart's
# `compileCache` sets each to `<mountPath>/<dir>` (helm/.../_helpers.tpl, checked against this by
# tests/test_helm_chart.py), so a replica that starts again, or a scale-out on the same volume,
# starts warm. None of them is a factor of vLLM's compile-cache key.
COMPILE_CACHE_DIRS = {
    "VLLM_CACHE_ROOT": "vllm",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TVM_FFI_CACHE_DIR": "tvm-ffi",
    "CUDA_CACHE_PATH": "cuda",
}

# The phases in the order a start runs them (a phase a start skips is not reported).
PHASES = ("process", "import", "setup", "config", "engine", "tokenizer", "tools", "sync", "openai")


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``), or None where that cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22 (starttime, clock ticks since boot); the command name (field 2) may hold spaces.
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))


class StartPhases:
    """The phases of one replica's start, timed in the order they run."""

    def __init__(self, replica_id: str, clock=time.monotonic):
        self.replica_id = replica_id
        self._clock = clock
        self.began = clock()
        self.durations: dict[str, float] = {}
        age = process_age_s()
        if age is not None:
            self.record("process", age)

    def record(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"start phase {name!r} is not one of {PHASES}")
        self.durations[name] = seconds
        logger.info("replica %s start: %s took %.2fs", self.replica_id, name, seconds)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (recorded only when the block completes: a start
        that fails says so in its error, not with a duration)."""
        t0 = self._clock()
        yield
        self.record(name, self._clock() - t0)

    def total_s(self) -> float:
        """From the process's start (where known) to now."""
        return self.durations.get("process", 0.0) + (self._clock() - self.began)

    def summary(self) -> str:
        parts = ", ".join(f"{name} {self.durations[name]:.1f}s" for name in PHASES if name in self.durations)
        return f"started in {self.total_s():.1f}s ({parts})"

    def observe(self, metrics: Any) -> None:
        """Into ``rollout_replica_start_seconds`` (:class:`rollout.metrics.EngineMetrics`)."""
        for name in PHASES:
            if name in self.durations:
                metrics.start_phase(name, self.durations[name])
