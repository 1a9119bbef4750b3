"""The coordinator's round bookkeeping, in one process (no Ray, no engines): the nccl
backend keeps no weight copy, so a round involves only the calls below."""

from __future__ import annotations

import asyncio

import pytest

from rollout.contracts.backend_registry import get_backend
from rollout.contracts.sync_protocol import RESTORE_ROUNDS, ParamSpec, RoundRequest
from rollout.sync.coordinator import WeightSyncCoordinator

SPECS = [ParamSpec("w", "float32", (2, 2))]


def coordinator(backend: str = "nccl") -> WeightSyncCoordinator:
    c = WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, backend)
    return c


async def test_a_member_that_reports_after_the_decision_and_a_newer_round_still_gets_its_rounds_outcome():
    c = coordinator()
    for rid in ("a", "b"):
        await c.register(rid, 1, 0, SPECS)
    first = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    await c.report(first.round_id, "a", "receive failed")  # decides: aborted
    second = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 2))
    late = await c.report(first.round_id, "b", None)  # b's receive timed out late
    assert late.round_id == first.round_id and not late.committed
    assert c.rounds.current.plan.round_id == second.round_id and not c.rounds.current.decided.is_set(), "the open round is untouched"


async def received_by(c: WeightSyncCoordinator, members=("a", "b")):
    """A round every member received and the trainer finished: (plan, the trainer's finish())."""
    for rid in members:
        await c.register(rid, 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    for rid in members:
        asyncio.get_running_loop().create_task(c.report(plan.round_id, rid, None))
    finish = asyncio.create_task(c.finish(None, plan.round_id))
    await asyncio.sleep(0.1)
    return plan, finish


async def test_the_publisher_returns_once_every_member_serves_the_committed_version():
    c = coordinator()
    plan, finish = await received_by(c)
    assert c.store.version == 1 and not finish.done(), "committed, but no member serves it yet"
    await c.applied(plan.round_id, "a", 1)
    await c.applied(plan.round_id, "b", 1)
    outcome = await asyncio.wait_for(finish, 1)
    assert outcome.committed and {r["version"] for r in (await c.status())["replicas"].values()} == {1}


async def test_rounds_run_one_at_a_time_and_a_second_publisher_gets_a_clear_error():
    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    with pytest.raises(Exception, match="one at a time"):
        await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 2))


async def commit(c: WeightSyncCoordinator, plan, members=("a",)):
    for rid in members:
        asyncio.get_running_loop().create_task(c.report(plan.round_id, rid, None))
    finish = asyncio.create_task(c.finish(None, plan.round_id))
    await asyncio.sleep(0.05)
    for rid in members:
        await c.applied(plan.round_id, rid, plan.version)
    assert (await finish).committed


async def test_rounds_reuse_the_transfer_group_until_membership_changes_or_a_round_fails():
    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    first = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.0.0.1", 1001))
    assert first.group == first.round_id, "the first round forms a group of its own"
    await commit(c, first)
    second = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.0.0.1", 1002, reuse_group=first.group))
    assert (second.group, second.transfer.master_port) == (first.group, 1001), "same members: the kept group"
    await commit(c, second)
    third = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.0.0.1", 1003, reuse_group="some-other-group"))
    assert third.group == third.round_id and third.transfer.master_port == 1003, "the publisher no longer holds it"
    await commit(c, third)
    await c.register("b", 1, 0, SPECS)
    fourth = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.0.0.1", 1004, reuse_group=third.group))
    assert fourth.group == fourth.round_id, "a new member: a new group"
    await c.report(fourth.round_id, "b", "receive failed")
    fifth = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.0.0.1", 1005, reuse_group=fourth.group))
    assert fifth.group == fifth.round_id, "after an abort some participants dropped the group"


async def test_an_ipc_round_carries_the_publishers_handles_to_every_member_and_keeps_no_copy():
    c = coordinator("ipc")
    await c.register("a", 1, 0, SPECS)
    handles = {"ipc_handles_pickled": "aGFuZGxlcw=="}
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, transfer_info=handles))
    assert get_backend(plan.backend).update_info(plan.params, plan.transfer_info)["ipc_handles_pickled"] == handles["ipc_handles_pickled"]
    assert plan.keeper_rank is None and c.store.keeper is None
    await commit(c, plan)
    assert c.store.version == 1


