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
live replica has.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rollout.errors import InvalidRequestError
from rollout.sync.protocol import Control, ParamSpec, PauseMode, SessionPlan, SyncError
from rollout.sync.rules import assign_ranks, check_spec

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.02  # how often a route re-checks what it waits for


@dataclass
class Session:
    plan: SessionPlan
    keeper_rank: Optional[int]
    joined: dict[str, Optional[str]] = field(default_factory=dict)  # replica -> error or None
    keeper_joined: bool = False
    keeper_error: Optional[str] = None

    def __post_init__(self) -> None:
        # Asked on every poll of every replica: built once, not per call (that made a
        # session's polls cost the square of its members).
        self.by_id = {m.replica_id: m for m in self.plan.members}
        self.member_ids = frozenset(self.by_id)

    def plan_for(self, replica_id: str) -> SessionPlan:
        """The plan as one member receives it: only its own entry of ``members``."""
        return dataclasses.replace(self.plan, members=(self.by_id[replica_id],)) if len(self.plan.members) > 1 else self.plan


def _required(info: dict, key: str, kind: type) -> Any:
    value = info.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidRequestError(f"init_info.{key}", f"required, a {kind.__name__}; got {value!r}")
    return value


def parse_update_info(update_info: Any) -> list[ParamSpec]:
    """The parameters an ``/update_weights`` call announces, checked for shape."""
    if not isinstance(update_info, dict):
        raise InvalidRequestError("update_info", "must be one object (names, dtype_names, shapes); lists of them are not supported")
    for key in update_info:
        # vLLM's IPC engine unpickles its handles (ipc_handles_pickled): code execution in
        # every engine for whoever reaches this route. Nothing from the network is unpickled.
        if "pickle" in str(key).lower() or str(key) == "ipc_handles":
            raise InvalidRequestError(f"update_info.{key}", "pickled data is not accepted over HTTP; publish IPC handles with WeightPublisher.connect inside the cluster")
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
    """The coordinator's side of vLLM's RL routes (mixed into WeightSyncCoordinator,
    whose state it uses: replicas, rounds, the round lock, the keeper)."""

    def _init_sessions(self) -> None:
        self.control = Control()
        self._session: Optional[Session] = None
        self._session_ended: Optional[str] = None  # why the last one ended, for the next start's error

    # ---- pause, resume, caches ----------------------------------------------------------

    async def pause(self, token: Optional[str], mode: PauseMode, clear_cache: bool) -> None:
        """``/pause``: every live replica holds generation until ``/resume``."""
        await self._authorize(token)
        await self._set_control(dataclasses.replace(self.control, paused=mode, clear_cache=clear_cache))

    async def resume(self, token: Optional[str]) -> None:
        await self._authorize(token)
        await self._set_control(dataclasses.replace(self.control, paused=None, clear_cache=False))

    async def reset_prefix_cache(self, token: Optional[str]) -> bool:
        """Whether every replica's reset succeeded (vLLM's fails while blocks are held)."""
        await self._authorize(token)
        await self._set_control(dataclasses.replace(self.control, cache_resets=self.control.cache_resets + 1))
        return all(r.reset_ok for r in self.replicas.values())

    async def paused(self, token: Optional[str]) -> bool:
        await self._authorize(token)
        return self.control.paused is not None

    async def weight_version(self, token: Optional[str]) -> int:
        await self._authorize(token)
        return self.committed_version

    async def _set_control(self, c: Control) -> None:
        """Returns once every live replica applied ``c`` (they poll at once: woken here).
        If some did not in time, the previous control is restored (replicas that applied
        ``c`` undo it on their next poll) and the call fails: nothing is left half paused."""
        previous, self.control = self.control, c
        self._wake_all()
        # Long enough for a replica that went away (scaled down, died) without a word to be
        # dropped as silent (3 polls): waiting on it must not fail the call.
        timeout = max(self.config.sync.timeout_s, 3 * self.poll_s) + self.poll_s
        if not await self._wait_until(lambda: all(self.replicas[rid].control == c for rid in self._live()), timeout):
            behind = sorted(rid for rid, r in self.replicas.items() if r.control != c)
            self.control = previous
            self._wake_all()
            raise SyncError(f"replicas {behind} did not apply {c} within {timeout:.0f}s (a round in progress holds them); nothing changed")

    def _wake_all(self) -> None:
        for r in self.replicas.values():
            r.wake.set()

    # ---- the session: /get_world_size, /init_weight_transfer_engine ---------------------

    def inference_world_size(self) -> int:
        """The ranks a trainer must count besides its own: every live replica's, plus
        the coordinator's copy where the backend keeps one (it receives the broadcast too)."""
        return sum(self._live().values()) + (1 if self.keeper is not None else 0)

    async def world_size(self, token: Optional[str]) -> int:
        await self._authorize(token)
        return self.inference_world_size()

    async def open_session(self, token: Optional[str], init_info: dict) -> None:
        """Every live replica (and the keeper) joins the trainer's group; returns when all have."""
        await self._authorize(token)
        if self.params is None:
            raise SyncError("no engine replica has registered yet")
        if not isinstance(init_info, dict):
            raise InvalidRequestError("init_info", "must be an object")
        if init_info.get("nccl_unique_id_b64"):
            raise InvalidRequestError("init_info.nccl_unique_id_b64", "not supported here: pass master_address and master_port (the replicas rendezvous over TCP)")
        _required(init_info, "master_address", str)
        if self.keeper is not None:
            _required(init_info, "group_name", str)  # the coordinator's copy joins the same gloo group
        port = _required(init_info, "master_port", int)
        if not 1 <= port <= 65535:
            raise InvalidRequestError("init_info.master_port", f"{port} is not a TCP port")
        world = _required(init_info, "world_size", int)
        offset = init_info.get("rank_offset", 1)
        if offset != 1:
            raise InvalidRequestError("init_info.rank_offset", f"must be 1 (one trainer rank, 0, sends); got {offset!r}")
        await self._acquire_round()
        try:
            expected = 1 + self.inference_world_size()
            if world != expected:
                raise InvalidRequestError(
                    "init_info.world_size", f"{world} does not match 1 trainer rank + {expected - 1} inference ranks; ask /get_world_size again (replicas come and go)"
                )
            live = self._live()
            members, world_size = assign_ranks(live)
            keeper_rank = world_size if self.keeper is not None else None
            info = {k: v for k, v in init_info.items() if k != "rank_offset"}
            plan = SessionPlan(f"session-{uuid.uuid4().hex[:8]}", self.backend, members, expected, info, self.config.sync.timeout_s)
            self._session = session = Session(plan, keeper_rank)
            for m in members:
                self.replicas[m.replica_id].wake.set()
            if keeper_rank is not None:
                asyncio.get_running_loop().create_task(self._keeper_join(session))
            logger.info("opened %s: %d replicas join the trainer's group (world size %d)", plan.session_id, len(members), expected)
            done = await self._wait_until(
                lambda: session.member_ids <= set(session.joined) and (keeper_rank is None or session.keeper_joined),
                3 * plan.timeout_s,
                stop=lambda: any(session.joined.values()) or session.keeper_error is not None,
            )
            errors = {rid: e for rid, e in session.joined.items() if e}
            if session.keeper_error:
                errors["the coordinator's copy"] = session.keeper_error
            if errors or not done:
                self._end_session(f"joining failed: {errors or 'timed out'}")
                missing = sorted(session.member_ids - set(session.joined))
                raise SyncError(f"{plan.session_id}: joining the trainer's group failed: {errors or f'no answer from {missing} within {3 * plan.timeout_s:.0f}s'}")
        finally:
            self._round_lock.release()

    async def _keeper_join(self, session: Session) -> None:
        from rollout.sync.backends.gloo import rendezvous

        try:
            plan = self._session_round_plan(session, "join", version=0)
            await asyncio.to_thread(self.keeper.join, rendezvous(plan), session.keeper_rank)
            session.keeper_joined = True
        except Exception as e:
            session.keeper_error = f"{type(e).__name__}: {e}"

    async def joined(self, session_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member's answer to the session's join."""
        self._seen(replica_id)
        s = self._session
        if s is not None and s.plan.session_id == session_id:
            s.joined[replica_id] = error

    def _pending_join(self, replica_id: str) -> Optional[SessionPlan]:
        s = self._session
        if s is not None and replica_id in s.member_ids and replica_id not in s.joined:
            return s.plan_for(replica_id)
        return None

    def _end_session(self, why: str) -> None:
        if self._session is not None:
            logger.info("%s ended: %s", self._session.plan.session_id, why)
            self._session = None
            self._session_ended = why

    async def shutdown_session(self, token: Optional[str]) -> None:
        """``/shutdown_weight_transfer_engine``: the next update needs a new ``init``."""
        await self._authorize(token)
        self._end_session("the trainer shut the weight transfer engine down")

    # ---- rounds of a session: /start_weight_update, /update_weights, /finish -----------

    def _session_round_plan(self, session: Session, kind: str, version: int):
        info = session.plan.init_info
        # The keeper and gloo members split the stream into the trainer's bucket size.
        bucket = info.get("bucket_bytes") or info.get("packed_buffer_size_bytes") or self.config.sync.bucket_bytes
        return self._plan(
            f"{kind}-{version}",
            version,
            session.plan.members,
            world_size=session.plan.world_size,
            master_address=info["master_address"],
            master_port=info["master_port"],
            params=(),
            pause_mode=self.config.sync.pause_mode,
            keeper_rank=session.keeper_rank,
            group_name=str(info.get("group_name", "")),
            session=session.plan.session_id,
            bucket_bytes=int(bucket),
        )

    def _current_session(self) -> Session:
        s = self._session
        if s is None:
            why = self._session_ended
            raise SyncError(
                "no weight transfer engine is initialised"
                + (f" (the last session ended: {why})" if why else "")
                + "; call /get_world_size and /init_weight_transfer_engine first"
            )
        live = set(self._live())
        gone, new = sorted(s.member_ids - live), sorted(live - s.member_ids)
        if gone or new:
            self._end_session(f"replicas {'left: ' + str(gone) if gone else ''}{' joined: ' + str(new) if new else ''}")
            return self._current_session()
        return s

    async def start_update(self, token: Optional[str]) -> None:
        """Open a round on the session's group; returns once every member has paused and
        started its update (nothing is loaded yet)."""
        await self._authorize(token)
        session = self._current_session()
        if self.round is not None and not self.round.decided.is_set() and self.round.plan.session == session.plan.session_id:
            raise SyncError(f"{self.round.plan.round_id} is already started; call /update_weights then /finish_weight_update")
        await self._acquire_round()
        try:
            plan = self._session_round_plan(session, "update", self.committed_version + 1)
            self._start_round(plan)
        except BaseException:
            self._round_lock.release()
            raise
        rnd = self.round
        logger.info("opened %s in %s: %d replicas", plan.round_id, session.plan.session_id, len(plan.members))
        await self._wait_round(rnd, lambda: session.member_ids <= set(rnd.started), "start")

    async def started(self, round_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member paused and ran ``start_weight_update`` (or failed to)."""
        self._seen(replica_id)
        rnd = self.round
        if rnd is None or rnd.plan.round_id != round_id or rnd.decided.is_set():
            return
        rnd.started[replica_id] = error
        if error:
            self._close_round(rnd, f"{replica_id}: {error}", reason="replica")

    async def update_info(self, round_id: str, replica_id: str) -> Optional[dict]:
        """Long poll for a member: the trainer's ``/update_weights`` info, or None once
        the round is decided without it (aborted)."""
        self._seen(replica_id)
        rnd = self.round
        if rnd is None or rnd.plan.round_id != round_id:
            return None
        await asyncio.wait([asyncio.ensure_future(rnd.update_ready.wait()), asyncio.ensure_future(rnd.decided.wait())], return_when=asyncio.FIRST_COMPLETED)
        return None if rnd.decided.is_set() else rnd.update_info

    async def update(self, token: Optional[str], update_info: Any) -> None:
        """Hand the trainer's update info to every member (and the keeper); returns once
        all received the broadcast."""
        await self._authorize(token)
        session = self._current_session()
        rnd = self.round
        if rnd is None or rnd.decided.is_set() or rnd.plan.session != session.plan.session_id:
            raise SyncError("no weight update is started; call /start_weight_update first")
        if rnd.update_info is not None:
            raise SyncError(f"{rnd.plan.round_id} already received its update; call /finish_weight_update")
        specs = parse_update_info(update_info)
        check_spec(specs, self.params)
        rnd.plan = dataclasses.replace(rnd.plan, params=tuple(specs))
        rnd.update_info = dict(update_info)
        rnd.update_ready.set()
        if rnd.plan.keeper_rank is not None:
            asyncio.get_running_loop().create_task(self._keep(rnd, rnd.plan.keeper_rank))
        await self._wait_round(
            rnd, lambda: session.member_ids <= set(rnd.reports) and (rnd.plan.keeper_rank is None or rnd.keeper_reported), "update"
        )

    async def finish_update(self, token: Optional[str], weight_version: Optional[str]) -> int:
        """Commit the session's round; returns the committed version once every member serves it."""
        await self._authorize(token)
        rnd = self.round
        session = self._session
        if session is None or rnd is None or rnd.decided.is_set() or rnd.plan.session != session.plan.session_id:
            raise SyncError("no weight update is in progress; call /start_weight_update and /update_weights first")
        if rnd.update_info is None:
            raise SyncError(f"{rnd.plan.round_id} has not received its weights; call /update_weights first")
        rnd.version = parse_version(weight_version, self.committed_version)
        outcome = await self._finish(rnd.plan.round_id, None)  # (authorized above)
        if not outcome.committed:
            raise SyncError(f"{rnd.plan.round_id} aborted: {outcome.error}; replicas keep version {outcome.version}")
        return outcome.version

    async def _wait_round(self, rnd, done: Callable[[], bool], step: str) -> None:
        """Wait for ``done`` in round ``rnd``; raise when the round ends without it."""
        if await self._wait_until(done, max(0.0, rnd.deadline - time.monotonic()), stop=rnd.decided.is_set):
            return
        if rnd.decided.is_set():
            raise SyncError(f"{rnd.plan.round_id} aborted at {step}: {rnd.outcome.error}; replicas keep version {rnd.outcome.version}")
        raise SyncError(f"{rnd.plan.round_id}: {step} did not complete before the round's deadline")

    @staticmethod
    async def _wait_until(done: Callable[[], bool], timeout_s: float, stop: Callable[[], bool] = lambda: False) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if stop() or time.monotonic() > deadline:
                return done()
            await asyncio.sleep(WAIT_POLL_S)
        return True
