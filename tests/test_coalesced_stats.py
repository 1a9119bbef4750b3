"""vLLM's Prometheus stat logger recording one summary per interval: every counter and
per-request histogram sees what per-step records would have shown (no Ray, no engine)."""

from __future__ import annotations

from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, PrefixCacheStats, SchedulerStats

from rollout import coalesced_stats
from rollout.coalesced_stats import ITERATION_FIELDS, PREFIX_CACHE_SUMMED, _Pending, coalescing


def test_the_summary_covers_every_field_vllm_reports_per_step():
    # A vLLM that adds a field to its per-step stats must fail here, not lose it silently.
    assert set(vars(IterationStats())) == ITERATION_FIELDS
    assert set(PREFIX_CACHE_SUMMED) <= set(vars(PrefixCacheStats()))


def step(generated: int, prompt: int, ttft: list[float], finished: int, queries: int, hits: int, running: int):
    it = IterationStats()
    it.num_generation_tokens = generated
    it.prompt_token_stats.computed = it.prompt_token_stats.total = prompt
    it.time_to_first_tokens_iter = list(ttft)
    it.finished_requests = [FinishedRequestStats(finish_reason="length") for _ in range(finished)] if finished else []
    sched = SchedulerStats(num_running_reqs=running, prefix_cache_stats=PrefixCacheStats(requests=1, queries=queries, hits=hits))
    return sched, it


class Recorder:
    """Stands in for vLLM's PrometheusStatLogger: what each record() saw."""

    def __init__(self, *args, **kwargs):
        self.records = []
        self.histogram_iteration_tokens = {0: self}
        self.per_step = []

    def observe(self, value):
        self.per_step.append(value)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        self.histogram_iteration_tokens[0].observe(-1)  # inside a summary this must go nowhere
        self.records.append((scheduler_stats, iteration_stats))

    def log(self):
        pass


async def test_steps_between_records_are_summed_and_the_per_step_histogram_keeps_each_step(monkeypatch):
    import asyncio

    monkeypatch.setattr(coalesced_stats, "FLUSH_S", 0.2)
    logger = coalescing(Recorder)()
    steps = [step(8, 16, [0.1, 0.2], 0, 16, 0, 2), step(8, 0, [], 0, 0, 0, 8), step(8, 4, [0.3], 2, 4, 4, 6)]
    for sched, it in steps:
        logger.record(sched, it)
    assert logger.records == [], "nothing is recorded per step"
    await asyncio.sleep(0.4)  # the engine went idle: the pending steps are recorded anyway
    assert logger.per_step == [24, 8, 12], "the tokens-per-step histogram still sees every step"
    assert len(logger.records) == 1
    sched, it = logger.records[0]
    assert it.num_generation_tokens == 24 and it.prompt_token_stats.total == 20 and it.prompt_token_stats.computed == 20
    assert it.time_to_first_tokens_iter == [0.1, 0.2, 0.3] and len(it.finished_requests) == 2
    assert sched.num_running_reqs == 6, "gauges take the newest step's value"
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits, sched.prefix_cache_stats.requests) == (20, 4, 3)


async def test_a_step_with_stats_the_summary_does_not_cover_is_recorded_as_it_comes(monkeypatch):
    monkeypatch.setattr(coalesced_stats, "FLUSH_S", 3600.0)
    logger = coalescing(Recorder)()
    logger.record(*step(8, 16, [], 0, 16, 0, 2))
    sched, it = step(8, 0, [], 0, 0, 0, 2)
    sched.prefix_cache_stats.reset = True
    logger.record(sched, it)
    assert [r[1].num_generation_tokens for r in logger.records] == [8, 8], "what was pending first, then the step itself"