@pytest.mark.parametrize(
    "backend, transfer_info",
    [("ipc", None), ("ipc", {"ipc_handles_pickled": ""}), ("ipc", {"ipc_handles_pickled": "x", "extra": 1}), ("gloo", {"ipc_handles_pickled": "x"})],
)
async def test_transfer_info_that_does_not_fit_the_backend_is_rejected_before_a_round_opens(backend, transfer_info):
    from rollout.errors import InvalidRequestError

    c = coordinator(backend)
    await c.register("a", 1, 0, SPECS)
    with pytest.raises(InvalidRequestError, match="transfer_info") as e:
        await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, transfer_info=transfer_info))
    assert e.value.field.startswith("transfer_info")
    assert c.rounds.current is None, "no round opened, no replica woke"


def test_where_the_weight_copy_goes_travels_over_http_and_a_group_without_a_port_is_refused():
    from pydantic import ValidationError

    from rollout.sync.remote import BeginRoundBody

    request = RoundRequest(tuple(SPECS), "127.0.0.1", 1, copy_group="copy-1", copy_port=2)
    body = BeginRoundBody.model_validate_json(BeginRoundBody.of(request).model_dump_json())
    assert body.request() == request
    with pytest.raises(ValidationError, match="copy_port"):
        BeginRoundBody.model_validate({"params": [{"name": "w", "dtype": "float32", "shape": [2, 2]}], "master_address": "127.0.0.1", "master_port": 1, "copy_group": "copy-1"})


def test_ipc_handles_never_travel_over_http():
    from rollout.contracts.sync_protocol import SyncError
    from rollout.sync.remote import HttpCoordinator

    client = HttpCoordinator("http://127.0.0.1:9", None, 1.0)  # nothing listens: it must refuse before sending
    with pytest.raises(SyncError, match="cannot travel over HTTP"):
        client.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, transfer_info={"ipc_handles_pickled": "x"}))


async def test_without_a_weight_copy_or_a_checkpoint_a_restore_fails_and_says_how_to_enable_one():
    from rollout.contracts.sync_protocol import SyncError

    c = coordinator()  # nccl: no keeper
    await c.register("a", 1, 0, SPECS)
    await commit(c, await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1)))
    with pytest.raises(SyncError, match="publish with checkpoint="):
        await c.restore("a")


async def test_a_committed_checkpoint_is_what_restores_reload_until_a_publish_without_one_replaces_it():
    from rollout.contracts.sync_protocol import SyncError

    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    await commit(c, await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, checkpoint="/ckpt/v1")))
    await c.register("b", 1, 0, SPECS)  # starts behind
    plan = await c.restore("b")
    assert (plan.round_id.split("-")[0], plan.checkpoint, plan.version, isinstance(plan, RESTORE_ROUNDS)) == ("reload", "/ckpt/v1", 1, True)
    assert [m.replica_id for m in plan.members] == ["b"]
    outcome = await c.report(plan.round_id, "b", None)  # nothing is sent: b's report decides
    assert outcome.committed and c.store.version == 1
    await c.applied(plan.round_id, "b", 1)
    await commit(c, await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 2)), members=("a", "b"))
    with pytest.raises(SyncError, match="keeps no copy"):
        await c.restore("b")  # the checkpoint holds version 1, not the committed 2


async def test_a_checkpoint_must_be_an_absolute_path():
    from rollout.errors import InvalidRequestError

    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    with pytest.raises(InvalidRequestError, match="absolute path") as e:
        await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, checkpoint="ckpt/v1"))
    assert e.value.field == "checkpoint" and c.rounds.current is None


async def test_a_member_waiting_for_a_slow_decision_is_not_dropped_as_silent():
    c = WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False, "poll_s": 0.01}}, "nccl")
    assert c.membership.poll_s == 0.01  # the silence horizon is 3 polls
    await c.register("a", 1, 0, SPECS)
    await c.register("b", 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, checkpoint="/ckpt/v1"))
    waiting = asyncio.create_task(c.report(plan.round_id, "a", None))  # b never reports (it died)
    await asyncio.sleep(0.1)
    c.rounds.live()
    assert "a" in c.membership.replicas, "a is blocked in report(), not silent"
    await asyncio.wait_for(waiting, 5)  # the deadline aborts the round
    assert not waiting.result().committed


