"""The replica's stuck check (Serve's health probe), without an engine."""

from __future__ import annotations

import time

import pytest

from rollout.config import load_config
from rollout.engine.adapter import EngineAdapter
from rollout.engine.replica import RolloutEngine
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import SyncGate
from rollout.engine.validation import ModelLimits
from rollout.errors import EngineUnavailableError
from rollout.rewards import RewardScorer


class IdleEngine:
    errored = False

    async def check_health(self):
        return None

    def shutdown(self):
        pass


def replica(stuck_timeout_s: float, last_step_ago_s: float) -> RolloutEngine:
    r = object.__new__(RolloutEngine)  # the probe's state only: no vLLM engine behind it
    config = load_config({"model": {"path": "/models/x"}, "deployment": {"stuck_timeout_s": stuck_timeout_s}}, environ={})
    snapshot = SchedulerSnapshot()
    snapshot.last_step_monotonic = time.monotonic() - last_step_ago_s
    adapter = EngineAdapter(IdleEngine(), None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), snapshot)
    r._assemble(config, "r", adapter, SyncGate.over(None, config.sync, "r"), RewardScorer.from_config(config.rewards))
    r.admission.inflight.busy_since = time.monotonic() - last_step_ago_s
    return r


async def test_the_first_requests_after_a_slow_start_are_not_counted_as_stuck_from_the_engine_start():
    # The GPU smoke test's false alarm: the engine took 100 s to start and had never
    # stepped; the first requests then failed the probe at once ("no engine step for 103s").
    r = replica(stuck_timeout_s=60, last_step_ago_s=100)
    with r.admission.inflight.counted(3):
        await r.check_health()


async def test_requests_in_flight_with_no_engine_step_for_the_timeout_fail_the_probe():
    r = replica(stuck_timeout_s=60, last_step_ago_s=100)
    with r.admission.inflight.counted(3):
        r.admission.inflight.busy_since = time.monotonic() - 61  # they came 61 s ago, and no step since
        with pytest.raises(EngineUnavailableError, match="3 requests in flight but no engine step for 61s"):
            await r.check_health()
