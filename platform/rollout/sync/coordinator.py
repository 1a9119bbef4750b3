"""The weight-sync coordinator: one Serve replica that knows every live engine replica,
the committed policy version and the round in progress.

Replicas *pull*: each one long-polls :meth:`next_round`, so the coordinator needs no
handle to individual Serve replicas and membership is simply "who polled recently".
A round commits only when the trainer and every member report success before the
deadline; otherwise it is aborted and the publisher gets the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from rollout.config import PlatformConfig
from rollout.errors import InvalidRequestError
from rollout.logs import show_platform_logs
from rollout.sync import net
from rollout.sync.auth import SyncAuth
from rollout.sync.backends import get_backend
from rollout.sync.protocol import POLL_S, REREGISTER, SILENT_POLLS, Control, NoCommittedCopyError, NotRegisteredError, Member, ParamSpec, Reregister, RoundOutcome, RoundPlan, RoundRequest, SessionPlan, SyncError
from rollout.sync.rules import assign_ranks, check_spec
from rollout.sync.sessions import RouteSessions

HISTORY = 20  # round outcomes kept for status()

logger = logging.getLogger(__name__)


@dataclass
class _Replica:
    ranks: int
    version: int
    last_seen: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    control: Control = Control()  # what the replica last applied
    reset_ok: bool = True  # its last prefix-cache reset succeeded


@dataclass
class _Round:
    plan: RoundPlan
    deadline: float
    opened_at: float = field(default_factory=time.monotonic)
    reports: dict[str, Optional[str]] = field(default_factory=dict)  # replica -> error or None
    unreachable: str = ""  # "address:port" of the rendezvous a member could not reach
    keeper_reported: bool = False
    keeper_error: Optional[str] = None
    trainer_error: Optional[str] = None
    trainer_done: bool = False
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Optional[RoundOutcome] = None
    applied: set[str] = field(default_factory=set)  # members serving the decided version again
    all_applied: asyncio.Event = field(default_factory=asyncio.Event)
    checkpoint: Optional[str] = None  # the publisher's copy of these weights on shared storage
    version: int = 0  # committed on success: the plan's, or the one /finish_weight_update names
    # Rounds of a route session: members that started, and the trainer's /update_weights info.
    started: dict[str, Optional[str]] = field(default_factory=dict)
    update_info: Optional[dict] = None
    update_ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Per-member bookkeeping kept as the calls arrive, so that each poll, report and
    # "applied" costs the same at 1,000 members as at 10 (scanning the members on every
    # call made a round's coordination grow with their square).
    by_id: dict[str, Member] = field(init=False)
    member_ids: frozenset[str] = field(init=False)
    missing: set[str] = field(init=False)  # members that have not reported
    failed: set[str] = field(init=False)  # replicas whose report is an error
    applied_members: int = 0

    def __post_init__(self) -> None:
        self.version = self.version or self.plan.version
        self.by_id = {m.replica_id: m for m in self.plan.members}
        self.member_ids = frozenset(self.by_id)
        self.missing = set(self.member_ids)
        self.failed = set()

    def record_report(self, replica_id: str, error: Optional[str]) -> None:
        self.reports[replica_id] = error
        self.missing.discard(replica_id)
        (self.failed.add if error else self.failed.discard)(replica_id)

    def record_applied(self, replica_id: str) -> None:
        if replica_id in self.member_ids and replica_id not in self.applied:
            self.applied_members += 1
        self.applied.add(replica_id)
        if self.applied_members == len(self.member_ids):
            self.all_applied.set()

    def plan_for(self, replica_id: str) -> RoundPlan:
        """The plan as one member receives it: only its own entry of ``members`` (its rank
        offset; the world size says the rest). The whole list to every member would make
        the bytes a round sends grow with the square of the members."""
        return dataclasses.replace(self.plan, members=(self.by_id[replica_id],)) if len(self.plan.members) > 1 else self.plan


@dataclass(frozen=True)
class _Group:
    """A transfer group every participant of a committed round still holds."""

    name: str
    master_address: str
    master_port: int
    layout: tuple  # (members, world_size, keeper_rank): reusable only for the same ranks

    @classmethod
    def of(cls, plan: RoundPlan) -> "_Group":
        return cls(plan.group, plan.master_address, plan.master_port, (plan.members, plan.world_size, plan.keeper_rank))


class WeightSyncCoordinator(RouteSessions):
    """Serve deployment class (exactly one replica). vLLM's RL routes drive it through
    :class:`~rollout.sync.sessions.RouteSessions`."""

    def __init__(self, config: dict[str, Any], backend: str):
        show_platform_logs()
        self.config = PlatformConfig.model_validate(config)
        self.backend = backend
        self.committed_version = 0
        self.replicas: dict[str, _Replica] = {}
        self.params: Optional[list[ParamSpec]] = None
        self.round: Optional[_Round] = None
        self.last_outcome: Optional[RoundOutcome] = None
        self.history: list[RoundOutcome] = []
        self.metrics = None
        if self.config.metrics.enabled:
            from rollout.metrics import SyncMetrics

            self.metrics = SyncMetrics(backend)
        self._gauges_task: Optional[asyncio.Task] = None
        # Who may change the weights: decided from the config (the same decision the
        # ingress follows), checked against the token in this process's environment.
        self.auth = SyncAuth.of(self.config.sync)
        self.auth.warn_if_unusable()
        self.poll_s = POLL_S
        self._departed: list[str] = []
        self.keeper = None
        if get_backend(backend).keeps_copy:
            from rollout.sync.keeper import WeightKeeper

            self.keeper = WeightKeeper(self.config.model.path)
        self._group: Optional[_Group] = None  # the last committed publish round's transfer group
        self._copy: Optional[asyncio.Task] = None  # the keeper receiving the last commit's copy
        # (version, directory): the committed weights on shared storage, when the publisher said where.
        self._checkpoint: Optional[tuple[int, str]] = None
        # Held from opening a round until its decision: one round at a time.
        self._round_lock = asyncio.Lock()
        self._init_sessions()

    # ---- replicas ------------------------------------------------------------------

    async def register(self, replica_id: str, ranks: int, version: int, params: list[ParamSpec]) -> int:
        """A replica announces itself; returns the committed version it must serve.

        A restarted coordinator starts at version 0 and learns the committed version
        back from the replicas, which keep it in their engines.
        """
        if self.params is None:
            self.params = list(params)
        if self.metrics is not None and self._gauges_task is None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._update_gauges())
        self.committed_version = max(self.committed_version, version)
        self.replicas[replica_id] = _Replica(ranks=ranks, version=version, last_seen=time.monotonic())
        logger.info("replica %s registered at version %d (committed %d)", replica_id, version, self.committed_version)
        return self.committed_version

    async def next_round(
        self, replica_id: str, version: int, control: Control = Control(), reset_ok: bool = True
    ) -> Union[RoundPlan, SessionPlan, Control, Reregister, None]:
        """Long poll: the plan of a round (or a route session to join) this replica is a
        member of, the :class:`Control` to apply when the replica's (``control``) differs,
        None after a while, or ``REREGISTER`` when the coordinator does not know the
        replica (it restarted, or dropped the replica as silent)."""
        r = self.replicas.get(replica_id)
        if r is None:
            return REREGISTER
        r.last_seen = time.monotonic()
        r.version, r.control, r.reset_ok = version, control, reset_ok
        plan = self._pending_plan(replica_id)
        if plan is None:
            r.wake.clear()
            try:
                await asyncio.wait_for(r.wake.wait(), timeout=self.poll_s)
            except asyncio.TimeoutError:
                pass
            r.last_seen = time.monotonic()
            plan = self._pending_plan(replica_id)
        return plan

    def _pending_plan(self, replica_id: str) -> Union[RoundPlan, SessionPlan, Control, None]:
        if self.replicas[replica_id].control != self.control:
            return self.control
        join = self._pending_join(replica_id)
        if join is not None:
            return join
        rnd = self.round
        if rnd is None or rnd.decided.is_set() or replica_id in rnd.reports:
            return None
        if replica_id in rnd.member_ids:
            return rnd.plan_for(replica_id)
        return None

    def _live(self) -> dict[str, int]:
        horizon = time.monotonic() - SILENT_POLLS * self.poll_s
        # A member of the undecided round is busy in it (receiving, or blocked in report()
        # until the decision) and does not poll; the round's deadline bounds how long.
        rnd = self.round
        busy = rnd.member_ids if rnd is not None and not rnd.decided.is_set() else frozenset()
        for rid in [rid for rid, r in self.replicas.items() if r.last_seen < horizon and rid not in busy]:
            logger.warning("replica %s stopped polling; dropped from membership", rid)
            del self.replicas[rid]
            self._departed.append(rid)
        return {rid: r.ranks for rid, r in self.replicas.items()}

    async def _update_gauges(self) -> None:
        while True:
            self._live()
            gone, self._departed = self._departed, []
            self.metrics.membership(self.committed_version, {rid: r.version for rid, r in self.replicas.items()}, gone)
            await asyncio.sleep(1.0)

    # ---- rounds --------------------------------------------------------------------

    async def _authorize(self, token: Optional[str]) -> None:
        await self.auth.check(token)

    async def begin_round(self, token: Optional[str], request: RoundRequest) -> RoundPlan:
        """Validate a publish and open a round; no replica changes before this succeeds.
        Once committed, restores reload ``request.checkpoint`` (see :meth:`restore`)."""
        await self._authorize(token)
        if self.params is None:
            raise SyncError("no engine replica has registered yet")
        check_spec(list(request.params), self.params)
        get_backend(self.backend).check_transfer_info(request.transfer_info)
        if request.checkpoint is not None and not os.path.isabs(request.checkpoint):
            raise InvalidRequestError("checkpoint", f"{request.checkpoint!r} must be an absolute path that every replica can read")
        if request.version is not None and request.version <= self.committed_version:
            raise InvalidRequestError("version", f"{request.version} must be greater than the committed version {self.committed_version}")
        await self._acquire_round()
        try:
            self._end_session("a publish from WeightPublisher took the replicas' transfer engines")
            plan = self._open_publish_round(request)
            self.round.checkpoint = request.checkpoint
            return plan
        except BaseException:
            self._round_lock.release()
            raise

    async def _acquire_round(self) -> None:
        try:
            await asyncio.wait_for(self._round_lock.acquire(), timeout=self.config.sync.timeout_s)
        except asyncio.TimeoutError:
            busy = self.round.plan.round_id if self.round else "another round"
            raise SyncError(f"{busy} is still in progress after {self.config.sync.timeout_s}s; rounds run one at a time") from None

    def _open_publish_round(self, request: RoundRequest) -> RoundPlan:
        version = self.committed_version + 1 if request.version is None else request.version
        if version <= self.committed_version:
            raise InvalidRequestError("version", f"{version} must be greater than the committed version {self.committed_version}")
        live = self._live()
        if not live and self.keeper is None:
            raise SyncError("no live engine replica to publish to")
        # With no replica (scaled to zero) the round commits into the keeper alone;
        # replicas that start later catch up from it.
        members, world_size = assign_ranks(live)
        # The copy comes after the commit, over a group of two, when the publisher offers
        # one (its replicas then never wait for it); else, and with no replica to send
        # to, the keeper receives in the round.
        copy_after = self.keeper is not None and bool(request.copy_group) and bool(live)
        keeper_rank = None
        if self.keeper is not None and not copy_after:
            keeper_rank, world_size = world_size, world_size + 1
        group_name, address, port = "", request.master_address, request.master_port
        last = self._group
        if request.reuse_group is not None and last is not None and last.name == request.reuse_group and last.layout == (members, world_size, keeper_rank):
            group_name, address, port = last.name, last.master_address, last.master_port
        plan = self._plan(
            f"round-{version}",
            version,
            members,
            world_size=world_size,
            master_address=address,
            master_port=port,
            params=tuple(request.params),  # the publisher's order: its tensors and handles follow it
            pause_mode=self.config.sync.pause_mode,
            keeper_rank=keeper_rank,
            group_name=group_name,
            transfer_info=request.transfer_info,
            copy_group=request.copy_group if copy_after else "",
            copy_port=request.copy_port if copy_after else 0,
        )
        self._start_round(plan)
        if keeper_rank is not None:
            asyncio.get_running_loop().create_task(self._keep(self.round, keeper_rank))
        logger.info(
            "opened %s: version %d to %d replicas (world size %d, %s)",
            plan.round_id, version, len(members), world_size, f"reusing group {group_name}" if group_name else "new group",
        )
        return plan

    def _plan(self, kind: str, version: int, members: tuple[Member, ...], **fields: Any) -> RoundPlan:
        """The one place a round's plan is made (publish and restore rounds)."""
        sync = self.config.sync
        fields.setdefault("params", tuple(self.params))
        fields.setdefault("bucket_bytes", sync.bucket_bytes)  # a route session's trainer picks its own
        return RoundPlan(
            round_id=f"{kind}-{uuid.uuid4().hex[:8]}",
            version=version,
            backend=self.backend,
            members=members,
            timeout_s=sync.timeout_s,
            **fields,
        )

    def _start_round(self, plan: RoundPlan) -> None:
        self.round = _Round(plan=plan, deadline=time.monotonic() + 3 * plan.timeout_s)
        for m in plan.members:
            if m.replica_id in self.replicas:
                self.replicas[m.replica_id].wake.set()
        asyncio.get_running_loop().create_task(self._enforce_deadline(self.round))

    async def _keep(self, rnd: _Round, rank: int) -> None:
        error = None
        try:
            # The keeper is a rank like the replicas (the only one with none live): an
            # unreachable publisher fails the round in seconds here too. A kept group's
            # (and a route session's) rendezvous was reached when it formed.
            if not rnd.plan.group_name and not rnd.plan.session:
                await net.check_reachable(rnd.plan.master_address, rnd.plan.master_port, rnd.plan.timeout_s)
            await asyncio.to_thread(self.keeper.receive, rnd.plan, rank)
        except net.RendezvousUnreachable as e:
            error, rnd.unreachable = f"the coordinator {e}", e.target
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if rnd.decided.is_set():
            self.keeper.discard(rnd.plan.round_id)  # decided without us (aborted)
            return
        rnd.keeper_reported, rnd.keeper_error = True, error
        self._decide_if_complete(rnd)

    async def _receive_copy(self, plan: RoundPlan, version: int) -> None:
        """The committed round's copy, sent by its publisher after the commit."""
        try:
            tensors = await asyncio.to_thread(self.keeper.receive_copy, plan)  # the group's timeouts bound it
        except Exception as e:
            logger.error(
                "the copy of version %d did not arrive (%s: %s): the coordinator holds version %d; replicas that start "
                "or roll back wait for the next publish", version, type(e).__name__, e, self.keeper.version,
            )
            return
        self.keeper.install(version, tensors)

    async def _copy_landed(self) -> None:
        """Wait (up to a step deadline) for the copy of the last commit, if it is on its way."""
        copy = self._copy
        if copy is not None and not copy.done():
            await asyncio.wait({copy}, timeout=self.config.sync.timeout_s)

    async def restore(self, replica_id: str) -> RoundPlan:
        """Open a round that brings one replica to the committed weights.

        Used by a replica that starts behind the committed version (catch-up, the
        trainer sends nothing) and by one whose transfer broke off mid-way (rollback).
        The source, first that holds the committed version: the checkpoint the
        publisher named (the replica reloads it itself, any backend), else the keeper's
        copy (gloo only: the keeper sends it).
        """
        r = self.replicas.get(replica_id)
        if r is None:
            raise NotRegisteredError(f"replica {replica_id} is not registered")
        checkpoint = self._checkpoint[1] if self._checkpoint and self._checkpoint[0] == self.committed_version else None
        if checkpoint is None:
            await self._copy_landed()
            self._check_keeper_holds_committed(replica_id)
        await self._acquire_round()
        try:
            if not checkpoint and self._session is not None and replica_id in self._session.member_ids:
                self._end_session(f"{replica_id} is restored over a group of its own")
            plan = self._plan(
                f"{'reload' if checkpoint else 'restore'}-{self.committed_version}",
                self.committed_version,
                (Member(replica_id, 1, r.ranks),),
                world_size=1 + r.ranks,
                master_address="" if checkpoint else net.own_address(),
                master_port=0 if checkpoint else net.free_port(self.config.sync.rendezvous_port_range(), "sync.rendezvous_ports"),
                pause_mode="keep",
                restore=True,
                checkpoint=checkpoint,
            )
            self._start_round(plan)
        except BaseException:
            self._round_lock.release()
            raise
        rnd = self.round
        if checkpoint:
            rnd.trainer_done = True  # nothing is sent: the member's report decides
        else:
            self._group = None  # the restored replica leaves the publish group for this one
            asyncio.get_running_loop().create_task(self._send_restore(rnd))
        logger.info("opened %s: version %d on %s from %s", plan.round_id, plan.version, replica_id, checkpoint or "the keeper's copy")
        return plan

    def _check_keeper_holds_committed(self, replica_id: str) -> None:
        if self.keeper is None:
            raise NoCommittedCopyError(
                f"cannot restore {replica_id}: backend {self.backend!r} keeps no copy of the committed weights; "
                "publish with checkpoint=<a directory every replica reads> so replicas can reload them"
            )
        if self.keeper.version != self.committed_version:
            # E.g. this coordinator restarted: it knows the committed version from the
            # replicas but holds no copy of those weights until the next publish.
            raise NoCommittedCopyError(
                f"cannot restore {replica_id}: the coordinator's copy holds version {self.keeper.version}, "
                f"the committed version is {self.committed_version}; the next publish refreshes it"
            )

    async def _send_restore(self, rnd: _Round) -> None:
        error = None
        try:
            await asyncio.to_thread(self.keeper.send, rnd.plan)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        await self._finish(rnd.plan.round_id, error)

    async def _enforce_deadline(self, rnd: _Round) -> None:
        try:
            await asyncio.wait_for(rnd.decided.wait(), timeout=max(0.0, rnd.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            silent = [m.replica_id for m in rnd.plan.members if m.replica_id not in rnd.reports]
            window = rnd.deadline - rnd.opened_at
            self._close_round(rnd, f"deadline of {window:.0f}s passed; no report from {silent or 'the trainer'}", reason="deadline")

    def _close_round(self, rnd: _Round, error: Optional[str] = None, reason: Optional[str] = None) -> None:
        """Decide ``rnd``: commit it unless ``error`` or a participant's report says otherwise."""
        if rnd.decided.is_set():
            return
        failed = [rid for rid, err in rnd.reports.items() if err]
        if error is None and rnd.trainer_error:
            error, reason = f"trainer: {rnd.trainer_error}", "trainer"
        if error is None and failed:
            error = "; ".join(f"{rid}: {rnd.reports[rid]}" for rid in failed)
            reason = "replica"
        if error is None and rnd.keeper_error:
            error, reason = f"the coordinator's copy: {rnd.keeper_error}", "keeper"
        committed = error is None
        if self.metrics is not None:
            nbytes = sum(p.nbytes for p in rnd.plan.params)
            kind = "restore" if rnd.plan.restore else "publish"
            self.metrics.round(kind, committed, time.monotonic() - rnd.opened_at, nbytes, reason)
        if committed:
            self.committed_version = rnd.version
        elif rnd.plan.session:
            self._end_session(f"{rnd.plan.round_id} aborted")  # members restore over other groups
        if not rnd.plan.restore:
            # Every participant keeps a committed round's group; after an abort some
            # have dropped it, so the next round forms a new one.
            self._group = _Group.of(rnd.plan) if committed else None
        if committed and not rnd.plan.restore:
            self._checkpoint = (rnd.version, rnd.checkpoint) if rnd.checkpoint else None
        if self.keeper is not None and not rnd.plan.restore:
            if committed and rnd.plan.copy_group:
                self._copy = asyncio.get_running_loop().create_task(self._receive_copy(rnd.plan, rnd.version))
            elif committed:
                self.keeper.commit(rnd.plan.round_id, rnd.version)
            else:
                self.keeper.discard(rnd.plan.round_id)
        rnd.outcome = RoundOutcome(
            rnd.plan.round_id, committed, self.committed_version, error or "", failed, unreachable="" if committed else rnd.unreachable
        )
        self.last_outcome = rnd.outcome
        self.history.append(rnd.outcome)
        del self.history[:-HISTORY]
        rnd.decided.set()
        self._round_lock.release()
        log = logger.info if committed else logger.error
        log("%s %s (committed version %d)%s", rnd.plan.round_id, "committed" if committed else "aborted", self.committed_version, f": {error}" if error else "")

    def _decide_if_complete(self, rnd: _Round) -> None:
        """Close the round at the first failure, or once every participant has reported."""
        if rnd.trainer_error or rnd.keeper_error or rnd.failed:
            self._close_round(rnd)
        elif rnd.trainer_done and not rnd.missing and (rnd.plan.keeper_rank is None or rnd.keeper_reported):
            self._close_round(rnd)

    def _past_outcome(self, round_id: str) -> Optional[RoundOutcome]:
        """A recent round's outcome: a member that reports after the decision (its receive
        timed out late, a new round already opened) still learns it."""
        return next((o for o in reversed(self.history) if o.round_id == round_id), None)

    def _round(self, round_id: str) -> _Round:
        if self.round is None or self.round.plan.round_id != round_id:
            raise SyncError(f"unknown round {round_id}")
        return self.round

    async def report(self, round_id: str, replica_id: str, error: Optional[str], unreachable: Optional[str] = None) -> RoundOutcome:
        """A member received all weights (``error`` None) or failed; wait for the decision.

        ``unreachable``: the member failed because it could not reach the round's
        rendezvous at that "address:port". Like any failure it aborts the round at once
        (the publisher need not wait out its deadline), and the outcome says so, so the
        publisher can name the address it advertised and how to change it.
        """
        self._seen(replica_id)
        past = self._past_outcome(round_id)
        if past is not None:
            return past
        rnd = self._round(round_id)
        rnd.record_report(replica_id, error)
        if error and unreachable:
            rnd.unreachable = unreachable
        self._decide_if_complete(rnd)
        await rnd.decided.wait()
        return rnd.outcome

    async def finish(self, token: Optional[str], round_id: str, error: Optional[str] = None) -> RoundOutcome:
        """The trainer sent everything (or, with ``error``, aborts the round). It takes the
        credential :meth:`begin_round` takes: round ids are public (``status``), and without
        it anyone with the API key could abort a round, or finish one early."""
        await self._authorize(token)
        return await self._finish(round_id, error)

    async def _finish(self, round_id: str, error: Optional[str] = None) -> RoundOutcome:
        """Wait for the decision and, after a commit, for the members to serve it, so a
        publisher that returns finds every replica on the new version (it never waits
        longer than one step deadline)."""
        past = self._past_outcome(round_id)
        if past is not None:
            return past
        rnd = self._round(round_id)
        rnd.trainer_done = True
        rnd.trainer_error = error
        self._decide_if_complete(rnd)
        await rnd.decided.wait()
        if rnd.outcome.committed and rnd.plan.members:
            try:
                await asyncio.wait_for(rnd.all_applied.wait(), timeout=rnd.plan.timeout_s)
            except asyncio.TimeoutError:
                # The version stays committed (every member received it); the publisher's
                # outcome names who does not serve it yet instead of claiming they all do.
                rnd.outcome.unconfirmed = sorted(rnd.member_ids - rnd.applied)
                logger.warning("%s committed; %s did not confirm serving it within %ss", round_id, rnd.outcome.unconfirmed, rnd.plan.timeout_s)
                if self.metrics is not None:
                    self.metrics.unconfirmed(len(rnd.outcome.unconfirmed))
        return rnd.outcome

    async def applied(self, round_id: str, replica_id: str, version: int, phases: Optional[dict[str, float]] = None) -> None:
        """A member finished applying the decision (serving ``version`` again);
        ``phases`` are its seconds per step, kept with the round's outcome."""
        r = self.replicas.get(replica_id)
        if r is not None:
            r.version = version
        self._seen(replica_id)
        rnd = self.round
        if rnd is not None and rnd.plan.round_id == round_id:
            if rnd.outcome is not None and phases:
                rnd.outcome.phases[replica_id] = dict(phases)
            rnd.record_applied(replica_id)

    def _seen(self, replica_id: str) -> None:
        r = self.replicas.get(replica_id)
        if r is not None:
            r.last_seen = time.monotonic()

    async def status(self) -> dict[str, Any]:
        self._live()
        return {
            "committed_version": self.committed_version,
            "replicas": {rid: {"version": r.version, "ranks": r.ranks} for rid, r in self.replicas.items()},
            "round_in_progress": self.round.plan.round_id if self.round and not self.round.decided.is_set() else None,
            "last_outcome": vars(self.last_outcome) if self.last_outcome else None,
            "recent_rounds": [vars(o) for o in self.history],
            "weight_copy_version": self.keeper.version if self.keeper is not None else None,
            "backend": self.backend,
        }