async def test_a_member_that_never_confirms_serving_is_named_in_the_outcome_instead_of_hidden():
    # Before: publish returned as if every replica served the version; only a log line said otherwise.
    c = coordinator()
    plan, finish = await received_by(c)
    await c.applied(plan.round_id, "a", 1)  # b received the weights but never says it serves them
    outcome = await asyncio.wait_for(finish, 3)  # bounded by the step deadline (timeout_s 1)
    assert outcome.committed and outcome.version == 1
    assert outcome.unconfirmed == ["b"]
    status = await c.status()
    assert status["last_outcome"]["unconfirmed"] == ["b"]
    assert status["replicas"]["b"]["version"] == 0, "b's lag stays visible"


async def test_with_a_weight_copy_the_publisher_sends_it_after_the_commit_and_a_restore_waits_for_it(tmp_path):
    """gloo: the round's group holds the trainer and the replicas only (they never wait for
    the coordinator's copy); once the round commits, the publisher's sender sends the copy
    from the buckets it kept, so a trainer that changes its tensors right after publish()
    cannot corrupt it; a restore asked for before the copy lands waits for it."""
    import threading

    import torch

    from rollout.sync.backends.gloo import GlooSender, rendezvous
    from rollout.sync.backends.gloo_group import GlooGroup
    from rollout.sync.backends.gloo_stream import receive_buckets

    c = WeightSyncCoordinator({"model": {"path": str(tmp_path)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 20, "require_token": False}}, "gloo")
    tensors = {"w": torch.randn(4, 4), "b": torch.randn(8)}
    specs = tuple(ParamSpec.of(n, t) for n, t in tensors.items())
    await c.register("a", 1, 0, list(specs))
    sender = GlooSender()
    copy_group, copy_port = sender.copy_offer()
    plan = await c.begin_round(None, RoundRequest(specs, "127.0.0.1", _free_port(), copy_group=copy_group, copy_port=copy_port))
    assert plan.keeper_rank is None and plan.transfer.world_size == 2 and plan.copy.group_name == copy_group, "the copy is not in the round"

    received = {}

    def replica() -> None:
        group = GlooGroup(rendezvous(plan), 1)
        received.update({n: t.clone() for named in receive_buckets(group, plan.params, plan.bucket_bytes) for n, t in named})

    receiving = threading.Thread(target=replica)
    receiving.start()
    await asyncio.to_thread(sender.send, plan, [tensors[p.name] for p in plan.params])
    await asyncio.to_thread(receiving.join, 20)
    assert all(torch.equal(received[n], t) for n, t in tensors.items())
    sent = {n: t.clone() for n, t in tensors.items()}
    for t in tensors.values():
        t.add_(1.0)  # the trainer's next optimizer step, as soon as publish() returns

    asyncio.get_running_loop().create_task(c.report(plan.round_id, "a", None))
    finish = asyncio.create_task(c.finish(None, plan.round_id))
    await asyncio.sleep(0.1)
    await c.applied(plan.round_id, "a", 1)
    assert (await asyncio.wait_for(finish, 5)).committed
    assert c.store.keeper.version == 0, "the copy has not been sent yet"
    restore = asyncio.create_task(c.restore("a"))
    await asyncio.sleep(0.3)
    assert not restore.done(), "a restore waits for the copy on its way instead of failing"

    await asyncio.to_thread(sender.send_copy, plan)
    restore_plan = await asyncio.wait_for(restore, 10)
    assert isinstance(restore_plan, RESTORE_ROUNDS) and restore_plan.version == 1 and c.store.keeper.version == 1
    restored = {}

    def restored_replica() -> None:
        group = GlooGroup(rendezvous(restore_plan), 1)
        restored.update({n: t.clone() for named in receive_buckets(group, restore_plan.params, restore_plan.bucket_bytes) for n, t in named})

    await asyncio.to_thread(restored_replica)
    assert all(torch.equal(restored[n], t) for n, t in sent.items()), "the restore sends the weights as published"
    await c.report(restore_plan.round_id, "a", None)
    sender.close()


