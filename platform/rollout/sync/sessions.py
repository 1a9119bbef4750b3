"""Weight updates driven through vLLM's RL routes, coordinated over every replica.

A trainer written for ``vllm serve`` drives one engine step by step:

    /pause → /get_world_size → /init_weight_transfer_engine (while it opens rank 0)
    → [ /start_weight_update → /update_weights (while it broadcasts) → /finish_weight_update ]*
    → /resume

Here the same calls drive every replica at once. ``init`` opens a *session*: each live
replica joins the trainer's transfer group at its own rank offset (the trainer sees one
engine whose world size is the sum of all replicas' ranks). Each ``start`` … ``finish``
is one round of the coordinator's usual kind on the session's group: every member
pauses, receives, reports; ``finish`` commits a version, a failure rolls every member
back to the committed one, and replicas that start later catch up before serving.

A session lasts while its group does: a publish from ``WeightPublisher``, a restore of
a member, an aborted round or a change of membership ends it, and the next ``start``
says to call ``/get_world_size`` and ``/init_weight_transfer_engine`` again.

``/pause`` and ``/resume`` set the coordinator's :class:`Control`; replicas apply it on
their next poll (immediately: the change wakes them) and the route returns once every
live replica has. So do ``/sleep`` and ``/wake_up`` (vLLM's sleep mode: ``rollout.sync.sleep``
holds their rules), which leave a round refused while the replicas' weights sleep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rollout.contracts.sync_protocol import Control, ParamSpec, PauseMode, PullRound, PushRound, Round, SessionPlan, SessionRound, SyncError, Transfer
from rollout.errors import InvalidRequestError
from rollout.sync.rounds import Rounds, RoundState
from rollout.sync.rules import assign_ranks, check_spec
from rollout.sync.sleep import after_sleep, after_wake, refuse_round

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.02  # how often a route re-checks what it waits for


@dataclass
class _Update:
    """A session round's steps as the routes drive them: who started, the trainer's info."""

    rnd: RoundState
    started: dict[str, Optional[str]] = field(default_factory=dict)  # replica -> error or None
    info: Optional[dict] = None  # the trainer's /update_weights
    ready: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Session:
    plan: SessionPlan
    keeper_rank: Optional[int]
    joined: dict[str, Optional[str]] = field(default_factory=dict)  # replica -> error or None
    keeper_joined: bool = False
    keeper_error: Optional[str] = None
    # The last /update_weights info that announced its parameters: what a call announcing
    # none (empty names, dtype_names and shapes) reuses, as vLLM's NCCL engine does from
    # 0.33, whose trainer engine ships them only when they changed.
    announced: Optional[dict] = None

    def __post_init__(self) -> None:
        # Asked on every poll of every replica: built once, not per call (that made a
        # session's polls cost the square of its members).
        self.by_id = {m.replica_id: m for m in self.plan.members}
        self.member_ids = frozenset(self.by_id)

    def round_plan(self, fields: dict, pause_mode: PauseMode) -> SessionRound:
        """A round on this session's group (``fields``: the shared ones, params empty)."""
        info = self.plan.init_info
        transfer = Transfer(info["master_address"], info["master_port"], self.plan.world_size, str(info.get("group_name", "")))
        return SessionRound(**fields, transfer=transfer, session=self.plan.session_id, pause_mode=pause_mode, keeper_rank=self.keeper_rank)

    def plan_for(self, replica_id: str) -> SessionPlan:
        """The plan as one member receives it: only its own entry of ``members``."""
        return dataclasses.replace(self.plan, members=(self.by_id[replica_id],)) if len(self.plan.members) > 1 else self.plan


def _required(info: dict, key: str, kind: type) -> Any:
    value = info.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidRequestError(f"init_info.{key}", f"required, a {kind.__name__}; got {value!r}")
    return value


METADATA = ("names", "dtype_names", "shapes")


def _with_announced(update_info: Any, announced: Optional[dict]) -> Any:
    """``update_info`` with the session's last announced parameters where it announces
    none (all three lists empty): vLLM 0.33's NCCL trainer engine sends them only when
    they changed since its last call. Unchanged otherwise (parse_update_info judges it)."""
    if not isinstance(update_info, dict) or announced is None:
        return update_info
    if all(update_info.get(k, []) == [] for k in METADATA):
        return {**update_info, **announced}
    return update_info


