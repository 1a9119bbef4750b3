"""The replica-side sync agent's version gate, without an engine or a coordinator."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollout.contracts.sync_protocol import FinishUpdate, FleetQuery, OpenSession, Pause, RoundRequest, Update
from rollout.errors import StaleWeightsError
from rollout.sync.agent import SyncAgent
from tests.inprocess import InProcess, RecordingEngine


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


@pytest.fixture
def rendezvous():
    """A port on 127.0.0.1 that takes connections, as a publisher's rendezvous does: a
    replica checks it can reach a round's rendezvous before it joins the group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


async def committed_from_a_checkpoint(model_dir, sync: dict):
    """A coordinator (nccl, in this process) whose replica "a" committed version 1, published
    with the checkpoint ``/shared/policy-v1`` (what a replica behind it reloads)."""
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": sync}, "nccl")
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("a", 1, 0, specs)
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1, checkpoint="/shared/policy-v1"))
    asyncio.get_running_loop().create_task(coordinator.report(plan.round_id, "a", None))
    finish = asyncio.create_task(coordinator.finish(None, plan.round_id))
    await asyncio.sleep(0.05)
    await coordinator.applied(plan.round_id, "a", 1)
    assert (await finish).committed
    return coordinator


async def test_a_replica_that_starts_behind_a_committed_checkpoint_reloads_it_before_serving(model_dir):
    coordinator = await committed_from_a_checkpoint(model_dir, {"timeout_s": 5, "require_token": False})
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


async def blocked_round(model_dir, monkeypatch, backend: str, port: int):
    """A round of ``backend`` whose replica's engine never returns from update_weights."""
    import rollout.sync.agent as agent_module
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    monkeypatch.setattr(agent_module, "WEDGED_GRACE_S", 0.2)
    # vLLM imported before the timed round, as a replica has it (its engine imported it):
    # a first `import vllm` inside the round blocks the loop for seconds (0.33's patches
    # torch's inductor at import), which a 10 s bound on a loaded machine does not absorb.
    import vllm.distributed.weight_transfer.base  # noqa: F401
    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 0.5, "require_token": False}}, backend)
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("a", 1, 0, specs)
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", port))
    engine = BlockedEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    return agent, engine, plan


async def test_an_engine_blocked_in_a_transfer_marks_the_replica_for_replacement_and_calls_it_no_more(model_dir, monkeypatch, rendezvous):
    # NCCL has no deadline: after a trainer dies mid-broadcast, the replica's worker waits
    # forever and every later engine call (finish, pause, reload) would queue behind it.
    agent, engine, plan = await blocked_round(model_dir, monkeypatch, "nccl", rendezvous)

    assert await asyncio.wait_for(agent._apply(plan), 10) is False
    assert "the engine did not finish receive within 1s" in agent.broken and "must be replaced" in agent.broken
    assert [c[0] for c in engine.calls] == ["pause_generation", "init_weight_transfer_engine", "start_weight_update", "update_weights"]
    assert agent.version == 0


async def test_with_gloo_a_late_engine_call_is_an_ordinary_failure_the_replica_recovers_from(model_dir, monkeypatch, rendezvous):
    # gloo ends a step whose peer is gone by itself (its timeouts), only later than the
    # round's deadline on a busy host: the replica closes the update and restores, as usual.
    agent, engine, plan = await blocked_round(model_dir, monkeypatch, "gloo", rendezvous)

    assert await asyncio.wait_for(agent._apply(plan), 10) is False
    assert agent.broken is None
    assert [c[0] for c in engine.calls][-2:] == ["update_weights", "finish_weight_update"]


