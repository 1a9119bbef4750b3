"""The replica side of weight sync: registers with the coordinator, long-polls for
rounds and drives vLLM's native protocol on its own engine.

Per round: ``pause_generation(mode)`` → ``init_weight_transfer_engine`` →
``start_weight_update`` → ``update_weights`` (receives every bucket) →
``finish_weight_update`` while the coordinator decides → on commit
``update_weight_version(version)`` → ``resume_generation``.
A restore round from a committed checkpoint replaces the transfer steps with vLLM's
``reload_weights(weights_path)`` and the finish with ``update_weight_version``.
Generation stays paused from before the first tensor arrives until the round is
decided, so no token is ever computed on a mix of two versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from rollout.errors import StaleWeightsError, unwrap_remote
from rollout.sync import net
from rollout.sync.backends import get_backend
from rollout.sync.checkpoint import checkpoint_spec
from rollout.sync.clock import PhaseClock
from rollout.sync.protocol import POLL_S, SILENT_POLLS, Control, NoCommittedCopyError, NotRegisteredError, Reregister, RoundOutcome, RoundPlan, SessionPlan
from rollout.sync.version import version_of

logger = logging.getLogger(__name__)

# Seconds past a round's deadline after which an engine call that has not returned
# counts as blocked for good (see SyncAgent._apply).
WEDGED_GRACE_S = 15.0

_PAUSE_FALLBACK_LOGGED = False


async def pause_for_update(engine: Any, mode: str) -> None:
    """vLLM's ``pause_generation(mode, clear_cache=True)`` without its closing 20 ms sleep.

    That sleep only lets the last outputs of requests the pause ended reach their callers
    before the method returns, which vLLM notes is not needed for correctness; in a sync
    round it sits on the critical path of every publish, and nothing here waits on that
    ordering (vLLM labels tokens with the version they were computed under). An engine
    without those calls gets ``pause_generation`` itself.
    """
    core, renderer = getattr(engine, "engine_core", None), getattr(engine, "renderer", None)
    if not hasattr(core, "pause_scheduler_async") or not hasattr(renderer, "clear_mm_cache_async"):
        global _PAUSE_FALLBACK_LOGGED
        if not _PAUSE_FALLBACK_LOGGED:
            logger.info("the engine has no engine_core.pause_scheduler_async: sync rounds pause through pause_generation (20 ms more each)")
            _PAUSE_FALLBACK_LOGGED = True
        await engine.pause_generation(mode=mode, clear_cache=True)
        return
    await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=True)


async def check_reachable(init_info: dict, timeout_s: float) -> None:
    """Raise :class:`~rollout.sync.net.RendezvousUnreachable` unless the rendezvous in
    ``init_info`` (where the backend has one) takes a connection within a few seconds."""
    address, port = init_info.get("master_address"), init_info.get("master_port")
    if address and port:  # ipc has none: replicas read the trainer's handles
        await net.check_reachable(address, int(port), timeout_s)


class SyncAgent:
    def __init__(self, engine: Any, coordinator: Any, replica_id: str, ranks: int, model_path: str):
        self.engine = engine
        self.coordinator = coordinator
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
        # Last answer from the coordinator; past `lost_after_s` without one, the coordinator
        # may have dropped this replica and committed without it.
        self.lost_after_s = SILENT_POLLS * POLL_S
        self._last_contact = time.monotonic()
        self._lost_logged = False
        self._incoming: Optional[RoundPlan] = None  # the publish round this replica is in

    @property
    def held(self) -> bool:
        """Generation is paused by a trainer's ``/pause`` until its ``/resume``."""
        return self.control.paused is not None

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
        return plan is not None and not plan.restore and (plan.session or version <= plan.version)

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
        self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="rollout-sync-agent")

    async def _register(self) -> int:
        committed = await self.coordinator.register.remote(self.replica_id, self.ranks, self.version, self.params)
        self._heard_from_coordinator()
        self.committed = max(self.committed, committed)
        return committed

    async def _poll_forever(self) -> None:
        while True:
            try:
                plan = await self.coordinator.next_round.remote(self.replica_id, self.version, self.control, self._reset_ok)
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
                continue
            if isinstance(plan, Control):
                await self._apply_control(plan)
                continue
            if isinstance(plan, SessionPlan):
                await self._join_session(plan)
                continue
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
            if want.paused and want.paused != self.control.paused:
                await self.engine.pause_generation(mode=want.paused, clear_cache=want.clear_cache)
            elif not want.paused and self.control.paused:
                await self.engine.resume_generation()
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
        try:
            init_info = plan.member_init_info(self.replica_id)
            await check_reachable(init_info, plan.timeout_s)
            request = WeightTransferInitRequest(init_info=init_info)
            await asyncio.wait_for(self.engine.init_weight_transfer_engine(request), limit)
        except asyncio.TimeoutError:
            error = f"joining the trainer's group did not finish within {limit:.0f}s"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error:
            logger.error("replica %s: %s: %s", self.replica_id, plan.session_id, error)
        await self.coordinator.joined.remote(plan.session_id, self.replica_id, error)

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

    async def _restore(self) -> None:
        """Load the committed weights from the coordinator's copy. With no copy to load,
        wait (paused) for the next publish; on any other failure stay broken (paused,
        failing health checks) so Serve replaces this replica."""
        reason = "restore failed"
        for attempt in (1, 2):
            try:
                plan = await self.coordinator.restore.remote(self.replica_id)
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
            await asyncio.wait_for(self.engine.pause_generation(mode="keep", clear_cache=True), POLL_S * SILENT_POLLS)
        except Exception as e:  # the engine cannot even pause: it must go
            self.broken = f"cannot pause to wait for the next publish ({type(e).__name__}: {e})"
            logger.error("replica %s: %s", self.replica_id, self.broken)
            return
        self.awaiting_publish = f"no weights this replica can serve until the next publish ({reason})"
        logger.warning("replica %s: %s", self.replica_id, self.awaiting_publish)

    async def _apply(self, plan: RoundPlan) -> bool:
        """Run one round; return False when it left the weights inconsistent.

        Generation stays paused in that case (requests queue, none is served) until a
        restore round brings the committed weights back.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        t = plan.timeout_s
        # A transport with a deadline of its own (gloo) ends its steps by itself: its engine
        # calls get the round's deadline. Without one (NCCL), an engine call still running
        # well past the deadline is blocked for good.
        has_deadline = get_backend(plan.backend).transport_has_deadline
        step_limit = t if has_deadline else t + WEDGED_GRACE_S
        clock = PhaseClock()
        error: Optional[str] = None
        unreachable: Optional[str] = None  # the rendezvous this replica could not reach
        started = False
        consistent = False
        wedged = False
        finishing: Optional[asyncio.Future] = None  # vLLM's finish, run while the coordinator decides
        async with clock("pause"):
            # Under a trainer's /pause, pause again in "keep": it aborts nothing the hold keeps
            # (requests sent meanwhile included) and still resets the prefix cache, so no KV
            # computed under the old weights is reused after the update.
            mode = "keep" if self.held else plan.pause_mode
            await asyncio.wait_for(pause_for_update(self.engine, mode), t)
        try:
            try:
                if plan.checkpoint is not None:
                    started = True  # vLLM reloads into the live model too
                    async with clock("reload"):
                        await asyncio.wait_for(self.engine.collective_rpc("reload_weights", kwargs={"weights_path": plan.checkpoint}), step_limit)
                else:
                    if not plan.session:  # a route session's members joined at its init
                        async with clock("join"):
                            init_info = self._init_info(plan)
                            if not plan.group_name:  # a kept group's rendezvous was reached before
                                await check_reachable(init_info, t)
                            await asyncio.wait_for(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)), step_limit)
                    async with clock("start"):
                        await asyncio.wait_for(self.engine.start_weight_update(), step_limit)
                    started = True
                    update_info = plan.update_info()
                    if plan.session:
                        async with clock("trainer"):
                            update_info = await self._session_update_info(plan)
                    async with clock("receive"):
                        await asyncio.wait_for(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)), step_limit)
            except asyncio.TimeoutError:
                # The engine call is still running in the engine core. Without a transport
                # deadline its worker is blocked in a collective whose peer is gone, and every
                # later call (finish, pause, reload) would queue behind it forever.
                error = f"the engine did not finish {clock.current} within {step_limit:.0f}s"
                if clock.current == "join":
                    # Its rendezvous answered (probed first): what hangs is the transport's own
                    # connections, which a firewall that drops them leaves waiting like this.
                    error += f" (the rendezvous answered; the transport's own connections did not: {net.TRANSPORT_PORTS_HINT})"
                wedged = not has_deadline
                logger.error("replica %s: %s failed: %s", self.replica_id, plan.round_id, error)
            except net.RendezvousUnreachable as e:
                error, unreachable = str(e), e.target
                logger.error("replica %s: %s failed: %s", self.replica_id, plan.round_id, error)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                logger.error("replica %s: %s failed: %s", self.replica_id, plan.round_id, error)
            if error is None and plan.checkpoint is None:
                # vLLM's finish (the layerwise reload's finalization) does not depend on the
                # decision: it runs while the coordinator decides, and only the version label
                # waits for the commit. After an abort the weights are restored either way.
                finishing = asyncio.ensure_future(asyncio.wait_for(self.engine.finish_weight_update(), step_limit))
            async with clock("decision"):
                outcome = await self._report(plan, error, unreachable)
            self.committed = max(self.committed, outcome.version)
            finish_error = await self._finished(finishing, clock)
            if outcome.committed and finish_error is None:
                async with clock("version"):
                    # Tokens are labelled with the engine's version from the resume on.
                    await asyncio.wait_for(self.engine.update_weight_version(str(outcome.version)), t)
                self.version = outcome.version
                self.awaiting_publish = None  # every round carries the full model: whole weights again
                consistent = True
            elif wedged:
                # Nothing more can run on this engine: fail health checks so Serve replaces
                # the replica; the replacement catches up to the committed version as it starts.
                self.broken = f"{plan.round_id}: {error}; the engine is blocked and this replica must be replaced"
                logger.error("replica %s: %s", self.replica_id, self.broken)
            elif started:
                # vLLM loads tensors into the live model as they arrive: after a partial
                # transfer (or a failed finish) the weights are a mix of two versions and must not serve.
                why = finish_error if outcome.committed else f"aborted mid-transfer ({outcome.error})"
                logger.error("replica %s: %s %s; restoring", self.replica_id, plan.round_id, why)
                if plan.checkpoint is None and finishing is None:
                    await self._close_update(t)
            else:
                consistent = True  # nothing was loaded
        finally:
            if consistent and not self.held and not self.awaiting_publish:
                async with clock("resume"):
                    await self.engine.resume_generation()
        logger.info("replica %s: %s took %s", self.replica_id, plan.round_id, clock)
        await self.coordinator.applied.remote(plan.round_id, self.replica_id, self.version, clock.phases)
        return consistent

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

    async def _session_update_info(self, plan: RoundPlan) -> dict:
        """A route session's round: say this member started, then wait for the trainer's
        ``/update_weights`` (the round's deadline bounds the wait)."""
        await self.coordinator.started.remote(plan.round_id, self.replica_id, None)
        info = await self.coordinator.update_info.remote(plan.round_id, self.replica_id)
        if info is None:
            raise RuntimeError(f"{plan.round_id} ended before the trainer's /update_weights")
        return info

    def _init_info(self, plan: RoundPlan) -> dict:
        return get_backend(plan.backend).init_info(plan, plan.member(self.replica_id))

    async def _report(self, plan: RoundPlan, error: Optional[str], unreachable: Optional[str] = None) -> RoundOutcome:
        """The round's decision; an unreachable coordinator counts as an abort, so the
        weights are restored rather than trusted."""
        try:
            outcome = await self.coordinator.report.remote(plan.round_id, self.replica_id, error, unreachable)
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
