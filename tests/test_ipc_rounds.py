"""Steady ``ipc`` publishes through the real publisher, coordinator and agent, in one
process without Ray (issue 41): CUDA replaced by stand-ins (tests/ipc_control_bench.py), the
engine a recording stand-in that runs its calls in arrival order as vLLM's engine core does.

What a steady round must keep: the engine inits once, the start and the update reach it in
that order, the label before the resume; the export the last committed round carried
travels by id alone (the coordinator completes it, and a member that does not hold it gets
the handles); a coordinator that lost it makes the publisher offer in full; a round that
fails leaves every replica on the committed version and the next offer in full; and
``wait="committed"`` returns at the decision, the replica's phases reaching status()."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rollout.contracts.sync_protocol import OfferUnknownError, RoundRequest, params_digest
from rollout.sync.backends.ipc import IpcTransferInfo
from tests.ipc_control_bench import SIZES, FifoEngine, no_cuda, stage, write_model

PARAMS = 339  # Qwen2-1.5B's tensor count: the messages' sizes are the GPU check's


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    """A coordinator (ipc) and replica "a" on a loop of their own (as Serve's user-code
    thread), and a publisher calling them from this thread; every call pickled both ways."""
    no_cuda(monkeypatch.setattr)
    tensors = write_model(Path(tmp_path), PARAMS)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro, timeout_s=30):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    coordinator, engine, agent, publisher = stage(Path(tmp_path), loop, timeout_s=60)
    SIZES.clear()
    yield type("Fleet", (), dict(coordinator=coordinator, engine=engine, agent=agent, publisher=publisher, tensors=tensors, on_loop=staticmethod(on_loop)))
    loop.call_soon_threadsafe(agent.stop)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_steady_rounds_init_once_pipeline_the_engine_calls_and_carry_the_export_by_id(fleet):
    for version in (1, 2, 3):
        SIZES.clear()
        assert fleet.publisher.publish(fleet.tensors) == version
        assert fleet.publisher.last_outcome.committed and fleet.publisher._sender.by_reference == (version > 1)
    calls = fleet.engine.calls
    assert calls.count("init_weight_transfer_engine") == 1, f"ipc's init only records packed=False: once per engine ({calls})"
    steady = ["pause_generation", "start_weight_update", "update_weights", "finish_weight_update", "update_weight_version", "resume_generation"]
    assert calls[-6:] == steady and calls[-12:-6] == steady
    first, *later = fleet.engine.update_infos
    assert first["ipc_handles_pickled"] and all(i["ipc_handles_pickled"] == "" and i["export_id"] == first["export_id"] for i in later)
    # The steady round's messages: no handles and no parameter list (their digest), a few KiB.
    for call in ("begin_round.call", "begin_round.answer", "next_round.answer"):
        assert max(SIZES[call]) < 4 * 1024, (call, SIZES[call])
    phases = fleet.publisher.last_outcome.phases["a"]
    assert {"pause", "join", "start", "receive", "decision", "version", "resume"} <= set(phases)
    assert {"open", "send", "commit", "open.prepare", "open.ask", "send.offer"} <= set(fleet.publisher.last_phases)


def test_a_member_that_does_not_hold_the_export_gets_the_handles_and_one_that_does_gets_the_id(fleet):
    fleet.publisher.publish(fleet.tensors)  # "a" maps the export; the round commits
    c = fleet.coordinator
    specs = fleet.agent.params

    async def second_round():
        await c.register("b", 1, 1, specs)  # joined since: its engine holds no export
        export = c.rounds._offer.export_id
        plan = await c.begin_round(None, RoundRequest(tuple(specs), "", 0, transfer_info=IpcTransferInfo("", export)))
        rnd = c.rounds.current
        got = {rid: rnd.plan_for(rid) for rid in ("a", "b")}
        await c.finish(None, plan.round_id, "the test ends the round")
        return plan, got, export

    plan, got, export = fleet.on_loop(second_round())
    assert got["a"].transfer_info == IpcTransferInfo("", export), "a received this export in a committed round: the id alone"
    assert got["a"].params == () and got["a"].params_digest == params_digest(specs), "... and the parameters by digest"
    assert got["b"].transfer_info.ipc_handles_pickled and got["b"].transfer_info.export_id == export, "b joined since: the handles"
    assert got["b"].params == tuple(specs) and got["b"].params_digest == params_digest(specs)
    assert plan.transfer_info == IpcTransferInfo("", export) and plan.params == (), "the publisher's answer carries neither back"


def test_an_offer_by_id_the_coordinator_does_not_hold_is_refused_and_the_publisher_offers_in_full(fleet):
    fleet.publisher.publish(fleet.tensors)
    c = fleet.coordinator

    async def by_unknown_id():
        return await c.begin_round(None, RoundRequest(tuple(fleet.agent.params), "", 0, transfer_info=IpcTransferInfo("", "not-the-export")))

    with pytest.raises(OfferUnknownError, match="not-the-export"):
        fleet.on_loop(by_unknown_id())

    async def params_by_unknown_digest():
        export = c.rounds._offer.export_id
        return await c.begin_round(None, RoundRequest((), "", 0, transfer_info=IpcTransferInfo("", export), params_digest="0" * 64))

    with pytest.raises(OfferUnknownError, match="params_digest"):
        fleet.on_loop(params_by_unknown_digest())
    assert c.rounds.current.outcome.committed, "nothing opened"
    c.rounds._offer = None  # as after a coordinator restart
    assert fleet.publisher.publish(fleet.tensors) == 2
    assert not fleet.publisher._sender.by_reference and fleet.engine.update_infos[-1]["ipc_handles_pickled"]
    assert fleet.publisher.publish(fleet.tensors) == 3 and fleet.publisher._sender.by_reference


def test_a_round_that_fails_keeps_the_committed_version_and_the_next_offer_is_in_full(fleet, monkeypatch):
    from rollout.sync import SyncError

    fleet.publisher.publish(fleet.tensors)
    engine = fleet.engine
    real = FifoEngine.__getattr__

    def failing(self, name):
        call = real(self, name)
        if name != "update_weights":
            return call

        async def update(*args):
            await call(*args)
            raise RuntimeError("the round names export e without its handles, but this engine holds none")

        return update

    monkeypatch.setattr(FifoEngine, "__getattr__", failing)
    with pytest.raises(SyncError, match="without its handles"):
        fleet.publisher.publish(fleet.tensors)
    assert fleet.coordinator.store.version == 1 and fleet.agent.version == 1
    monkeypatch.setattr(FifoEngine, "__getattr__", real)
    fleet.agent.awaiting_publish = None  # ipc keeps no copy: the replica waits (paused) for this publish
    assert fleet.publisher.publish(fleet.tensors) == 2
    assert not fleet.publisher._sender.by_reference and engine.update_infos[-1]["ipc_handles_pickled"], "after an abort the handles go again"
    assert fleet.publisher.publish(fleet.tensors) == 3 and engine.update_infos[-1]["ipc_handles_pickled"] == "", "then by id again"


def test_wait_committed_returns_at_the_decision_and_the_replicas_phases_reach_status(fleet, monkeypatch):
    from rollout.errors import InvalidRequestError

    fleet.publisher.publish(fleet.tensors)
    release = threading.Event()
    real = FifoEngine.__getattr__

    def slow_resume(self, name):
        call = real(self, name)
        if name != "resume_generation":
            return call

        async def resume(*args):
            await asyncio.to_thread(release.wait, 10)
            await call(*args)

        return resume

    monkeypatch.setattr(FifoEngine, "__getattr__", slow_resume)
    assert fleet.publisher.publish(fleet.tensors, wait="committed") == 2
    outcome = fleet.publisher.last_outcome
    assert outcome.committed and outcome.phases == {}, "returned before the replica confirmed"
    assert fleet.engine.calls.count("resume_generation") == 1, "the replica has not resumed yet (only after the first round)"
    release.set()

    async def confirmed():
        for _ in range(100):
            rounds = (await fleet.coordinator.status())["recent_rounds"]
            if rounds[-1]["phases"].get("a"):
                return rounds[-1]
            await asyncio.sleep(0.05)

    last = fleet.on_loop(confirmed())
    assert last is not None and "resume" in last["phases"]["a"], "the replica's phases reach status() once it confirms"
    assert fleet.agent.version == 2 and fleet.engine.calls[-2:] == ["update_weight_version", "resume_generation"]
    # The next publish (the default wait) finds the replica serving and waits for it again.
    assert fleet.publisher.publish(fleet.tensors) == 3 and "resume" in fleet.publisher.last_outcome.phases["a"]
    with pytest.raises(InvalidRequestError, match="wait"):
        fleet.publisher.publish(fleet.tensors, wait="served")
