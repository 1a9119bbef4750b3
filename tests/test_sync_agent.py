"""The replica-side sync agent's version gate, without an engine or a coordinator."""

from __future__ import annotations

import asyncio

import pytest

from rollout.errors import StaleWeightsError
from rollout.sync.agent import SyncAgent


async def test_a_request_waits_for_the_version_it_needs_and_fails_retryably_after_the_deadline(model_dir):
    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    waiter = asyncio.create_task(agent.wait_for_version(2, timeout_s=10))
    await asyncio.sleep(0.05)
    agent.version = 1
    await asyncio.sleep(0.05)
    assert not waiter.done(), "version 1 is not enough"
    agent.version = 2
    await asyncio.wait_for(waiter, 1)
    assert agent.committed == 2
    with pytest.raises(StaleWeightsError, match="version 3 did not arrive"):
        await agent.wait_for_version(3, timeout_s=0.2)


async def test_a_sync_loop_that_died_marks_the_replica_broken(model_dir):
    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))

    async def crash():
        raise RuntimeError("boom")

    agent._task = asyncio.create_task(crash())
    await asyncio.sleep(0.05)
    assert "boom" in agent.broken
