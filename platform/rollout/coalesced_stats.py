"""vLLM's Prometheus stat logger, recording at most once per interval instead of per step.

vLLM's ``PrometheusStatLogger.record`` runs once per engine step: about 25 metric calls
(gauges, counters, the tokens-per-step histogram), plus about 13 for every request that
finished in the step. Through Ray's metrics each call is a few tens of microseconds in the
replica's process, on the cores the engine needs: on two cores that was about a tenth of
the engine's time at 64 concurrent requests. This wrapper keeps what the steps between two
records reported and hands vLLM's own ``record`` one summary per interval:

* scheduler stats: the newest step's (gauges are last values), with the per-step prefix
  cache counts summed over the interval;
* iteration stats: counts summed, per-request lists (time to first token, finished
  requests, ...) concatenated, so every counter and per-request histogram sees exactly what
  it would have seen step by step;
* the tokens-per-step histogram is still observed once per step (its meaning is per step).

A step whose stats carry anything this summary does not cover (connector, speculative
decoding, eviction or performance stats, multimodal cache stats) is recorded as it comes,
after what was pending. Pending stats are recorded at the latest ``FLUSH_S`` later, also
when the engine goes idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

FLUSH_S = 1.0

# IterationStats' fields and how the summary combines them; a vLLM that adds a field fails
# loudly here (tests/test_coalesced_stats.py) instead of dropping it silently.
SUMMED = ("num_generation_tokens", "num_preempted_reqs", "num_corrupted_reqs", "num_watermarked_reqs", "num_watermark_skipped_reqs", "num_not_watermarked_reqs")
CONCATENATED = ("finished_requests", "max_num_generation_tokens_iter", "n_params_iter", "time_to_first_tokens_iter", "inter_token_latencies_iter")
PROMPT_TOKEN_FIELDS = ("computed", "local_cache_hit", "external_kv_transfer", "cached_tokens", "total")
ITERATION_FIELDS = frozenset(SUMMED + CONCATENATED + ("iteration_timestamp", "prompt_token_stats"))
PREFIX_CACHE_SUMMED = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


def _uncovered(scheduler_stats: Any, mm_cache_stats: Any) -> bool:
    """Whether a step reports something the summary does not combine."""
    if mm_cache_stats is not None:
        return True
    if scheduler_stats is None:
        return False
    s = scheduler_stats
    return bool(
        s.connector_prefix_cache_stats is not None
        or s.spec_decoding_stats is not None
        or s.kv_connector_stats is not None
        or s.ec_connector_stats is not None
        or s.perf_stats is not None
        or s.kv_cache_eviction_events
        or s.prefix_cache_stats.hits_by_source
        or s.prefix_cache_stats.reset
    )


class _Pending:
    """What the steps since the last record reported, for one engine."""

    def __init__(self) -> None:
        self.scheduler: Optional[Any] = None
        self.prefix_counts = dict.fromkeys(PREFIX_CACHE_SUMMED, 0)
        self.iteration: Optional[Any] = None
        self.step_tokens: list[int] = []  # the tokens-per-step histogram's values

    def add(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.scheduler = scheduler_stats
            for k in PREFIX_CACHE_SUMMED:
                self.prefix_counts[k] += getattr(scheduler_stats.prefix_cache_stats, k)
        if iteration_stats is not None:
            self.step_tokens.append(iteration_stats.prompt_token_stats.computed + iteration_stats.num_generation_tokens)
            if self.iteration is None:
                self.iteration = iteration_stats
                return
            acc = self.iteration
            for k in SUMMED:
                setattr(acc, k, getattr(acc, k) + getattr(iteration_stats, k))
            for k in CONCATENATED:
                getattr(acc, k).extend(getattr(iteration_stats, k))
            for k in PROMPT_TOKEN_FIELDS:
                setattr(acc.prompt_token_stats, k, getattr(acc.prompt_token_stats, k) + getattr(iteration_stats.prompt_token_stats, k))
            acc.iteration_timestamp = iteration_stats.iteration_timestamp

    def summary(self) -> tuple[Optional[Any], Optional[Any]]:
        if self.scheduler is not None:
            for k, v in self.prefix_counts.items():
                setattr(self.scheduler.prefix_cache_stats, k, v)
        return self.scheduler, self.iteration


class _PerStepOnly:
    """Stands in for the tokens-per-step histogram while a summary is recorded: the
    wrapper observes that histogram once per step itself."""

    def observe(self, value: float) -> None:
        pass


def coalescing(logger_cls: type) -> type:
    """``logger_cls`` (vLLM's ``PrometheusStatLogger`` or a subclass) recording summaries."""

    class Coalesced(logger_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pending: dict[int, _Pending] = {}
            self._since = time.monotonic()
            self._flush_scheduled = False

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            if _uncovered(scheduler_stats, mm_cache_stats):
                self.flush()
                super().record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
                return
            self._pending.setdefault(engine_idx, _Pending()).add(scheduler_stats, iteration_stats)
            if time.monotonic() - self._since >= FLUSH_S:
                self.flush()
            elif not self._flush_scheduled:
                self._schedule_flush()

        def _schedule_flush(self) -> None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # outside an event loop: nothing would flush later
                self.flush()
                return
            self._flush_scheduled = True
            loop.call_later(FLUSH_S, self.flush)

        def flush(self) -> None:
            self._flush_scheduled = False
            self._since = time.monotonic()
            pending, self._pending = self._pending, {}
            for engine_idx, p in pending.items():
                scheduler_stats, iteration_stats = p.summary()
                per_step = self.histogram_iteration_tokens
                self.histogram_iteration_tokens = {idx: _PerStepOnly() for idx in per_step}
                try:
                    super().record(scheduler_stats, iteration_stats, None, engine_idx)
                finally:
                    self.histogram_iteration_tokens = per_step
                for tokens in p.step_tokens:
                    per_step[engine_idx].observe(tokens)

        def log(self) -> None:
            self.flush()
            super().log()

    Coalesced.__name__ = Coalesced.__qualname__ = f"Coalesced{logger_cls.__name__}"
    return Coalesced