# ---- a rendezvous the members cannot reach: the round fails in seconds -------------------


async def test_a_member_that_cannot_reach_the_rendezvous_aborts_the_round_at_once_and_the_outcome_names_the_address():
    c = coordinator()  # sync.timeout_s 1: the round's deadline is 3 s
    for rid in ("a", "b"):
        await c.register(rid, 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.231.2.1", 4321))
    b = asyncio.create_task(c.report(plan.round_id, "b", None))  # b is still waiting for the sender
    await asyncio.sleep(0.05)
    a = await asyncio.wait_for(c.report(plan.round_id, "a", "cannot reach 10.231.2.1:4321", unreachable="10.231.2.1:4321"), 0.5)
    assert not a.committed and a.unreachable == "10.231.2.1:4321" and "a: cannot reach 10.231.2.1:4321" in a.error
    assert (await asyncio.wait_for(b, 0.5)) is a, "every member learns the one decision"
    assert c.store.version == 0
    # What the publisher polls while its send waits for ranks that will never join...
    assert plan.round_id in [r["round_id"] for r in (await c.status())["recent_rounds"]]
    # ...and what it gets when it then gives up: the same outcome, naming the address.
    trainer = await asyncio.wait_for(c.finish(None, plan.round_id, "the send was abandoned"), 0.5)
    assert trainer.unreachable == "10.231.2.1:4321" and not trainer.committed
    # The next round forms a new group (the failed one's is not kept) and opens at once.
    again = await asyncio.wait_for(c.begin_round(None, RoundRequest(tuple(SPECS), "10.231.1.2", 4322, reuse_group=plan.group)), 0.5)
    assert again.group == again.round_id and again.transfer.master_address == "10.231.1.2"


async def test_a_member_failing_otherwise_leaves_no_unreachable_address_in_the_outcome():
    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "10.231.2.1", 4321))
    outcome = await asyncio.wait_for(c.report(plan.round_id, "a", "receive failed"), 0.5)
    assert not outcome.committed and outcome.unreachable == ""


async def test_the_coordinators_copy_cannot_reach_the_publisher_either_the_round_fails_in_seconds(tmp_path, monkeypatch):
    """gloo, a publisher that offers no separate copy group: the keeper is a rank of the
    round, and probes the rendezvous like the replicas do."""
    from rollout.contracts import net

    monkeypatch.setattr(net, "PROBE_S", 0.3)
    c = WeightSyncCoordinator({"model": {"path": str(tmp_path)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 20, "require_token": False}}, "gloo")
    await c.register("a", 1, 0, SPECS)
    port = _free_port()  # nothing listens there
    t0 = asyncio.get_running_loop().time()
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", port))
    assert plan.keeper_rank is not None
    await asyncio.wait_for(c.rounds.current.decided.wait(), 5)
    assert asyncio.get_running_loop().time() - t0 < 3, "decided by the probe, not the 60 s deadline"
    outcome = c.rounds.last_outcome
    assert not outcome.committed and outcome.unreachable == f"127.0.0.1:{port}"
    assert f"the coordinator cannot reach the transfer group's rendezvous at 127.0.0.1:{port}" in outcome.error


def _free_port() -> int:
    from rollout.contracts.net import free_port

    return free_port()


# ---- who may finish or abort a round; one decision for every process --------------------


def guarded(environ_token: str | None, monkeypatch, **sync) -> WeightSyncCoordinator:
    if environ_token is None:
        monkeypatch.delenv("ROLLOUT_SYNC_TOKEN", raising=False)
    else:
        monkeypatch.setenv("ROLLOUT_SYNC_TOKEN", environ_token)
    return WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, **sync}}, "nccl")