def refuse_pickled(update_info: Any) -> None:
    """``InvalidRequestError`` unless ``update_info`` is one object without pickled data."""
    if not isinstance(update_info, dict):
        raise InvalidRequestError("update_info", "must be one object (names, dtype_names, shapes); lists of them are not supported")
    for key in update_info:
        # vLLM's IPC engine unpickles its handles (ipc_handles_pickled): code execution in
        # every engine for whoever reaches this route. Nothing from the network is unpickled.
        if "pickle" in str(key).lower() or str(key) == "ipc_handles":
            raise InvalidRequestError(f"update_info.{key}", "pickled data is not accepted over HTTP; publish IPC handles with WeightPublisher.connect inside the cluster")


def parse_update_info(update_info: Any) -> list[ParamSpec]:
    """The parameters an ``/update_weights`` call announces, checked for shape."""
    refuse_pickled(update_info)
    columns = {}
    for key in ("names", "dtype_names", "shapes"):
        value = update_info.get(key)
        if not isinstance(value, list) or not value:
            raise InvalidRequestError(f"update_info.{key}", "required, a non-empty list")
        columns[key] = value
    if len({len(v) for v in columns.values()}) != 1:
        raise InvalidRequestError("update_info", "names, dtype_names and shapes must have the same length")
    specs = []
    for i, (name, dtype, shape) in enumerate(zip(columns["names"], columns["dtype_names"], columns["shapes"])):
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise InvalidRequestError(f"update_info.names[{i}]", "names and dtype_names must be strings")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise InvalidRequestError(f"update_info.shapes[{i}]", f"must be a list of non-negative integers; got {shape!r}")
        specs.append(ParamSpec(name, dtype.removeprefix("torch."), tuple(shape)))
    return specs


def parse_version(weight_version: Optional[str], committed: int) -> int:
    """``/finish_weight_update``'s ``weight_version``: our versions are integers that
    name the weights behind every token, so it must be one above the committed."""
    if weight_version is None:
        return committed + 1
    try:
        version = int(str(weight_version).strip())
    except ValueError:
        raise InvalidRequestError("weight_version", f"{weight_version!r} is not an integer; versions here are increasing integers") from None
    if version <= committed:
        raise InvalidRequestError("weight_version", f"{version} must be greater than the committed version {committed}")
    return version


