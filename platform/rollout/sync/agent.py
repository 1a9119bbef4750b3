"""The replica side of weight sync: registers with the coordinator, long-polls for
rounds and drives vLLM's native protocol on its own engine.

Per round: ``pause_generation(mode)`` → ``init_weight_transfer_engine`` →
``start_weight_update`` → ``update_weights`` (receives every bucket) →
``finish_weight_update`` while the coordinator decides → on commit
``update_weight_version(version)`` → ``resume_generation``. The start and the update,
and the label and the resume, go to the engine core back to back (it runs them in the
order sent): one round trip each pair. The init is skipped where the engine keeps what it
last joined (nccl's kept group; ipc's init, once per engine).
A reload round from a committed checkpoint, and a storage round (a publish through
shared storage), replace the transfer steps with vLLM's ``reload_weights(weights_path)``
and the finish with ``update_weight_version``; a checkpoint with a manifest is verified
against it first (:func:`rollout.sync.storage.verify_checkpoint`), so an incomplete or
corrupted one is never loaded.
Generation stays paused from before the first tensor arrives until the round is
decided, so no token is ever computed on a mix of two versions.

A round runs in three steps (:meth:`SyncAgent._apply`), one job each:

- **transfer** moves the bytes, by the kind of round: a push or pull round joins its
  group and receives, a route session's round (whose group the members joined at the
  session's start) waits for the trainer's update info and receives, a reload round
  reloads a checkpoint. It says what it left: an error, whether tensors reached the live
  model, whether the engine is blocked for good.
- **decide** reports to the coordinator and takes its outcome; on a commit it labels the
  weights with the version.
- **recover** handles what an abort or a failed finish leaves: it closes vLLM's update,
  or marks the replica broken when the engine is blocked; the caller then restores the
  committed weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from rollout.contracts import net
from rollout.contracts.backend import delta_base_of
from rollout.contracts.backend_registry import get_backend
from rollout.contracts.sync_protocol import (
    RESTORE_ROUNDS,
    AdapterRemovalRound,
    AdapterRound,
    Control,
    DeltaBaseError,
    NoCommittedCopyError,
    NotRegisteredError,
    PullRound,
    PushRound,
    ReloadRound,
    Reregister,
    Round,
    RoundOutcome,
    SessionPlan,
    SessionRound,
    StorageRound,
)
from rollout.contracts.version import version_of
from rollout.errors import StaleWeightsError, unwrap_remote
from rollout.sync import digest
from rollout.sync.adapter_rounds import AdapterRounds
from rollout.sync.adapters import ServedAdapters
from rollout.sync.checkpoint import checkpoint_spec
from rollout.sync.clock import PhaseClock
from rollout.sync.coordinator_client import CoordinatorHandle
from rollout.sync.salt import CacheSalts
from rollout.sync.sleep import ReplicaSleep
from rollout.sync.storage import verify_checkpoint
from rollout.vllm_compat import pause_scheduler

if TYPE_CHECKING:
    from rollout.config import SyncConfig

logger = logging.getLogger(__name__)

# Seconds past a round's deadline after which an engine call that has not returned
# counts as blocked for good (see SyncAgent._transfer).
WEDGED_GRACE_S = 15.0

_NO_DIGESTS_LOGGED: set[str] = set()  # replicas whose engine wrote no digests (logged once each)


async def pause_for_update(engine: Any, mode: str, clear_cache: bool = True) -> None:
    """vLLM's ``pause_generation(mode, clear_cache)`` without its closing 20 ms sleep (on the
    critical path of every publish), queuing requests sent meanwhile in every supported
    vLLM: :func:`rollout.vllm_compat.pause_scheduler`."""
    await pause_scheduler(engine, mode, clear_cache)


def _settle(call: "asyncio.Future") -> None:
    """Let an engine call sent right behind one that failed end on its own: its outcome
    (most likely the engine's refusal, as nothing before it ran) is retrieved, not raised."""
    call.add_done_callback(lambda f: f.cancelled() or f.exception())


async def check_reachable(where: Optional[tuple[str, int]], timeout_s: float) -> None:
    """Raise :class:`~rollout.contracts.net.RendezvousUnreachable` unless the rendezvous at
    ``where`` (``(address, port)``; None where the backend has none, as ``ipc``) takes a
    connection within a few seconds."""
    if where is not None:
        address, port = where
        await net.check_reachable(address, int(port), timeout_s)


@dataclass(frozen=True)
class _Limits:
    """A round's time bounds, as the replica applies them."""

    round_s: float  # the round's step deadline
    step_s: float  # how long one engine call of the transfer may run
    # A transport with a deadline of its own (gloo) ends its steps by itself: its engine
    # calls get the round's deadline. Without one (NCCL), an engine call still running
    # well past the deadline is blocked for good.
    has_deadline: bool

    @classmethod
    def of(cls, plan: Round) -> "_Limits":
        has_deadline = get_backend(plan.backend).transport_has_deadline
        return cls(plan.timeout_s, plan.timeout_s if has_deadline else plan.timeout_s + WEDGED_GRACE_S, has_deadline)


@dataclass(frozen=True)
class _Joined:
    """A transfer group the engine joined in a publish round, with the init info it
    joined with: what a later round must name, and match, for the engine to keep it."""

    group: str
    init_info: dict[str, Any]


@dataclass
class _Transferred:
    """What the transfer step left, for decide and recover."""

    # Tensors may have reached the live model: vLLM loads them as they arrive (and a
    # reload loads into the live model too), so a round that does not commit leaves a mix.
    loaded: bool = False
    error: Optional[str] = None
    unreachable: Optional[str] = None  # the rendezvous this replica could not reach
    wedged: bool = False  # an engine call is blocked for good: nothing more can run on this engine
    finishing: Optional[asyncio.Future] = None  # vLLM's finish, run while the coordinator decides
    joined: Optional[_Joined] = None  # the publish group the engine holds after this round, if it serves it
    digests: Optional[dict[str, str]] = None  # what the engine received, per tensor (rollout.sync.digest), reported


@dataclass(frozen=True)
class _Decision:
    outcome: RoundOutcome
    finish_error: Optional[str]  # the finish started before the decision failed
    serving: bool  # committed, finished and labelled: the replica serves the round's version
    resumed: bool = False  # generation resumed with the label (sent right behind it)


class SyncAgent:
    def __init__(self, engine: Any, coordinator: Any, replica_id: str, ranks: int, model_path: str, *, sync: Optional["SyncConfig"] = None):
        """``coordinator``: a :class:`CoordinatorHandle`, or the coordinator's Serve handle
        (wrapped in one). ``sync``: the platform's sync settings (their defaults when None)."""
        if sync is None:
            from rollout.config import SyncConfig

            sync = SyncConfig()
        self.engine = engine
        self.coordinator = coordinator if isinstance(coordinator, CoordinatorHandle) else CoordinatorHandle(coordinator)
        self.replica_id = replica_id
        self.ranks = ranks
        self.params = checkpoint_spec(model_path)
        self._version = 0
        self._version_changed = asyncio.Event()
        # The newest committed version this replica has heard of (registration, rounds).
        self.committed = 0
        self._broken: Optional[str] = None
        # Paused without weights it can vouch for, and nothing to restore from: it stays up,
        # registered and refusing requests until a publish brings every member whole weights
        # (replacing it would start a replica that cannot catch up either).
        self.awaiting_publish: Optional[str] = None
        self._task: Optional[asyncio.Task] = None
        # What a trainer asked through vLLM's routes (/pause, /reset_prefix_cache), as applied here.
        self.control = Control()
        self._reset_ok = True
        # The engine's sleep (a trainer's /sleep and /wake_up, in the Control): rollout.sync.sleep.
        self.sleep = ReplicaSleep(engine, replica_id)
        # Each request's prefix-cache salt (sync.prefix_cache): with `salt`, an update
        # flushes vLLM's prefix cache only when `keep` carries requests across it.
        self.salts = CacheSalts(salting=sync.prefix_cache == "salt")
        # Replicas long-poll the coordinator (each poll returns within sync.poll_s), and one
        # silent for sync.silent_polls polls is dropped from membership: a round may then
        # commit without it. So past `lost_after_s` without an answer, this replica no
        # longer knows the committed version.
        self.lost_after_s = sync.silent_polls * sync.poll_s
        self._last_contact = time.monotonic()
        self._lost_logged = False
        self._incoming: Optional[Round] = None  # the round this replica is in
        # The transfer group this replica's engine holds from the last publish round it
        # served. Tracked here, not taken from the coordinator alone: a round that names it
        # skips the engine's init only where this replica knows its engine still holds it
        # (see _join_and_receive). Anything else that inits the engine or may have broken
        # its group forgets it: any other round (failed, aborted, a restore, a route
        # session's) and a route session's join.
        self._engine_group: Optional[_Joined] = None
        # (params_digest, params) of the last publish plan that carried them (see _round_params).
        self._params_held: Optional[tuple[str, tuple]] = None
        # The LoRA adapters this replica's engine serves (published as AdapterRounds).
        self.adapters = ServedAdapters(engine, replica_id)
        self.adapter_rounds = AdapterRounds(self.adapters, self.coordinator, replica_id, report=lambda plan, error: self._report(plan, error), version=lambda: self.version)

    @property
    def held(self) -> bool:
        """Generation is paused by a trainer's ``/pause`` until its ``/resume``."""
        return self.control.paused is not None

    @property
    def asleep(self) -> Optional[str]:
        """Why this replica refuses requests while a trainer's ``/sleep`` holds it (asleep, or
        reloading the committed weights a level-2 sleep discarded), or None."""
        return self.sleep.refusal

    @property
    def sleep_level(self) -> int:
        return self.sleep.level

    @property
    def broken(self) -> Optional[str]:
        """Why this replica must not serve, or None. A sync loop that died counts: the
        replica would otherwise stay paused (or miss rounds) behind a passing health check."""
        if self._broken is None and self._task is not None and self._task.done() and not self._task.cancelled():
            return f"weight-sync loop ended: {self._task.exception()!r}"
        return self._broken

    @broken.setter
    def broken(self, reason: Optional[str]) -> None:
        self._broken = reason

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value
        self.committed = max(self.committed, value)
        # Wake every waiter, then arm a fresh event for the next change.
        self._version_changed.set()
        self._version_changed = asyncio.Event()

    def _heard_from_coordinator(self) -> None:
        self._last_contact = time.monotonic()
        if self._lost_logged:
            logger.info("replica %s: the coordinator answers again", self.replica_id)
            self._lost_logged = False

    def coordinator_lost_s(self) -> Optional[float]:
        """Seconds since the coordinator last answered, once past ``lost_after_s``; else None."""
        if self._incoming is not None:
            return None  # in a round the coordinator opened (it does not poll meanwhile); the round's deadline bounds it
        silent = time.monotonic() - self._last_contact
        if silent <= self.lost_after_s:
            return None
        if not self._lost_logged:
            logger.error(
                "replica %s: no answer from the weight-sync coordinator for %.0fs: the committed version is unknown; "
                "requests that need a version check are refused until it answers",
                self.replica_id,
                silent,
            )
            self._lost_logged = True
        return silent

    @property
    def known_committed(self) -> Optional[int]:
        """The committed version as far as this replica can vouch for it: None while the
        coordinator is lost (a round may have committed without this replica)."""
        return None if self.coordinator_lost_s() is not None else self.committed

    def may_arrive(self, version: int) -> bool:
        """Whether ``version`` can come without a publish that has not begun: the next
        version (a publisher's default), or the one the round in progress commits (a route
        session names its version only at the end, so any)."""
        if version <= max(self.version, self.committed) + 1:
            return True
        plan = self._incoming
        if plan is None or isinstance(plan, RESTORE_ROUNDS):
            return False
        return isinstance(plan, SessionRound) or version <= plan.version

    async def wait_for_version(self, version: int, timeout_s: float) -> None:
        """Return once this replica serves ``version`` or newer; raise
        :class:`StaleWeightsError` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.version < version and not self.broken:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._version_changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        if self.version < version:
            raise StaleWeightsError(
                f"replica {self.replica_id} serves policy version {self.version} (committed {self.committed}); "
                f"version {version} did not arrive within {timeout_s:.0f}s"
            )

    async def start(self) -> None:
        self.version = version_of(await self.engine.get_weight_version())
        committed = await self._register()
        if committed > self.version:
            logger.info("replica %s: catching up from version %d to %d", self.replica_id, self.version, committed)
            await self._restore()
        # Before the first request, like the base weights: a replica that cannot load a
        # committed adapter does not start (the error names it), rather than serve without it.
        await self.adapter_rounds.catch_up()
        self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="rollout-sync-agent")

    async def _register(self) -> int:
        # With the adapters it serves: a restarted coordinator learns them back (rollout.sync.store).
        committed = await self.coordinator.register(self.replica_id, self.ranks, self.version, self.params, self.adapters.held())
        self._heard_from_coordinator()
        self.committed = max(self.committed, committed)
        return committed

    async def _poll_forever(self) -> None:
        while True:
            try:
                plan = await self.coordinator.next_round(self.replica_id, self.version, self.control, self._reset_ok)
            except Exception as e:  # any failure of the call: the coordinator restarting, gone, or its node lost
                logger.warning("replica %s: coordinator unreachable (%s: %s); retrying", self.replica_id, type(e).__name__, e)
                self.coordinator_lost_s()  # logs once when the silence passes the bound
                await asyncio.sleep(1.0)
                continue
            self._heard_from_coordinator()
            if plan is None:
                continue
            if isinstance(plan, Reregister):
                await self._reregister()
            elif isinstance(plan, Control):
                await self._apply_control(plan)
            elif isinstance(plan, SessionPlan):
                await self._join_session(plan)
            elif isinstance(plan, AdapterRound):
                await self.adapter_rounds.run(plan)
            elif isinstance(plan, AdapterRemovalRound):
                await self.adapter_rounds.remove(plan)
            else:
                await self._run_round(plan)

    async def _run_round(self, plan: Round) -> None:
        """Apply ``plan``; then, where it left weights that must not serve, restore the
        committed ones (recover's last step: after the round is reported, so the restore
        round can open)."""
        try:
            self._incoming = plan
            consistent = await self._apply(plan)
        except Exception:
            logger.exception("replica %s: %s failed unexpectedly; restoring the committed weights", self.replica_id, plan.round_id)
            consistent = False
        finally:
            self._incoming = None
        if not consistent and not self.broken:
            await self._restore()

    async def _apply_control(self, want: Control) -> None:
        try:
            woke = await self.sleep.converge(want.sleep, self._restore)
            if woke and want.paused and want.paused == self.control.paused:
                # vLLM's wake resumed its scheduler; the trainer's /pause still holds it.
                await self.engine.pause_generation(mode="keep", clear_cache=False)
            if want.paused and want.paused != self.control.paused:
                # As vLLM's /pause: the trainer's clear_cache decides. Requests sent during
                # the hold start under whatever version its /resume finds: their own salt.
                # So they queue (vLLM 0.33's pause_generation would reject them with a 503).
                await pause_for_update(self.engine, want.paused, want.clear_cache)
                self.salts.pause()
            elif not want.paused and self.control.paused:
                if self.sleep.state is None:  # asleep, vLLM resumes its scheduler once fully awake
                    await self.engine.resume_generation()
                self.salts.resume()
            if want.cache_resets != self.control.cache_resets:
                self._reset_ok = bool(await self.engine.reset_prefix_cache())
        except Exception as e:
            # Not applied: the next poll reports the old state and gets the request again.
            logger.error("replica %s: applying %s failed: %s", self.replica_id, want, e)
            await asyncio.sleep(1.0)
            return
        logger.info("replica %s: applied %s", self.replica_id, want)
        self.control = want

    async def _join_session(self, plan: SessionPlan) -> None:
        """``/init_weight_transfer_engine``: join the trainer's group; nothing is loaded."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        limit = plan.timeout_s if get_backend(plan.backend).transport_has_deadline else plan.timeout_s + WEDGED_GRACE_S
        error = None
        self._engine_group = None  # the engine joins the trainer's group instead
        try:
            # The trainer's own init info, as it posted it (vLLM's dict), with this member's rank.
            init_info = plan.member_init_info(self.replica_id)
            address, port = init_info.get("master_address"), init_info.get("master_port")
            await check_reachable((address, port) if address and port else None, plan.timeout_s)
            request = WeightTransferInitRequest(init_info=init_info)
            await asyncio.wait_for(self.engine.init_weight_transfer_engine(request), limit)
        except asyncio.TimeoutError:
            error = f"joining the trainer's group did not finish within {limit:.0f}s"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error:
            logger.error("replica %s: %s: %s", self.replica_id, plan.session_id, error)
        await self.coordinator.joined(plan.session_id, self.replica_id, error)

    async def _reregister(self) -> None:
        # The coordinator restarted (and learns the committed version back from us) or
        # dropped us as silent; if it committed a newer version meanwhile, catch up.
        try:
            committed = await self._register()
        except Exception as e:
            logger.warning("replica %s: re-registering failed (%s); retrying", self.replica_id, e)
            await asyncio.sleep(1.0)
            return
        if committed > self.version:
            await self._restore()
        try:
            await self.adapter_rounds.catch_up()
        except Exception as e:  # what it serves stays as it was; the next publish of each brings it
            logger.error("replica %s: loading the committed adapters after re-registering failed: %s", self.replica_id, e)

    async def _restore(self) -> None:
        """Load the committed weights from the coordinator's copy. With no copy to load,
        wait (paused) for the next publish; on any other failure stay broken (paused,
        failing health checks) so Serve replaces this replica."""
        reason = "restore failed"
        for attempt in (1, 2):
            try:
                plan = await self.coordinator.restore(self.replica_id)
                if await self._apply(plan) and self.version == plan.version:
                    return
                reason = f"restore round {plan.round_id} failed"
            except Exception as e:
                cause = unwrap_remote(e)
                if isinstance(cause, NotRegisteredError) and attempt == 1:
                    await self._register()  # a restarted coordinator: make ourselves known, ask again
                    continue
                if isinstance(cause, NoCommittedCopyError):
                    await self._await_publish(str(cause))
                    return
                reason = f"restore failed: {type(cause).__name__}: {cause}"
            break
        # Stay paused and fail health checks: Serve replaces this replica, and the
        # replacement catches up from the coordinator's copy when it starts.
        if not self.broken:  # a blocked engine's reason says more
            self.broken = f"weights are not the committed version ({reason})"
        logger.error("replica %s: %s", self.replica_id, self.broken)

    async def _await_publish(self, reason: str) -> None:
        try:
            await asyncio.wait_for(self.engine.pause_generation(mode="keep", clear_cache=True), self.lost_after_s)
        except Exception as e:  # the engine cannot even pause: it must go
            self.broken = f"cannot pause to wait for the next publish ({type(e).__name__}: {e})"
            logger.error("replica %s: %s", self.replica_id, self.broken)
            return
        self.awaiting_publish = f"no weights this replica can serve until the next publish ({reason})"
        logger.warning("replica %s: %s", self.replica_id, self.awaiting_publish)

    # ---- one round: transfer, decide, recover ---------------------------------------

    async def _apply(self, plan: Round) -> bool:
        """Run one round; return False when it left the weights inconsistent.

        Generation stays paused in that case (requests queue, none is served) until a
        restore round brings the committed weights back.
        """
        limits = _Limits.of(plan)
        clock = PhaseClock()
        # Before the pause: generation goes on while the checkpoint is read (and before the
        # salts' pause, so requests handed over meanwhile keep the version they run under).
        refused = await self._verify(plan, clock, limits)
        # Given back below only by a publish round this replica serves.
        kept, self._engine_group = self._engine_group, None
        # Under a trainer's /pause, pause again in "keep": it aborts nothing the hold keeps
        # (requests sent meanwhile included).
        mode = "keep" if self.held else plan.pause_mode
        # No KV computed under the old weights may serve after the update. With salts,
        # requests started later never reuse it; but requests `keep` carries across the
        # update hold theirs, and only vLLM's reset makes them compute it again (it
        # preempts them and clears the prefix cache). With `flush`, every update resets,
        # and so does a round under a trainer's hold (vLLM's routes: unchanged from before
        # salting; the trainer's own /pause and /reset_prefix_cache act as vLLM's do).
        carried = self.salts.pause()
        flush = not self.salts.salting or self.held or (mode == "keep" and carried)
        consistent = resumed = False
        try:
            async with clock("pause"):
                await asyncio.wait_for(pause_for_update(self.engine, mode, clear_cache=flush), limits.round_s)
            moved = refused if refused is not None else await self._transfer(plan, clock, limits, kept)
            decision = await self._decide(plan, moved, clock, limits)
            resumed = decision.resumed
            if decision.serving:
                self._engine_group = moved.joined
            consistent = decision.serving or await self._recover(plan, moved, decision, limits)
        finally:
            # A round that served its version resumed with its label (_decide).
            if consistent and not resumed and self._resumes_after_round():
                async with clock("resume"):
                    await self.engine.resume_generation()
            # A round that leaves the engine paused waits for a restore, which pauses
            # again (and flushes if requests handed over meanwhile are still unfinished).
            self.salts.resume()
        logger.info("replica %s: %s took %s", self.replica_id, plan.round_id, clock)
        await self.coordinator.applied(plan.round_id, self.replica_id, self.version, clock.phases)
        return consistent

    async def _transfer(self, plan: Round, clock: PhaseClock, limits: _Limits, kept: Optional[_Joined] = None) -> _Transferred:
        """Move the round's weights into the engine, by the kind of round; never raises
        for a failed step (it is in the result, for the coordinator to hear). ``kept``: the
        group the engine holds from the last publish round this replica served."""
        moved = _Transferred()
        try:
            match plan:
                case ReloadRound() | StorageRound():
                    await self._reload(plan, moved, clock, limits)
                case SessionRound():
                    await self._receive_in_session(plan, moved, clock, limits)
                case PushRound() | PullRound():
                    await self._join_and_receive(plan, moved, clock, limits, kept)
                case _:
                    raise TypeError(f"not a round: {type(plan).__name__}")
        except asyncio.TimeoutError:
            # The engine call is still running in the engine core. Without a transport
            # deadline its worker is blocked in a collective whose peer is gone, and every
            # later call (finish, pause, reload) would queue behind it forever.
            moved.error = f"the engine did not finish {clock.current} within {limits.step_s:.0f}s"
            if clock.current == "join":
                # Its rendezvous answered (probed first): what hangs is the transport's own
                # connections, which a firewall that drops them leaves waiting like this.
                moved.error += f" (the rendezvous answered; the transport's own connections did not: {net.TRANSPORT_PORTS_HINT})"
            moved.wedged = not limits.has_deadline
        except net.RendezvousUnreachable as e:
            moved.error, moved.unreachable = str(e), e.target
        except Exception as e:
            moved.error = f"{type(e).__name__}: {e}"
        if moved.error is not None:
            logger.error("replica %s: %s failed: %s", self.replica_id, plan.round_id, moved.error)
        elif not isinstance(plan, (ReloadRound, StorageRound)):
            # vLLM's finish (the layerwise reload's finalization) does not depend on the
            # decision: it runs while the coordinator decides, and only the version label
            # waits for the commit. After an abort the weights are restored either way.
            moved.finishing = asyncio.ensure_future(asyncio.wait_for(self.engine.finish_weight_update(), limits.step_s))
        return moved

    async def _verify(self, plan: Round, clock: PhaseClock, limits: _Limits) -> Optional[_Transferred]:
        """Check a checkpoint this round reloads against its manifest (a storage publish's,
        or a restore from one), before anything pauses or loads. A checkpoint that is
        incomplete, corrupted or not the write the publisher verified fails the round
        (a CheckpointError naming the file) and the weights stay the committed ones: what
        the transfer step leaves when it fails before loading. None: nothing to check, or
        the checkpoint is whole."""
        manifest = plan.manifest if isinstance(plan, (ReloadRound, StorageRound)) else ""
        if not manifest:
            return None
        try:
            async with clock("verify"):
                await asyncio.wait_for(asyncio.to_thread(verify_checkpoint, plan.checkpoint, expect_manifest=manifest), limits.step_s)
            return None
        except asyncio.TimeoutError:
            error = f"verifying {plan.checkpoint} did not finish within {limits.step_s:.0f}s (sync.timeout_s)"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        logger.error("replica %s: %s refused: %s", self.replica_id, plan.round_id, error)
        return _Transferred(error=error)

    async def _reload(self, plan: Union[ReloadRound, StorageRound], moved: _Transferred, clock: PhaseClock, limits: _Limits) -> None:
        moved.loaded = True  # vLLM reloads into the live model too
        async with clock("reload"):
            await asyncio.wait_for(self.engine.collective_rpc("reload_weights", kwargs={"weights_path": plan.checkpoint}), limits.step_s)

    async def _join_and_receive(self, plan: Union[PushRound, PullRound], moved: _Transferred, clock: PhaseClock, limits: _Limits, kept: Optional[_Joined]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        backend = get_backend(plan.backend)
        offered = plan.transfer_info if isinstance(plan, PushRound) else None
        base = delta_base_of(offered)
        if base is not None and base != self.version:
            # Before anything joins or loads: a delta never lands on another version.
            raise DeltaBaseError(f"{plan.round_id} is a delta onto version {base}; replica {self.replica_id} serves version {self.version}")
        async with clock("join"):  # ~0 where the engine keeps its group
            init_info = backend.engine_init_info(plan, plan.member(self.replica_id))
            # An engine that forms no group (init_once: ipc) is known by its init info alone.
            group = "" if backend.init_once else plan.group
            joined = _Joined(group, init_info) if isinstance(plan, PushRound) else None
            named = plan.transfer.group_name  # a kept group the coordinator names, or ""
            if backend.init_once and joined is not None and joined == kept:
                # Its last init (in the last publish round this replica served) set exactly
                # this: one engine round trip less per steady round (issue 41).
                logger.debug("replica %s: %s: the engine keeps its %s init (no init)", self.replica_id, plan.round_id, plan.backend)
            elif backend.engine_keeps_group and named and joined == kept:
                # The engine holds this group from the last round this replica served: an
                # init would form a new communicator the trainer does not join.
                logger.info("replica %s: %s: the engine keeps transfer group %s (no init)", self.replica_id, plan.round_id, named)
            else:
                if backend.engine_keeps_group and named:
                    # The coordinator's and this replica's view differ (they should not):
                    # init as for a new group rather than trust either.
                    held = f"it last joined {kept.group}" if kept is not None else "it holds none it can vouch for"
                    logger.warning("replica %s: %s names kept transfer group %s, but %s: initialising", self.replica_id, plan.round_id, named, held)
                else:
                    logger.info("replica %s: %s: %s transfer group %s (init)", self.replica_id, plan.round_id, "kept" if named else "new", plan.group)
                if not named:  # a kept group's rendezvous was reached before
                    await check_reachable(backend.rendezvous(plan), limits.round_s)
                await asyncio.wait_for(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)), limits.step_s)
        moved.joined = joined
        await self._receive(plan, backend.update_info(self._round_params(plan), offered), clock, limits, moved, start=True)

    def _round_params(self, plan: Union[PushRound, PullRound]) -> tuple:
        """The round's parameters: the plan's, or, where it names them by digest alone (a
        member that holds its offer: ipc), those of the last plan that carried them."""
        digest = plan.params_digest if isinstance(plan, PushRound) else ""
        if plan.params or not digest:
            if digest:
                self._params_held = (digest, plan.params)
            return plan.params
        if self._params_held is None or self._params_held[0] != digest:
            # Nothing was loaded: the round fails, and the next gives every member its offer in full.
            raise ValueError(f"{plan.round_id} names its parameters by digest {digest[:16]}…, which this replica does not hold")
        return self._params_held[1]

    async def _receive_in_session(self, plan: SessionRound, moved: _Transferred, clock: PhaseClock, limits: _Limits) -> None:
        # A route session's members joined its group at the session's start.
        await self._start_update(moved, clock, limits)
        async with clock("trainer"):
            update_info = await self._session_update_info(plan)
        await self._receive(plan, update_info, clock, limits, moved)

    async def _start_update(self, moved: _Transferred, clock: PhaseClock, limits: _Limits) -> None:
        async with clock("start"):
            await asyncio.wait_for(self.engine.start_weight_update(), limits.step_s)
        moved.loaded = True

    async def _receive(self, plan: Round, update_info: dict, clock: PhaseClock, limits: _Limits, moved: _Transferred, *, start: bool = False) -> None:
        """vLLM's ``update_weights``; with ``start``, its ``start_weight_update`` first, both
        sent before either answers (below)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        # Where the backend's engine digests what it receives, it leaves the digests at a
        # path named here (its update_weights returns nothing); they go with the report.
        path = digest.received_path(self.replica_id, plan.round_id) if get_backend(plan.backend).digests_received else None
        if path is not None:
            update_info = {**update_info, "digest_path": path}
        request = WeightTransferUpdateRequest(update_info=update_info)
        if start:
            # The start and the update go to the engine core back to back: each call's
            # message is sent as its task first runs, in creation order, over one socket,
            # and the engine core runs utility calls in the order they arrive. So the update
            # runs right after the start, without waiting a round trip for the start's
            # answer (issue 41). A start that fails leaves the worker with no update
            # session, and its update_weights then refuses before touching a weight.
            moved.loaded = True  # before sending: at worst an extra restore
            starting = asyncio.ensure_future(self.engine.start_weight_update())
            updating = asyncio.ensure_future(self.engine.update_weights(request))
            try:
                async with clock("start"):
                    await asyncio.wait_for(starting, limits.step_s)
            except BaseException:
                _settle(updating)
                raise
            async with clock("receive"):
                await asyncio.wait_for(updating, limits.step_s)
        else:
            async with clock("receive"):
                await asyncio.wait_for(self.engine.update_weights(request), limits.step_s)
        if path is not None:
            got = digest.read_received(path)
            if got is not None:
                moved.digests = got.digests
                clock.phases["receive.digest"] = got.seconds  # within "receive": the engine's share of it
            elif self.replica_id not in _NO_DIGESTS_LOGGED:
                # Reported without: the coordinator does not compare this replica's bytes.
                _NO_DIGESTS_LOGGED.add(self.replica_id)
                logger.warning("replica %s: the engine leaves no digests of what it receives (%s): its bytes are not verified", self.replica_id, path)

    async def _session_update_info(self, plan: SessionRound) -> dict:
        """A route session's round: say this member started, then wait for the trainer's
        ``/update_weights`` (the round's deadline bounds the wait)."""
        await self.coordinator.started(plan.round_id, self.replica_id, None)
        info = await self.coordinator.update_info(plan.round_id, self.replica_id)
        if info is None:
            raise RuntimeError(f"{plan.round_id} ended before the trainer's /update_weights")
        return info

    async def _decide(self, plan: Round, moved: _Transferred, clock: PhaseClock, limits: _Limits) -> _Decision:
        """Report, take the coordinator's outcome, and on a commit label the weights."""
        async with clock("decision"):
            outcome = await self._report(plan, moved.error, moved.unreachable, moved.digests)
        self.committed = max(self.committed, outcome.version)
        finish_error = await self._finished(moved.finishing, clock)
        if not outcome.committed or finish_error is not None:
            return _Decision(outcome, finish_error, serving=False)
        # Tokens are labelled with the engine's version from the resume on. The label and
        # the resume go to the engine core back to back (one round trip, not two: issue 41):
        # it runs them in the order sent, so no token is computed after the resume under
        # the old label. Only a dead engine core fails the label, and then the resume too.
        labelling = asyncio.ensure_future(self.engine.update_weight_version(str(outcome.version)))
        resuming = asyncio.ensure_future(self.engine.resume_generation()) if self._resumes_after_round() else None
        try:
            async with clock("version"):
                await asyncio.wait_for(labelling, limits.round_s)
        except BaseException:
            if resuming is not None:
                _settle(resuming)
            raise
        self.version = outcome.version
        self.awaiting_publish = None  # every round carries the full model: whole weights again
        if resuming is not None:
            async with clock("resume"):
                await asyncio.wait_for(resuming, limits.round_s)
        return _Decision(outcome, None, serving=True, resumed=resuming is not None)

    def _resumes_after_round(self) -> bool:
        """Whether a round that leaves consistent weights resumes generation: not under a
        trainer's hold, nor while waiting for a publish, nor while any tag sleeps (a round
        under a partial wake: vLLM's wake resumes the scheduler once every tag is awake)."""
        return not self.held and not self.awaiting_publish and self.sleep.state is None

    async def _recover(self, plan: Round, moved: _Transferred, decision: _Decision, limits: _Limits) -> bool:
        """What a round that does not serve its version leaves; whether the weights are
        still the committed ones (nothing was loaded)."""
        if moved.wedged:
            # Nothing more can run on this engine: fail health checks so Serve replaces
            # the replica; the replacement catches up to the committed version as it starts.
            self.broken = f"{plan.round_id}: {moved.error}; the engine is blocked and this replica must be replaced"
            logger.error("replica %s: %s", self.replica_id, self.broken)
            return False
        if not moved.loaded:
            return True  # nothing was loaded
        # vLLM loads tensors into the live model as they arrive: after a partial transfer
        # (or a failed finish) the weights are a mix of two versions and must not serve.
        why = decision.finish_error if decision.outcome.committed else f"aborted mid-transfer ({decision.outcome.error})"
        logger.error("replica %s: %s %s; restoring", self.replica_id, plan.round_id, why)
        if moved.finishing is None and not isinstance(plan, (ReloadRound, StorageRound)):
            await self._close_update(limits.round_s)
        return False

    async def _finished(self, finishing: Optional[asyncio.Future], clock: PhaseClock) -> Optional[str]:
        """Wait for the finish started before the decision; its error, or None."""
        if finishing is None:
            return None
        async with clock("finish"):
            try:
                await finishing
            except asyncio.TimeoutError:
                return "finishing the update did not end within the step deadline"
            except Exception as e:
                return f"finishing the update failed: {type(e).__name__}: {e}"
        return None

    async def _report(self, plan: Round, error: Optional[str], unreachable: Optional[str] = None, digests: Optional[dict[str, str]] = None) -> RoundOutcome:
        """The round's decision; an unreachable coordinator counts as an abort, so the
        weights are restored rather than trusted."""
        try:
            outcome = await self.coordinator.report(plan.round_id, self.replica_id, error, unreachable, digests)
        except Exception as e:
            logger.error("replica %s: reporting %s failed (%s); treating it as aborted", self.replica_id, plan.round_id, e)
            return RoundOutcome(plan.round_id, False, -1, f"report failed: {e}", [self.replica_id])
        self._heard_from_coordinator()
        return outcome

    async def _close_update(self, timeout_s: float) -> None:
        # End vLLM's update session so the restore round can start a fresh one; the
        # restore overwrites every tensor, so what this finalizes is never served.
        try:
            await asyncio.wait_for(self.engine.finish_weight_update(), timeout_s)
        except Exception as e:
            logger.warning("replica %s: closing the aborted update: %s", self.replica_id, e)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.adapters.close()