async def test_finishing_or_aborting_a_round_takes_the_sync_token_not_just_the_round_id(monkeypatch):
    from rollout.errors import AuthenticationError

    c = guarded("secret", monkeypatch, require_token=True)
    await c.register("a", 1, 0, SPECS)
    plan = await c.begin_round("secret", RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    # The round id is public (status()); an abort with only the API key got through before.
    assert (await c.status())["round_in_progress"] == plan.round_id
    for credential, words in ((None, "missing sync token"), ("guess", "wrong sync token")):
        with pytest.raises(AuthenticationError, match=words):
            await c.finish(credential, plan.round_id, "aborted by a stranger")
    assert not c.rounds.current.decided.is_set(), "a refused finish leaves the round open"
    outcome = await asyncio.wait_for(c.finish("secret", plan.round_id, "the trainer gives up"), 2)
    assert not outcome.committed and "the trainer gives up" in outcome.error


async def test_a_restore_round_finishes_itself_without_a_credential(monkeypatch, tmp_path):
    # The coordinator's own finish (the keeper's send, here failing at once) is not a caller's.
    c = guarded("secret", monkeypatch, require_token=True)
    c.store.keeper = type("Keeper", (), {"version": 0, "send": lambda self, plan: (_ for _ in ()).throw(OSError("no peer"))})()
    await c.register("a", 1, 0, SPECS)
    plan = await c.restore("a")
    await asyncio.wait_for(c.rounds.current.decided.wait(), 2)
    assert c.rounds.past_outcome(plan.round_id).error.endswith("OSError: no peer")


def test_whether_a_sync_token_is_needed_is_decided_by_the_config_not_by_each_processs_environment():
    from rollout.config import SyncConfig
    from rollout.sync.auth import SyncAuth

    # Unset: decided from the environment of the process that builds the app, once.
    assert SyncConfig().token_required({"ROLLOUT_SYNC_TOKEN": "x"}) and not SyncConfig().token_required({})
    assert SyncConfig(allowed_service_accounts=["system:serviceaccount:rl:t"]).token_required({})
    built = SyncConfig().resolved({"ROLLOUT_SYNC_TOKEN": "x"})
    assert built.require_token is True
    # The ingress (no token in its environment) and the coordinator (with it) agree.
    assert SyncAuth.of(built, {}).required and SyncAuth.of(built, {"ROLLOUT_SYNC_TOKEN": "x"}).required
    open_ = SyncConfig().resolved({})
    assert not SyncAuth.of(open_, {"ROLLOUT_SYNC_TOKEN": "x"}).required, "a token the build did not see does not switch auth on in one process"
    with pytest.raises(ValueError, match="contradicts"):
        SyncConfig(require_token=False, allowed_service_accounts=["system:serviceaccount:rl:t"])


async def test_a_required_token_missing_where_the_coordinator_runs_refuses_every_publish_and_says_why(monkeypatch):
    from rollout.errors import AuthenticationError

    c = guarded(None, monkeypatch, require_token=True)
    await c.register("a", 1, 0, SPECS)
    for credential in (None, "anything"):
        with pytest.raises(AuthenticationError, match="missing sync token|ROLLOUT_SYNC_TOKEN is not set where the coordinator runs"):
            await c.begin_round(credential, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    assert c.rounds.current is None


async def test_an_open_platform_takes_no_sync_token_even_where_one_is_in_the_environment(monkeypatch):
    c = guarded("secret", monkeypatch, require_token=False)
    await c.register("a", 1, 0, SPECS)
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    assert not (await asyncio.wait_for(c.finish(None, plan.round_id, "abort"), 2)).committed


def test_the_built_app_gives_the_ingress_and_the_coordinator_the_same_decision(monkeypatch):
    from rollout.app import build_application
    from rollout.config import PlatformConfig

    for env, required in (("secret", True), (None, False)):
        if env is None:
            monkeypatch.delenv("ROLLOUT_SYNC_TOKEN", raising=False)
        else:
            monkeypatch.setenv("ROLLOUT_SYNC_TOKEN", env)
        ingress = build_application(PlatformConfig.model_validate({"model": {"path": "/m"}}))._bound_deployment
        engine, config, coordinator = ingress._replica_config.init_args
        coordinator_config = coordinator._bound_deployment._replica_config.init_args[0]
        assert config["sync"]["require_token"] is required and coordinator_config["sync"]["require_token"] is required