class RouteSessions:
    """The coordinator's side of vLLM's RL routes: a client of round execution (its rounds
    are :class:`SessionRound`s), of membership (who joins, the Control they apply) and of
    the committed-weights store (the copy joins the trainer's group where one is kept).
    The caller (the coordinator) has checked the credential of every route."""

    def __init__(self, rounds: Rounds):
        # Round execution's own settings and parts: a session round is one of its rounds.
        self.rounds = rounds
        self.sync, self.backend, self.membership, self.store = rounds.sync, rounds.backend, rounds.membership, rounds.store
        self.session: Optional[Session] = None
        self._ended: Optional[str] = None  # why the last one ended, for the next start's error
        self._update: Optional[_Update] = None  # the current session round's steps
        rounds.listeners.append(self)

    # ---- following rounds (RoundListener) -------------------------------------------------

    def opening(self, plan: Round) -> None:
        s = self.session
        if s is None:
            return
        if isinstance(plan, PushRound):
            self.end("a publish from WeightPublisher took the replicas' transfer engines")
        elif isinstance(plan, PullRound) and any(m.replica_id in s.member_ids for m in plan.members):
            self.end(f"{plan.members[0].replica_id} is restored over a group of its own")

    def decided(self, rnd: RoundState) -> None:
        if isinstance(rnd.plan, SessionRound) and not rnd.outcome.committed:
            self.end(f"{rnd.round_id} aborted")  # members restore over other groups

    # ---- pause, resume, caches ----------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """``/pause``: every live replica holds generation until ``/resume``."""
        await self._set_control(dataclasses.replace(self.membership.control, paused=mode, clear_cache=clear_cache))

    async def resume(self) -> None:
        await self._set_control(dataclasses.replace(self.membership.control, paused=None, clear_cache=False))

    async def reset_prefix_cache(self) -> bool:
        """Whether every replica's reset succeeded (vLLM's fails while blocks are held)."""
        c = self.membership.control
        await self._set_control(dataclasses.replace(c, cache_resets=c.cache_resets + 1))
        return all(r.reset_ok for r in self.membership.replicas.values())

    # ---- sleep and wake (rollout.sync.sleep) ---------------------------------------------

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """``/sleep``: every live replica's engine sleeps at ``level``."""
        c = self.membership.control
        await self._set_control(dataclasses.replace(c, sleep=after_sleep(c.sleep, level, mode)), revert=False)

    async def wake(self, tags: Optional[tuple[str, ...]]) -> bool:
        """``/wake_up``: every live replica wakes ``tags`` (None: all), a replica whose weights
        a level-2 sleep discarded reloading the committed version first; whether the
        replicas are fully awake."""
        c = self.membership.control
        want = after_wake(c.sleep, tags)
        extra = 0.0
        if c.sleep is not None and c.sleep.level >= 2 and "weights" in c.sleep.asleep and (want is None or "weights" not in want.asleep):
            # Each replica restores in a round of its own, one round at a time.
            extra = len(self.rounds.live()) * self.sync.timeout_s
        await self._set_control(dataclasses.replace(c, sleep=want), revert=False, extra_s=extra)
        return want is None

    async def _set_control(self, c: Control, revert: bool = True, extra_s: float = 0.0) -> None:
        """Returns once every live replica applied ``c`` (they poll at once: woken here).
        If some did not in time, the previous control is restored (replicas that applied
        ``c`` undo it on their next poll) and the call fails: nothing is left half paused.
        Without ``revert`` (sleep and wake: undoing them costs what doing them did) ``c``
        stays, the replicas behind apply it on their next poll, and the call says so."""
        members = self.membership
        previous, members.control = members.control, c
        members.wake_all()
        # Long enough for a replica that went away (scaled down, died) without a word to be
        # dropped as silent: waiting on it must not fail the call.
        timeout = max(self.sync.timeout_s, members.silent_polls * members.poll_s) + members.poll_s + extra_s
        if not await _wait_until(lambda: all(members.replicas[rid].control == c for rid in self.rounds.live()), timeout):
            behind = sorted(rid for rid, r in members.replicas.items() if r.control != c)
            if not revert:
                raise SyncError(f"replicas {behind} did not apply {c} within {timeout:.0f}s; they apply it on their next poll")
            members.control = previous
            members.wake_all()
            raise SyncError(f"replicas {behind} did not apply {c} within {timeout:.0f}s (a round in progress holds them); nothing changed")

    # ---- the session: /get_world_size, /init_weight_transfer_engine ---------------------

    def inference_world_size(self) -> int:
        """The ranks a trainer must count besides its own: every live replica's, plus
        the coordinator's copy where the backend keeps one (it receives the broadcast too)."""
        return sum(self.rounds.live().values()) + (1 if self.store.keeps_copy else 0)

    async def open(self, init_info: dict) -> None:
        """Every live replica (and the copy) joins the trainer's group; returns when all have."""
        if self.membership.params is None:
            raise SyncError("no engine replica has registered yet")
        if not isinstance(init_info, dict):
            raise InvalidRequestError("init_info", "must be an object")
        if init_info.get("nccl_unique_id_b64"):
            raise InvalidRequestError("init_info.nccl_unique_id_b64", "not supported here: pass master_address and master_port (the replicas rendezvous over TCP)")
        _required(init_info, "master_address", str)
        if self.store.keeps_copy:
            _required(init_info, "group_name", str)  # the coordinator's copy joins the same group
        refuse_round(self.membership.control.sleep, "/init_weight_transfer_engine")
        port = _required(init_info, "master_port", int)
        if not 1 <= port <= 65535:
            raise InvalidRequestError("init_info.master_port", f"{port} is not a TCP port")
        world = _required(init_info, "world_size", int)
        offset = init_info.get("rank_offset", 1)
        if offset != 1:
            raise InvalidRequestError("init_info.rank_offset", f"must be 1 (one trainer rank, 0, sends); got {offset!r}")
        async with self.rounds.exclusive():
            expected = 1 + self.inference_world_size()
            if world != expected:
                raise InvalidRequestError(
                    "init_info.world_size", f"{world} does not match 1 trainer rank + {expected - 1} inference ranks; ask /get_world_size again (replicas come and go)"
                )
            members, world_size = assign_ranks(self.rounds.live())
            keeper_rank = world_size if self.store.keeps_copy else None
            info = {k: v for k, v in init_info.items() if k != "rank_offset"}
            plan = SessionPlan(f"session-{uuid.uuid4().hex[:8]}", self.backend, members, expected, info, self.sync.timeout_s)
            self.session = session = Session(plan, keeper_rank)
            self.membership.wake(m.replica_id for m in members)
            if keeper_rank is not None:
                asyncio.get_running_loop().create_task(self._copy_joins(session))
            logger.info("opened %s: %d replicas join the trainer's group (world size %d)", plan.session_id, len(members), expected)
            done = await _wait_until(
                lambda: session.member_ids <= set(session.joined) and (keeper_rank is None or session.keeper_joined),
                3 * plan.timeout_s,
                stop=lambda: any(session.joined.values()) or session.keeper_error is not None,
            )
            errors = {rid: e for rid, e in session.joined.items() if e}
            if session.keeper_error:
                errors["the coordinator's copy"] = session.keeper_error
            if errors or not done:
                self.end(f"joining failed: {errors or 'timed out'}")
                missing = sorted(session.member_ids - set(session.joined))
                raise SyncError(f"{plan.session_id}: joining the trainer's group failed: {errors or f'no answer from {missing} within {3 * plan.timeout_s:.0f}s'}")

    async def _copy_joins(self, session: Session) -> None:
        try:
            await self.store.join(self._round_plan(session, "join", version=0), session.keeper_rank)
            session.keeper_joined = True
        except Exception as e:
            session.keeper_error = f"{type(e).__name__}: {e}"

    def joined(self, session_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member's answer to the session's join."""
        s = self.session
        if s is not None and s.plan.session_id == session_id:
            s.joined[replica_id] = error

    def pending_join(self, replica_id: str) -> Optional[SessionPlan]:
        s = self.session
        if s is not None and replica_id in s.member_ids and replica_id not in s.joined:
            return s.plan_for(replica_id)
        return None

    def end(self, why: str) -> None:
        if self.session is not None:
            logger.info("%s ended: %s", self.session.plan.session_id, why)
            self.session = None
            self._ended = why

    # ---- rounds of a session: /start_weight_update, /update_weights, /finish -----------

    def _round_plan(self, session: Session, kind: str, version: int) -> SessionRound:
        info = session.plan.init_info
        # The copy and gloo members split the stream into the trainer's bucket size.
        bucket = info.get("bucket_bytes") or info.get("packed_buffer_size_bytes") or self.sync.bucket_bytes
        return session.round_plan(self.rounds.fields(kind, version, session.plan.members, params=(), bucket_bytes=int(bucket)), self.sync.pause_mode)

    def _current(self) -> Session:
        s = self.session
        if s is None:
            why = self._ended
            raise SyncError(
                "no weight transfer engine is initialised"
                + (f" (the last session ended: {why})" if why else "")
                + "; call /get_world_size and /init_weight_transfer_engine first"
            )
        live = set(self.rounds.live())
        gone, new = sorted(s.member_ids - live), sorted(live - s.member_ids)
        if gone or new:
            self.end(f"replicas {'left: ' + str(gone) if gone else ''}{' joined: ' + str(new) if new else ''}")
            return self._current()
        return s

    def _open_update(self, session: Session) -> Optional[_Update]:
        """The undecided round of ``session``, if one is open."""
        u = self._update
        if u is None or u.rnd.decided.is_set() or u.rnd.plan.session != session.plan.session_id:
            return None
        return u

    async def start_update(self) -> None:
        """Open a round on the session's group; returns once every member has paused and
        started its update (nothing is loaded yet)."""
        refuse_round(self.membership.control.sleep, "/start_weight_update")
        session = self._current()
        open_ = self._open_update(session)
        if open_ is not None:
            raise SyncError(f"{open_.rnd.round_id} is already started; call /update_weights then /finish_weight_update")
        async with self.rounds.opening():
            plan = self._round_plan(session, "update", self.store.version + 1)
            self._update = update = _Update(self.rounds.open(plan))
        rnd = update.rnd
        logger.info("opened %s in %s: %d replicas", plan.round_id, session.plan.session_id, len(plan.members))
        await _wait_round(rnd, lambda: session.member_ids <= set(update.started), "start")

    def started(self, round_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member paused and ran ``start_weight_update`` (or failed to)."""
        u = self._update
        if u is None or u.rnd.round_id != round_id or u.rnd.decided.is_set():
            return
        u.started[replica_id] = error
        if error:
            self.rounds.close(u.rnd, f"{replica_id}: {error}", reason="replica")

    async def update_info(self, round_id: str) -> Optional[dict]:
        """Long poll for a member: the trainer's ``/update_weights`` info, or None once
        the round is decided without it (aborted)."""
        u = self._update
        if u is None or u.rnd.round_id != round_id:
            return None
        await asyncio.wait([asyncio.ensure_future(u.ready.wait()), asyncio.ensure_future(u.rnd.decided.wait())], return_when=asyncio.FIRST_COMPLETED)
        return None if u.rnd.decided.is_set() else u.info

    async def update(self, update_info: Any) -> None:
        """Hand the trainer's update info to every member (and the copy); returns once
        all received the broadcast."""
        session = self._current()
        u = self._open_update(session)
        if u is None:
            raise SyncError("no weight update is started; call /start_weight_update first")
        rnd = u.rnd
        if u.info is not None:
            raise SyncError(f"{rnd.round_id} already received its update; call /finish_weight_update")
        update_info = _with_announced(update_info, session.announced)
        specs = parse_update_info(update_info)
        check_spec(specs, self.membership.params)
        session.announced = {k: update_info[k] for k in METADATA}
        rnd.plan = dataclasses.replace(rnd.plan, params=tuple(specs))
        u.info = dict(update_info)
        u.ready.set()
        if rnd.copy_rank is not None:
            self.rounds.copy_receives(rnd)
        await _wait_round(rnd, lambda: session.member_ids <= set(rnd.reports) and (rnd.copy_rank is None or rnd.copy_reported), "update")

    async def finish_update(self, weight_version: Optional[str]) -> int:
        """Commit the session's round; returns the committed version once every member serves it."""
        session = self.session
        u = self._open_update(session) if session is not None else None
        if u is None:
            raise SyncError("no weight update is in progress; call /start_weight_update and /update_weights first")
        rnd = u.rnd
        if u.info is None:
            raise SyncError(f"{rnd.round_id} has not received its weights; call /update_weights first")
        rnd.version = parse_version(weight_version, self.store.version)
        outcome = await self.rounds.finish(rnd.round_id, None)
        if not outcome.committed:
            raise SyncError(f"{rnd.round_id} aborted: {outcome.error}; replicas keep version {outcome.version}")
        return outcome.version


async def _wait_round(rnd: RoundState, done: Callable[[], bool], step: str) -> None:
    """Wait for ``done`` in round ``rnd``; raise when the round ends without it."""
    if await _wait_until(done, max(0.0, rnd.deadline - time.monotonic()), stop=rnd.decided.is_set):
        return
    if rnd.decided.is_set():
        raise SyncError(f"{rnd.round_id} aborted at {step}: {rnd.outcome.error}; replicas keep version {rnd.outcome.version}")
    raise SyncError(f"{rnd.round_id}: {step} did not complete before the round's deadline")


async def _wait_until(done: Callable[[], bool], timeout_s: float, stop: Callable[[], bool] = lambda: False) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if stop() or time.monotonic() > deadline:
            return done()
        await asyncio.sleep(WAIT_POLL_S)
    return True
