"""Engine state as vLLM's scheduler reports it, collected through vLLM's stat-logger hook."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional


class SchedulerSnapshot:
    """Latest scheduler numbers plus cumulative prefix-cache counters, shared with the
    replica, which reports them as its :class:`rollout.contracts.load.ReplicaLoad`."""

    def __init__(self, metrics: Optional[Any] = None) -> None:
        self._lock = threading.Lock()
        self.metrics = metrics  # rollout.metrics.EngineMetrics, when metrics are enabled
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        # The highest kv_cache_usage since the replica's current run of in-flight requests
        # began (new_busy_period), or, idle, in its last one: what a short burst of work
        # used, which a reader polling kv_cache_usage misses between two engine steps.
        self.kv_cache_usage_peak = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.last_step_monotonic = time.monotonic()
        self.last_step_wall = 0.0

    def update(self, scheduler_stats: Any) -> None:
        pcs = scheduler_stats.prefix_cache_stats
        queries, hits = (pcs.queries, pcs.hits) if pcs is not None else (0, 0)
        with self._lock:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            self.kv_cache_usage_peak = max(self.kv_cache_usage_peak, self.kv_cache_usage)
            self.prefix_cache_queries += queries
            self.prefix_cache_hits += hits
            self.last_step_monotonic = time.monotonic()
            self.last_step_wall = time.time()
        if self.metrics is not None:
            self.metrics.prefix_cache(queries, hits)

    def new_busy_period(self) -> None:
        """Requests arrived at a replica serving none: the peak starts again (the engine's
        next step reports what they use)."""
        with self._lock:
            self.kv_cache_usage_peak = 0.0

    def seconds_since_step(self) -> float:
        return time.monotonic() - self.last_step_monotonic


def stat_logger_factory(snapshot: SchedulerSnapshot):
    """A vLLM ``StatLoggerFactory`` feeding ``snapshot``; vLLM's own loggers stay enabled beside it."""
    # Here, not at the top: whatever imports the replica's module (the driver that deploys the
    # app, through rollout.app) would import vLLM and torch with it (issue 41).
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SnapshotLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats: Optional[Any], iteration_stats: Optional[Any], mm_cache_stats: Any = None, engine_idx: int = 0):
            if scheduler_stats is not None:
                snapshot.update(scheduler_stats)

        def log_engine_initialized(self):
            pass

    return _SnapshotLogger
