"""Route sessions (vLLM's RL routes) in the coordinator, in one process: the replicas'
side is played by the calls their agents make (nccl: no weight copy takes part)."""

from __future__ import annotations

import asyncio

import pytest

from rollout.contracts.sync_protocol import Control, FinishUpdate, FleetQuery, OpenSession, ParamSpec, Pause, SessionPlan, SessionRound, SyncError, Update
from rollout.errors import InvalidRequestError
from rollout.sync.sessions import parse_update_info, parse_version
from tests.test_sync_coordinator import SPECS, coordinator

INIT = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "packed": True}
UPDATE = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]], "packed": True}


class Member:
    """What one replica's agent does in a session, step by step."""

    def __init__(self, c, rid: str):
        self.c, self.rid = c, rid

    async def poll(self):
        return await self.c.next_round(self.rid, self.c.membership.replicas[self.rid].version, self.c.membership.replicas[self.rid].control)

    async def join(self):
        plan = await self.poll()
        assert isinstance(plan, SessionPlan), plan
        await self.c.joined(plan.session_id, self.rid, None)
        return plan

    async def round(self, version_seen: list):
        plan = await self.poll()
        assert isinstance(plan, SessionRound) and plan.session, plan
        await self.c.started(plan.round_id, self.rid, None)
        info = await self.c.update_info(plan.round_id, self.rid)
        assert info == UPDATE
        outcome = await self.c.report(plan.round_id, self.rid, None)
        version_seen.append(outcome.version)
        await self.c.applied(plan.round_id, self.rid, outcome.version)


async def two_members():
    c = coordinator()
    for rid in ("a", "b"):
        await c.register(rid, 1, 0, SPECS)
    return c, [Member(c, "a"), Member(c, "b")]


async def test_one_trainers_calls_drive_every_replica_and_each_gets_its_own_rank_offset():
    c, members = await two_members()
    assert await c.drive(None, FleetQuery.WORLD_SIZE) == 2
    init = asyncio.create_task(c.drive(None, OpenSession({**INIT, "world_size": 3})))
    plans = await asyncio.gather(*(m.join() for m in members))
    await asyncio.wait_for(init, 2)
    assert [p.member_init_info(m.rid)["rank_offset"] for p, m in zip(plans, members)] == [1, 2]
    assert plans[0].member_init_info("a")["packed"] is True and plans[0].world_size == 3
    for expected in (1, 7):  # two rounds on one session's group
        seen: list = []
        rounds = [asyncio.create_task(m.round(seen)) for m in members]
        await asyncio.wait_for(c.drive(None, FleetQuery.START_UPDATE), 2)
        # The second announces no parameters, as vLLM 0.33's NCCL trainer engine does when
        # they did not change: every member still gets the ones announced before.
        unchanged = {**UPDATE, "names": [], "dtype_names": [], "shapes": []}
        await asyncio.wait_for(c.drive(None, Update(UPDATE if expected == 1 else unchanged)), 2)
        version = await asyncio.wait_for(c.drive(None, FinishUpdate(None if expected == 1 else "7")), 2)
        await asyncio.gather(*rounds)
        assert version == expected and seen == [expected, expected] and c.store.version == expected


async def test_steps_out_of_order_are_refused_and_change_nothing():
    c, members = await two_members()
    with pytest.raises(SyncError, match="init_weight_transfer_engine first"):
        await c.drive(None, FleetQuery.START_UPDATE)
    with pytest.raises(InvalidRequestError, match="init_info.world_size"):
        await c.drive(None, OpenSession({**INIT, "world_size": 2}))
    with pytest.raises(InvalidRequestError, match="init_info.rank_offset"):
        await c.drive(None, OpenSession({**INIT, "rank_offset": 0, "world_size": 3}))
    init = asyncio.create_task(c.drive(None, OpenSession({**INIT, "world_size": 3})))
    await asyncio.gather(*(m.join() for m in members))
    await init
    with pytest.raises(SyncError, match="call /start_weight_update first"):
        await c.drive(None, Update(UPDATE))
    with pytest.raises(SyncError, match="no weight update is in progress"):
        await c.drive(None, FinishUpdate(None))
    assert c.rounds.current is None and c.store.version == 0