async def test_a_round_under_a_trainers_pause_resets_the_prefix_cache_and_keeps_the_hold(model_dir, rendezvous):
    """vLLM's RL routes, coordinator and agent in one process: a trainer's /pause (keep,
    no cache clearing) must not let prefixes cached under the old weights survive an update."""
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}, "nccl")
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    await agent.start()
    specs = checkpoint_spec(str(model_dir))
    update = {"names": [p.name for p in specs], "dtype_names": [p.dtype for p in specs], "shapes": [list(p.shape) for p in specs]}
    try:
        await asyncio.wait_for(coordinator.drive(None, Pause("keep", False)), 5)
        assert agent.held and engine.calls[-1] == ("pause_generation", "keep", False)
        await asyncio.wait_for(coordinator.drive(None, OpenSession({"master_address": "127.0.0.1", "master_port": rendezvous, "world_size": 2})), 5)
        engine.calls.clear()
        await asyncio.wait_for(coordinator.drive(None, FleetQuery.START_UPDATE), 5)
        await asyncio.wait_for(coordinator.drive(None, Update(update)), 5)
        assert await asyncio.wait_for(coordinator.drive(None, FinishUpdate(None)), 5) == 1
        names = [c[0] for c in engine.calls]
        assert ("pause_generation", "keep", True) in engine.calls, "the update must reset the prefix cache"
        assert names.index("pause_generation") < names.index("start_weight_update") < names.index("update_weights") < names.index("finish_weight_update")
        assert "resume_generation" not in names, "the trainer's hold lasts until /resume"
        await asyncio.wait_for(coordinator.drive(None, FleetQuery.RESUME), 5)
        assert engine.calls[-1] == ("resume_generation",) and agent.version == 1
    finally:
        agent.stop()


class Unreachable:
    """A coordinator whose every call fails, as a dead or partitioned one does."""

    def __getattr__(self, name):
        async def fail(*args, **kwargs):
            raise ConnectionError("coordinator gone")

        return type("Method", (), {"remote": staticmethod(fail)})


def replica_with(agent, max_staleness=None, engine=None):
    from rollout.config import load_config
    from rollout.engine.adapter import EngineAdapter
    from rollout.engine.replica import RolloutEngine
    from rollout.engine.stats import SchedulerSnapshot
    from rollout.engine.sync_gate import SyncGate
    from rollout.engine.validation import ModelLimits
    from rollout.rewards import RewardScorer

    r = object.__new__(RolloutEngine)  # the admission rule only: no vLLM engine behind it
    config = load_config({"model": {"path": "/models/x"}, "sync": {"max_staleness": max_staleness}}, environ={})
    adapter = EngineAdapter(engine or LiveEngine(), None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), SchedulerSnapshot())
    r._assemble(config, "r", adapter, SyncGate.over(agent, config.sync, "r"), RewardScorer.from_config(config.rewards))
    return r


class LiveEngine:
    errored = False

    def shutdown(self):
        pass


async def test_a_replica_that_lost_the_coordinator_stops_vouching_for_its_version(model_dir):
    # Before: it kept reporting its last committed version (staleness 0) and admitted every
    # request, while the coordinator dropped it and committed newer versions without it.
    from rollout.api import RolloutRequest

    agent = SyncAgent(engine=RecordingEngine(), coordinator=Unreachable(), replica_id="r", ranks=1, model_path=str(model_dir))
    agent.version = 3
    agent.lost_after_s = 0.2
    agent._task = asyncio.create_task(agent._poll_forever())
    try:
        assert agent.known_committed == 3, "within the bound it still knows"
        await asyncio.sleep(0.4)
        assert agent.coordinator_lost_s() > 0.2 and agent.known_committed is None
        request = RolloutRequest(prompt_token_ids=[1, 2])
        with pytest.raises(StaleWeightsError, match="max_staleness 1"):
            await replica_with(agent, max_staleness=1).gate.admit([(request, [1, 2])])
        with pytest.raises(StaleWeightsError, match="min_weight_version 4"):
            await replica_with(agent).gate.admit([(request.model_copy(update={"min_weight_version": 4}), [1, 2])])
        # No rule asks for a version: nothing to vouch for, the request is served.
        await replica_with(agent).gate.admit([(request.model_copy(update={"min_weight_version": 3}), [1, 2])])
        # The coordinator answers again: the replica vouches again.
        agent._heard_from_coordinator()
        assert agent.known_committed == 3
        await replica_with(agent, max_staleness=1).gate.admit([(request, [1, 2])])
    finally:
        agent.stop()


