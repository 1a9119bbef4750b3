"""The replica-side sync agent's version gate, without an engine or a coordinator."""

from __future__ import annotations

import asyncio

import pytest

from rollout.errors import StaleWeightsError
from rollout.sync.agent import SyncAgent
from rollout.sync.protocol import RoundRequest


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


class RecordingEngine:
    """Stands in for vLLM's AsyncLLM: records the protocol calls the agent makes."""

    def __init__(self):
        self.calls = []

    async def get_weight_version(self):
        return "0"

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, *args, *kwargs.values()))

        return call


class InProcess:
    """The real coordinator, called in-process the way a Serve handle would."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def __getattr__(self, name):
        method = getattr(self.coordinator, name)
        return type("Method", (), {"remote": staticmethod(method)})


async def test_a_replica_that_starts_behind_a_committed_checkpoint_reloads_it_before_serving(model_dir):
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5}}, "nccl")
    coordinator._token = None
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("a", 1, 0, specs)
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1, checkpoint="/shared/policy-v1"))
    asyncio.get_running_loop().create_task(coordinator.report(plan.round_id, "a", None))
    finish = asyncio.create_task(coordinator.finish(plan.round_id))
    await asyncio.sleep(0.05)
    await coordinator.applied(plan.round_id, "a", 1)
    assert (await finish).committed

    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="b", ranks=1, model_path=str(model_dir))
    await agent.start()
    agent.stop()
    assert agent.version == 1 and not agent.broken
    assert [c[0] for c in engine.calls] == ["pause_generation", "collective_rpc", "update_weight_version", "resume_generation"]
    assert engine.calls[1] == ("collective_rpc", "reload_weights", {"weights_path": "/shared/policy-v1"})
    assert engine.calls[2] == ("update_weight_version", "1")


class BlockedEngine(RecordingEngine):
    """vLLM's AsyncLLM whose worker is stuck in a collective: update_weights never returns."""

    async def update_weights(self, *args, **kwargs):
        self.calls.append(("update_weights",))
        await asyncio.Event().wait()


async def blocked_round(model_dir, monkeypatch, backend: str):
    """A round of ``backend`` whose replica's engine never returns from update_weights."""
    import rollout.sync.agent as agent_module
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    monkeypatch.setattr(agent_module, "WEDGED_GRACE_S", 0.2)
    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 0.5}}, backend)
    coordinator._token = None
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("a", 1, 0, specs)
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1))
    engine = BlockedEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    return agent, engine, plan


async def test_an_engine_blocked_in_a_transfer_marks_the_replica_for_replacement_and_calls_it_no_more(model_dir, monkeypatch):
    # NCCL has no deadline: after a trainer dies mid-broadcast, the replica's worker waits
    # forever and every later engine call (finish, pause, reload) would queue behind it.
    agent, engine, plan = await blocked_round(model_dir, monkeypatch, "nccl")

    assert await asyncio.wait_for(agent._apply(plan), 10) is False
    assert "the engine did not finish receive within 1s" in agent.broken and "must be replaced" in agent.broken
    assert [c[0] for c in engine.calls] == ["pause_generation", "init_weight_transfer_engine", "start_weight_update", "update_weights"]
    assert agent.version == 0


async def test_with_gloo_a_late_engine_call_is_an_ordinary_failure_the_replica_recovers_from(model_dir, monkeypatch):
    # gloo ends a step whose peer is gone by itself (its timeouts), only later than the
    # round's deadline on a busy host: the replica closes the update and restores, as usual.
    agent, engine, plan = await blocked_round(model_dir, monkeypatch, "gloo")

    assert await asyncio.wait_for(agent._apply(plan), 10) is False
    assert agent.broken is None
    assert [c[0] for c in engine.calls][-2:] == ["update_weights", "finish_weight_update"]


async def test_a_round_under_a_trainers_pause_resets_the_prefix_cache_and_keeps_the_hold(model_dir):
    """vLLM's RL routes, coordinator and agent in one process: a trainer's /pause (keep,
    no cache clearing) must not let prefixes cached under the old weights survive an update."""
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5}}, "nccl")
    coordinator._token = None
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    await agent.start()
    specs = checkpoint_spec(str(model_dir))
    update = {"names": [p.name for p in specs], "dtype_names": [p.dtype for p in specs], "shapes": [list(p.shape) for p in specs]}
    try:
        await asyncio.wait_for(coordinator.pause(None, "keep", False), 5)
        assert agent.held and engine.calls[-1] == ("pause_generation", "keep", False)
        await asyncio.wait_for(coordinator.open_session(None, {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}), 5)
        engine.calls.clear()
        await asyncio.wait_for(coordinator.start_update(None), 5)
        await asyncio.wait_for(coordinator.update(None, update), 5)
        assert await asyncio.wait_for(coordinator.finish_update(None, None), 5) == 1
        names = [c[0] for c in engine.calls]
        assert ("pause_generation", "keep", True) in engine.calls, "the update must reset the prefix cache"
        assert names.index("pause_generation") < names.index("start_weight_update") < names.index("update_weights") < names.index("finish_weight_update")
        assert "resume_generation" not in names, "the trainer's hold lasts until /resume"
        await asyncio.wait_for(coordinator.resume(None), 5)
        assert engine.calls[-1] == ("resume_generation",) and agent.version == 1
    finally:
        agent.stop()