async def test_a_membership_change_ends_the_session_with_a_clear_error():
    c, members = await two_members()
    init = asyncio.create_task(c.drive(None, OpenSession({**INIT, "world_size": 3})))
    await asyncio.gather(*(m.join() for m in members))
    await init
    await c.register("c", 1, 0, SPECS)
    with pytest.raises(SyncError, match=r"joined: \['c'\].*call /get_world_size"):
        await c.drive(None, FleetQuery.START_UPDATE)


async def test_pause_returns_once_every_replica_applied_it():
    c, members = await two_members()
    pause = asyncio.create_task(c.drive(None, Pause("keep", False)))
    answers = await asyncio.gather(*(m.poll() for m in members))
    assert answers == [Control(paused="keep")] * 2
    await asyncio.sleep(0.1)
    assert not pause.done(), "the replicas have not applied it yet"
    for m in members:  # their next poll reports it applied
        c.membership.replicas[m.rid].control = Control(paused="keep")
    await asyncio.wait_for(pause, 2)
    assert await c.drive(None, FleetQuery.IS_PAUSED)


def test_an_update_that_announces_no_parameters_reuses_the_last_announced_ones_or_is_refused():
    from rollout.sync.sessions import _with_announced

    empty = {"names": [], "dtype_names": [], "shapes": [], "packed": True}
    announced = {k: UPDATE[k] for k in ("names", "dtype_names", "shapes")}
    assert _with_announced(empty, announced) == {**empty, **announced}
    assert _with_announced(UPDATE, {"names": ["other"], "dtype_names": ["int8"], "shapes": [[1]]}) == UPDATE
    with pytest.raises(InvalidRequestError, match="update_info.names"):  # nothing announced yet to reuse
        parse_update_info(_with_announced(empty, None))


def test_update_info_and_versions_are_checked_naming_the_field():
    assert parse_update_info(UPDATE) == [ParamSpec("w", "float32", (2, 2))]
    with pytest.raises(InvalidRequestError, match="update_info.shapes"):
        parse_update_info({**UPDATE, "shapes": None})
    with pytest.raises(InvalidRequestError, match="same length"):
        parse_update_info({**UPDATE, "names": ["w", "v"]})
    # Pickles from the network would run code in every engine (vLLM's IPC engine unpickles them).
    with pytest.raises(InvalidRequestError, match="update_info.ipc_handles_pickled: pickled data is not accepted"):
        parse_update_info({**UPDATE, "ipc_handles_pickled": "gASV..."})
    assert parse_version(None, 3) == 4 and parse_version("9", 3) == 9
    with pytest.raises(InvalidRequestError, match="weight_version"):
        parse_version("3", 3)
    with pytest.raises(InvalidRequestError, match="weight_version"):
        parse_version("v3", 3)


async def test_a_pause_some_replica_cannot_apply_fails_and_leaves_nothing_paused():
    c, members = await two_members()
    c.membership.poll_s = 0.1  # a replica that went silent is dropped after 0.3 s
    pause = asyncio.create_task(c.drive(None, Pause("keep", False)))

    async def a_applies():
        while not pause.done():
            await c.next_round("a", 0, Control(paused="keep"))

    async def b_keeps_failing():  # b polls, but its engine never pauses
        while not pause.done():
            await c.next_round("b", 0, Control())  # answered at once: the control differs
            await asyncio.sleep(0.02)

    await asyncio.gather(a_applies(), b_keeps_failing(), return_exceptions=True)
    with pytest.raises(SyncError, match=r"\['b'\] did not apply.*nothing changed"):
        await pause
    assert c.membership.control == Control() and not await c.drive(None, FleetQuery.IS_PAUSED)
    assert await c.next_round("a", 0, Control(paused="keep")) == Control(), "a is told to resume"


async def test_a_replica_that_went_away_does_not_fail_a_pause():
    c, members = await two_members()
    c.membership.poll_s = 0.1
    pause = asyncio.create_task(c.drive(None, Pause("keep", False)))
    await members[0].poll()
    c.membership.replicas["a"].control = Control(paused="keep")  # b never polls again: it was scaled down
    while not pause.done():
        await c.next_round("a", 0, Control(paused="keep"))
    await pause
    assert list(c.membership.replicas) == ["a"]