async def test_a_result_without_version_spans_reports_its_staleness_as_unknown_not_zero(model_dir):
    from types import SimpleNamespace

    from rollout.api import RolloutRequest

    class OneTokenEngine:
        async def generate(self, prompt, params, request_id):
            completion = SimpleNamespace(index=0, token_ids=[7], logprobs=None, finish_reason="length", stop_reason=None, text="x", weight_versions=None)
            yield SimpleNamespace(outputs=[completion])

        def shutdown(self):
            pass

    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    agent.version = 2
    r = replica_with(agent, engine=OneTokenEngine())
    result = await r._generate_one(RolloutRequest(request_id="q", prompt_token_ids=[1, 2], sampling={"max_tokens": 1}), [1, 2])
    assert result.committed_version == 2 and result.staleness is None


async def test_a_version_no_publish_in_progress_can_bring_is_refused_at_once_not_held(model_dir):
    # Before: min_weight_version 296 with version 0 committed held the request 60 s, then 503.
    from rollout.api import RolloutRequest
    from rollout.errors import InvalidRequestError
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    r = replica_with(agent)
    r.config.sync.timeout_s = 5
    far = RolloutRequest(prompt_token_ids=[1], min_weight_version=296)
    with pytest.raises(InvalidRequestError, match=r"requests\[3\].min_weight_version.*296 is ahead of the committed version 0"):
        await asyncio.wait_for(r.gate.admit([(far, [1])], offset=3), 1)
    # The next version may come from a publish about to begin: held until it arrives.
    held = asyncio.create_task(r.gate.admit([(RolloutRequest(prompt_token_ids=[1], min_weight_version=1), [1])]))
    await asyncio.sleep(0.05)
    assert not held.done()
    agent.version = 1
    await asyncio.wait_for(held, 1)
    # A publish in progress that names version 296 (trainers often number by step): held.
    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"require_token": False}}, "nccl")
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("r", 1, 1, specs)
    agent._incoming = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1, version=296))
    assert agent.may_arrive(296) and not agent.may_arrive(297)


async def test_with_no_copy_to_restore_from_a_replica_waits_paused_for_the_next_publish_instead_of_being_replaced(model_dir, rendezvous):
    # Before: it was marked broken, Serve replaced it, and the replacement (which could not
    # catch up either) was replaced again, until a publish happened to land.
    from rollout.errors import NotServingError
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}, "nccl")
    specs = checkpoint_spec(str(model_dir))
    await coordinator.register("a", 1, 3, specs)  # a restarted coordinator learns version 3 from a replica
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="b", ranks=1, model_path=str(model_dir))
    await agent.start()  # behind: restore, but nccl keeps no copy and no checkpoint was named
    agent.stop()
    assert not agent.broken and "next publish" in agent.awaiting_publish
    assert [c[0] for c in engine.calls] == ["pause_generation"]
    with pytest.raises(NotServingError, match="next publish"):
        replica_with(agent)._raise_if_not_serving()

    # The next publish carries the full model to every member, b included: whole again.
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", rendezvous))
    applying = asyncio.create_task(agent._apply(plan))
    asyncio.create_task(coordinator.report(plan.round_id, "a", None))
    finish = asyncio.create_task(coordinator.finish(None, plan.round_id))
    await asyncio.sleep(0.1)
    await coordinator.applied(plan.round_id, "a", 4)
    assert await asyncio.wait_for(applying, 5) and (await finish).committed
    assert agent.version == 4 and agent.awaiting_publish is None and engine.calls[-1][0] == "resume_generation"
    replica_with(agent)._raise_if_not_serving()


