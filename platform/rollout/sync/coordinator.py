"""The weight-sync coordinator: one Serve replica that knows every live engine replica,
the committed policy version and the round in progress.

The Serve deployment class is a facade: it checks the caller's credential and hands
each call to the one part whose job it is.

* :class:`~rollout.sync.membership.Membership`: the registered replicas, who is live,
  waking their long polls, the Control each applied.
* :class:`~rollout.sync.rounds.Rounds`: round execution: open a round of any kind, each
  member's plan, reports, the decision (commit or abort) by the deadline, outcomes.
* :class:`~rollout.sync.store.CommittedWeights`: the committed version and what holds its
  weights; which restore round a lagging replica gets.
* :class:`~rollout.sync.sessions.RouteSessions`: vLLM's RL routes, a client of the three.

Replicas *pull*: each one long-polls :meth:`next_round`, so the coordinator needs no
handle to individual Serve replicas and membership is simply "who polled recently".
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Union

from rollout.config import PlatformConfig
from rollout.contracts.sync_protocol import REREGISTER, AdapterRemovalRound, AdapterRequest, AdapterRound, CommittedAdapters, Control, FinishUpdate, FleetQuery, HeldAdapter, LoadAdapter, OpenSession, UnloadAdapter, ParamSpec, Pause, Update, RouteCommand, SleepFleet, SleepUnavailableError, SyncError, WakeFleet, PublishWait, PullRound, PushRound, ReloadRound, Reregister, Round, RoundOutcome, RoundRequest, SessionPlan, StorageRequest, StorageRound
from rollout.errors import AdapterNotFoundError
from rollout.logs import show_platform_logs
from rollout.sync.auth import SyncAuth
from rollout.sync.membership import Membership
from rollout.sync.rounds import Rounds
from rollout.sync.sessions import RouteSessions
from rollout.sync.sleep import unavailable as sleep_unavailable
from rollout.sync.store import CommittedWeights

logger = logging.getLogger(__name__)


class WeightSyncCoordinator:
    """Serve deployment class (exactly one replica)."""

    def __init__(self, config: dict[str, Any], backend: str):
        show_platform_logs()
        self.config = PlatformConfig.model_validate(config)
        sync = self.config.sync
        self.backend = backend
        self.metrics = None
        if self.config.metrics.enabled:
            from rollout.metrics import SyncMetrics

            self.metrics = SyncMetrics(backend)
        self._gauges_task: Optional[asyncio.Task] = None
        # Who may change the weights: decided from the config (the same decision the
        # ingress follows), checked against the token in this process's environment.
        self.auth = SyncAuth.of(sync)
        self.auth.warn_if_unusable()
        self.membership = Membership(sync.poll_s, sync.silent_polls)
        self.store = CommittedWeights(backend, self.config.model.path, sync.timeout_s, sync.rendezvous_port_range())
        self.rounds = Rounds(sync, backend, self.membership, self.store, self.metrics)
        self.sessions = RouteSessions(self.rounds)

    async def _authorize(self, token: Optional[str]) -> None:
        await self.auth.check(token)

    # ---- replicas ------------------------------------------------------------------

    async def register(self, replica_id: str, ranks: int, version: int, params: list[ParamSpec], adapters: tuple[HeldAdapter, ...] = ()) -> int:
        """A replica announces itself; returns the committed version it must serve.

        A restarted coordinator starts at version 0 and learns the committed version
        back from the replicas, which keep it in their engines; likewise the LoRA
        adapters each serves (``adapters``, with the versions an unload removed): see
        :meth:`CommittedWeights.learn_adapters`.
        """
        if self.metrics is not None and self._gauges_task is None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._update_gauges())
        self.membership.register(replica_id, ranks, version, params)
        self.rounds.forget_holder(replica_id)
        self.store.learn(version)
        self.store.learn_adapters(replica_id, tuple(adapters))
        logger.info("replica %s registered at version %d (committed %d)", replica_id, version, self.store.version)
        return self.store.version

    async def next_round(
        self, replica_id: str, version: int, control: Control = Control(), reset_ok: bool = True
    ) -> Union[Round, SessionPlan, Control, Reregister, None]:
        """Long poll: the plan of a round (or a route session to join) this replica is a
        member of, the :class:`Control` to apply when the replica's (``control``) differs,
        None after a while, or ``REREGISTER`` when the coordinator does not know the
        replica (it restarted, or dropped the replica as silent)."""
        if self.membership.polled(replica_id, version, control, reset_ok) is None:
            return REREGISTER
        plan = self._pending(replica_id)
        if plan is None:
            await self.membership.wait(replica_id)
            plan = self._pending(replica_id)
        return plan

    def _pending(self, replica_id: str) -> Union[Round, SessionPlan, Control, None]:
        due = self.membership.control_due(replica_id)
        if due is not None:
            return due
        join = self.sessions.pending_join(replica_id)
        return join if join is not None else self.rounds.pending(replica_id)

    async def _update_gauges(self) -> None:
        while True:
            self.rounds.live()
            self.metrics.membership(self.store.version, self.membership.versions(), self.membership.take_departed())
            await asyncio.sleep(1.0)

    # ---- rounds --------------------------------------------------------------------

    async def begin_round(self, token: Optional[str], request: RoundRequest) -> PushRound:
        """Validate a publish and open a round; no replica changes before this succeeds.
        Once committed, restores reload ``request.checkpoint`` (see :meth:`restore`)."""
        await self._authorize(token)
        return await self.rounds.push(request)

    async def begin_storage(self, token: Optional[str], request: StorageRequest) -> StorageRound:
        """Validate a publish through shared storage and open its round: every replica
        verifies the checkpoint against its manifest, then reloads it; the publisher's
        :meth:`finish` (no error) lets it decide. Once committed, restores reload it too."""
        await self._authorize(token)
        return await self.rounds.storage(request)

    async def publish_adapter(self, token: Optional[str], request: AdapterRequest) -> RoundOutcome:
        """Publish a LoRA adapter (``model.lora.enabled``): every live replica loads it,
        all or none; returns the decision (``version``: the adapter's committed version)
        once every member serves it. Bad config or tensors: ``InvalidRequestError`` naming
        the field or the tensor, before any replica changes."""
        await self._authorize(token)
        return await self._publish_adapter(request, inplace=True)

    async def unload_adapter(self, token: Optional[str], name: str) -> RoundOutcome:
        """Unload LoRA adapter ``name`` (``WeightPublisher.unload_adapter``): every live
        replica stops serving it, all or none, and the store forgets it, so a replica that
        starts later does not load it; returns the decision once every member stopped
        serving it (committed: ``version`` 0; aborted: the adapter's version, still served
        everywhere). :class:`AdapterNotFoundError` naming ``name`` when no version of it
        is committed. A later publish of ``name`` continues after the version removed."""
        await self._authorize(token)
        self._check_lora()
        try:
            return await self.rounds.remove_adapter(name)
        except AdapterNotFoundError:
            published = sorted(self.store.adapter_versions())
            raise AdapterNotFoundError(
                f"{name!r} is not a published LoRA adapter (published: {', '.join(map(repr, published)) or 'none'})", field="name"
            ) from None

    def _check_sleep_mode(self) -> None:
        why = sleep_unavailable(self.config.model)
        if why is not None:
            raise SleepUnavailableError(why)

    def _check_lora(self) -> None:
        if not self.config.model.lora.enabled:
            raise SyncError("LoRA adapters are off: the engines start with vLLM's LoRA support only with model.lora.enabled: true")

    async def _publish_adapter(self, request: AdapterRequest, inplace: bool) -> RoundOutcome:
        self._check_lora()
        lora = self.config.model.lora
        return await self.rounds.adapter(request, max_rank=lora.max_lora_rank, served_name=self.config.model.name, inplace=inplace)

    async def adapters(self, replica_id: str) -> CommittedAdapters:
        """Every committed adapter, for a replica to load before its first request (catch-up),
        and those this coordinator learned back after a restart and holds no bytes of.
        Asked while an adapter round (or an unload) is undecided, it answers after the
        decision: a replica that registered too late to be a member still gets what that
        round commits (and never an adapter it removed)."""
        self.membership.seen(replica_id)
        rnd = self.rounds.current
        if rnd is not None and isinstance(rnd.plan, (AdapterRound, AdapterRemovalRound)) and replica_id not in rnd.member_ids:
            await rnd.decided.wait()
        return self.store.committed_adapters()

    async def restore(self, replica_id: str) -> Union[PullRound, ReloadRound]:
        """Open a round that brings one replica to the committed weights.

        Used by a replica that starts behind the committed version (catch-up, the
        trainer sends nothing) and by one whose transfer broke off mid-way (rollback).
        The store names the source (:mod:`rollout.sync.store`): the checkpoint the
        publisher named (the replica reloads it), else the coordinator's copy.
        """
        return await self.rounds.restore(replica_id)

    async def report(
        self, round_id: str, replica_id: str, error: Optional[str], unreachable: Optional[str] = None, digests: Optional[dict[str, str]] = None
    ) -> RoundOutcome:
        """A member received all weights (``error`` None) or failed; wait for the decision.

        ``unreachable``: the member failed because it could not reach the round's
        rendezvous at that "address:port". Like any failure it aborts the round at once
        (the publisher need not wait out its deadline), and the outcome says so, so the
        publisher can name the address it advertised and how to change it.

        ``digests``: the member's per-tensor digests of what it received; a member whose
        digests differ from the sender's fails the round (see :mod:`rollout.sync.digest`).
        """
        self.membership.seen(replica_id)
        return await self.rounds.report(round_id, replica_id, error, unreachable, digests=digests)

    async def finish(
        self, token: Optional[str], round_id: str, error: Optional[str] = None, digests: Optional[dict[str, str]] = None, wait: PublishWait = "serving"
    ) -> RoundOutcome:
        """The trainer sent everything (or, with ``error``, aborts the round). It takes the
        credential :meth:`begin_round` takes: round ids are public (``status``), and without
        it anyone with the API key could abort a round, or finish one early. ``digests``:
        the per-tensor digests of what the trainer sent (see :mod:`rollout.sync.digest`).
        ``wait``: answer once every member serves the version ("serving"), or at the
        decision ("committed"; see :data:`PublishWait`)."""
        await self._authorize(token)
        if wait not in ("serving", "committed"):
            from rollout.errors import InvalidRequestError

            raise InvalidRequestError("wait", f"must be 'serving' or 'committed', not {wait!r}")
        return await self.rounds.finish(round_id, error, digests=digests, wait=wait)

    async def applied(self, round_id: str, replica_id: str, version: int, phases: Optional[dict[str, float]] = None) -> None:
        """A member finished applying the decision (serving ``version`` again);
        ``phases`` are its seconds per step, kept with the round's outcome."""
        self.membership.seen(replica_id, version)
        self.rounds.applied(round_id, replica_id, phases)

    async def status(self) -> dict[str, Any]:
        self.rounds.live()
        return {
            "committed_version": self.store.version,
            # "received": the version and digest of what each replica received in the last
            # round it committed (rollout.sync.digest), None before its first one here.
            "replicas": {rid: {"version": r.version, "ranks": r.ranks, "received": self.rounds.replica_digest(rid)} for rid, r in self.membership.replicas.items()},
            "committed_digest": self.rounds.committed_digest(),
            **self.rounds.status(),
            "weight_copy_version": self.store.copy_version,
            # name -> committed version of every published LoRA adapter, and those of them
            # learned back from the replicas after a restart, with no copy here to load a
            # replica that starts later from (until the next publish of each)
            "adapters": self.store.adapter_versions(),
            "adapters_without_copy": sorted(self.store.learned),
            "backend": self.backend,
            # The replicas' sleep (/sleep, /wake_up): None while awake.
            "sleep": self.membership.control.sleep.describe() if self.membership.control.sleep is not None else None,
        }

    # ---- vLLM's RL routes (RouteSessions) ------------------------------------------

    async def drive(self, token: Optional[str], command: RouteCommand) -> Any:
        """One of vLLM's RL routes over the whole fleet, for a trainer written for
        ``vllm serve``; each command's docstring names its answer."""
        await self._authorize(token)
        match command:
            case Pause(mode=mode, clear_cache=clear_cache):
                await self.sessions.pause(mode, clear_cache)
            case FleetQuery.RESUME:
                await self.sessions.resume()
            case FleetQuery.RESET_PREFIX_CACHE:
                # Whether every replica's reset succeeded (vLLM's fails while blocks are held).
                return await self.sessions.reset_prefix_cache()
            case FleetQuery.IS_PAUSED:
                return self.membership.control.paused is not None
            case FleetQuery.WEIGHT_VERSION:
                return self.store.version
            case FleetQuery.WORLD_SIZE:
                return self.sessions.inference_world_size()
            case OpenSession(init_info=init_info):
                await self.sessions.open(init_info)
            case FleetQuery.SHUTDOWN_SESSION:
                self.sessions.end("the trainer shut the weight transfer engine down")
            case FleetQuery.START_UPDATE:
                await self.sessions.start_update()
            case Update(update_info=update_info):
                await self.sessions.update(update_info)
            case FinishUpdate(weight_version=weight_version):
                return await self.sessions.finish_update(weight_version)
            case FleetQuery.AUTHORIZE:
                pass  # the credential was the question
            case LoadAdapter(request=request, inplace=inplace):
                return await self._publish_adapter(request, inplace)
            case UnloadAdapter(name=name):
                self._check_lora()
                return await self.rounds.remove_adapter(name)
            case SleepFleet(level=level, mode=mode):
                self._check_sleep_mode()
                await self.sessions.sleep(level, mode)
            case WakeFleet(tags=tags):
                self._check_sleep_mode()
                return await self.sessions.wake(tags)
            case FleetQuery.IS_SLEEPING:
                self._check_sleep_mode()
                return self.membership.control.sleep is not None
            case _:
                raise SyncError(f"command: {type(command).__name__} is not one of vLLM's RL routes")
        return None

    async def joined(self, session_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member's answer to the session's join."""
        self.membership.seen(replica_id)
        self.sessions.joined(session_id, replica_id, error)

    async def started(self, round_id: str, replica_id: str, error: Optional[str]) -> None:
        """A member paused and ran ``start_weight_update`` (or failed to)."""
        self.membership.seen(replica_id)
        self.sessions.started(round_id, replica_id, error)

    async def update_info(self, round_id: str, replica_id: str) -> Optional[dict]:
        """Long poll for a member: the trainer's ``/update_weights`` info, or None once
        the round is decided without it (aborted)."""
        self.membership.seen(replica_id)
        return await self.sessions.update_info(round_id)