async def test_a_replica_that_cannot_reach_the_rendezvous_fails_the_round_in_seconds_and_keeps_serving_its_version(model_dir, monkeypatch):
    """Before: the engine's join waited out the store's timeout (the whole deadline) and
    failed with "did not finish join within 60s", naming no address."""
    from rollout.contracts import net
    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    monkeypatch.setattr(net, "PROBE_S", 0.5)
    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 30, "require_token": False}}, "nccl")
    specs = checkpoint_spec(str(model_dir))
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    await agent.start()
    agent.stop()  # the round below is driven by hand
    port = net.free_port()  # nothing listens there
    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", port))
    t0 = time.monotonic()
    assert await asyncio.wait_for(agent._apply(plan), 5), "nothing was loaded: consistent"
    assert time.monotonic() - t0 < 2, "the probe's window, not the round's 30 s deadline"
    assert [c[0] for c in engine.calls] == ["pause_generation", "resume_generation"], "the engine never joined, nor started loading"
    outcome = coordinator.rounds.last_outcome
    assert not outcome.committed and outcome.unreachable == f"127.0.0.1:{port}"
    assert f"cannot reach the transfer group's rendezvous at 127.0.0.1:{port}" in outcome.error
    assert agent.version == 0 and not agent.broken


# ---- the publish group kept across rounds (nccl: vLLM's engine forms a communicator per init)


def nccl_coordinator(model_dir):
    import vllm.distributed.weight_transfer.base  # noqa: F401  (the agent's first import of vLLM must not eat a round's bounds)

    from rollout.sync.checkpoint import checkpoint_spec
    from rollout.sync.coordinator import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator({"model": {"path": str(model_dir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}, "nccl")
    return coordinator, checkpoint_spec(str(model_dir))


def nccl_replica(model_dir):
    """An nccl coordinator in-process and replica "a" (an agent over a recording engine)."""
    coordinator, specs = nccl_coordinator(model_dir)
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    return coordinator, specs, engine, agent


async def publish_round(coordinator, agent, specs, port, reuse=None, trainer_error=None, checkpoint=None, named=None):
    """One publish round as a trainer drives it, applied by ``agent``; ``named`` makes the
    replica see the plan naming that group whatever the coordinator named."""
    import dataclasses

    plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", port, reuse_group=reuse, checkpoint=checkpoint))
    seen = plan if named is None else dataclasses.replace(plan, transfer=dataclasses.replace(plan.transfer, group_name=named))
    applying = asyncio.create_task(agent._apply(seen))
    outcome = await asyncio.wait_for(coordinator.finish(None, plan.round_id, trainer_error), 30)
    return plan, await asyncio.wait_for(applying, 30), outcome


def inits(engine):
    return sum(c[0] == "init_weight_transfer_engine" for c in engine.calls)


async def test_a_publish_round_naming_the_group_the_engine_joined_last_round_skips_the_engines_init(model_dir, rendezvous):
    coordinator, specs, engine, agent = nccl_replica(model_dir)
    await coordinator.register("a", 1, 0, specs)

    first, served, outcome = await publish_round(coordinator, agent, specs, rendezvous)
    assert served and outcome.committed and first.transfer.group_name == "" and inits(engine) == 1

    # The publisher offers the group it formed; the coordinator names it; the engine keeps it.
    kept, served, outcome = await publish_round(coordinator, agent, specs, rendezvous, reuse=first.group)
    assert served and outcome.committed and kept.transfer.group_name == first.group
    assert inits(engine) == 1, "no init: vLLM's NCCL engine would form a communicator the trainer never joins"
    assert [c[0] for c in engine.calls[-6:]] == ["pause_generation", "start_weight_update", "update_weights", "finish_weight_update", "update_weight_version", "resume_generation"]
    assert "join" in outcome.phases["a"] and agent.version == 2

    # A round over a new group (the publisher offered none, as after its close()) inits.
    new, served, _ = await publish_round(coordinator, agent, specs, rendezvous)
    assert served and new.transfer.group_name == "" and inits(engine) == 2
    # A round naming a group other than the one the engine joined last inits too.
    _, served, _ = await publish_round(coordinator, agent, specs, rendezvous, reuse=new.group, named="round-elsewhere")
    assert served and inits(engine) == 3
    # ... and that one is now the group the engine holds.
    _, served, _ = await publish_round(coordinator, agent, specs, rendezvous, reuse=new.group, named="round-elsewhere")
    assert served and inits(engine) == 3


async def test_after_an_aborted_round_the_next_one_inits_even_where_a_plan_names_the_old_group(model_dir, rendezvous):
    coordinator, specs, engine, agent = nccl_replica(model_dir)
    await coordinator.register("a", 1, 0, specs)
    first, _, _ = await publish_round(coordinator, agent, specs, rendezvous)

    # The trainer's send fails in a round over the kept group: peers may be out of step.
    _, consistent, outcome = await publish_round(coordinator, agent, specs, rendezvous, reuse=first.group, trainer_error="RuntimeError: NCCL error")
    assert not outcome.committed and not consistent and inits(engine) == 1

    # The coordinator names no kept group after an abort ...
    after, _, _ = await publish_round(coordinator, agent, specs, rendezvous, reuse=first.group, named=first.group)
    assert inits(engine) == 2, "the replica does not trust a plan naming a group its engine may have lost"
    # (the round the coordinator opened named a new group: only the replica's view was forged)
    assert after.transfer.group_name == ""


@pytest.mark.parametrize("checkpoint", ["/shared/policy-v1", None], ids=["reload", "no-copy"])
async def test_a_restore_makes_the_next_publish_form_a_new_group_on_both_sides(model_dir, rendezvous, checkpoint):
    coordinator, specs, engine, agent = nccl_replica(model_dir)
    await coordinator.register("a", 1, 0, specs)
    first, _, _ = await publish_round(coordinator, agent, specs, rendezvous, checkpoint=checkpoint)

    # E.g. its version label failed after a commit: it restores (a reload, or with no copy
    # to restore from it waits for the next publish).
    await agent._restore()
    assert ("collective_rpc", "reload_weights", {"weights_path": checkpoint}) in engine.calls if checkpoint else agent.awaiting_publish
    after, served, _ = await publish_round(coordinator, agent, specs, rendezvous, reuse=first.group)
    assert after.transfer.group_name == "", "the coordinator forgot the group when the restore was asked for"
    assert served and inits(engine) == 2


async def test_a_route_sessions_join_makes_the_next_publish_form_a_new_group_on_both_sides(model_dir, rendezvous):
    coordinator, specs, engine, agent = nccl_replica(model_dir)
    await agent.start()
    try:
        plan = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", rendezvous))
        assert (await asyncio.wait_for(coordinator.finish(None, plan.round_id), 5)).committed
        # A trainer written for vllm serve joins every replica's engine to its own group.
        await asyncio.wait_for(coordinator.drive(None, OpenSession({"master_address": "127.0.0.1", "master_port": rendezvous, "world_size": 2})), 5)
        assert inits(engine) == 2
        after = await coordinator.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", rendezvous, reuse_group=plan.group))
        assert after.transfer.group_name == "", "the session's join took the engines: the publisher's group is gone"
        assert (await asyncio.wait_for(coordinator.finish(None, after.round_id), 5)).committed
        assert inits(engine) == 3
    finally:
        agent.stop()


class StartFails(RecordingEngine):
    """An engine whose start_weight_update fails; its update_weights then refuses, as vLLM's
    worker does without an update session (the agent sends both before either answers)."""

    async def start_weight_update(self, *args):
        self.calls.append(("start_weight_update",))
        raise RuntimeError("start failed")

    async def update_weights(self, *args):
        self.calls.append(("update_weights",))
        await asyncio.sleep(0.05)  # answers after the start's failure was seen
        raise RuntimeError("start_weight_update must be called before update_weights.")


async def test_a_start_that_fails_fails_the_round_although_the_update_was_already_sent(model_dir, rendezvous):
    coordinator, specs = nccl_coordinator(model_dir)
    engine = StartFails()
    agent = SyncAgent(engine=engine, coordinator=InProcess(coordinator), replica_id="a", ranks=1, model_path=str(model_dir))
    await coordinator.register("a", 1, 0, specs)
    plan, consistent, outcome = await publish_round(coordinator, agent, specs, rendezvous)
    assert not outcome.committed and "start failed" in outcome.error and not consistent
    # Sent back to back, in that order; the update's own refusal is retrieved, not leaked.
    names = [c[0] for c in engine.calls]
    assert names.index("start_weight_update") + 1 == names.index("update_weights")
    await asyncio.sleep(0.1)
    assert agent.version == 0
