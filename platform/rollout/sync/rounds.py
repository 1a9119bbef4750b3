"""Round execution: open a round of any kind, hand each member its plan, collect the
reports, decide (commit or abort) by the deadline, and keep the outcomes.

One round at a time (a lock held from opening a round until its decision). A round
commits only when its sender (the trainer, or the coordinator's copy in a pull round) and
every member report success before the deadline, and the coordinator's copy too where it
receives in the round; otherwise it aborts and every replica keeps the committed version.
What is committed, and what restores come from, is the store's
(:class:`~rollout.sync.store.CommittedWeights`); parts above this one (route sessions)
follow rounds through :class:`RoundListener`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Protocol, Union

from rollout.contracts.backend import TransferInfo, delta_base_of
from rollout.contracts.backend_registry import get_backend
from rollout.contracts.sync_protocol import (
    RESTORE_ROUNDS,
    AdapterRemovalRound,
    AdapterRequest,
    AdapterRound,
    CopyGroup,
    DeltaBaseError,
    Member,
    PullRound,
    PushRound,
    OfferUnknownError,
    PublishWait,
    params_digest,
    ReloadRound,
    Round,
    RoundOutcome,
    RoundRequest,
    SessionRound,
    StorageRequest,
    StorageRound,
    SyncError,
    Transfer,
)
from rollout.errors import AdapterNotFoundError, InvalidRequestError
from rollout.sync import digest as digests_
from rollout.sync.membership import Membership
from rollout.sync.adapters import adapter_of, check_adapter
from rollout.sync.rules import assign_ranks, check_spec
from rollout.sync.sleep import refuse_round
from rollout.sync.store import CommittedWeights

HISTORY = 20  # round outcomes kept for status()

if TYPE_CHECKING:
    from rollout.config import SyncConfig

logger = logging.getLogger(__name__)


@dataclass
class RoundState:
    """A round from its opening to its decision, and until its members serve the outcome."""

    plan: Round  # a session round's gains its params at /update_weights
    deadline: float
    opened_at: float = field(default_factory=time.monotonic)
    reports: dict[str, Optional[str]] = field(default_factory=dict)  # replica -> error or None
    unreachable: str = ""  # "address:port" of the rendezvous a member could not reach
    # The coordinator's copy receives in the round as this rank (None: it takes no part).
    copy_rank: Optional[int] = None
    copy_reported: bool = False
    copy_error: Optional[str] = None
    # The sender: the trainer, or the coordinator's copy in a pull round; a reload round has
    # none (a storage round's trainer sends nothing either: its finish says go).
    sender_done: bool = False
    sender_error: Optional[str] = None
    # Per-tensor digests (rollout.sync.digest) of what the sender sent, and of what each
    # member received; None / absent where a side gave none (its backend digests nothing).
    sender_digests: Optional[dict[str, str]] = None
    received: dict[str, dict[str, str]] = field(default_factory=dict)
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Optional[RoundOutcome] = None
    applied: set[str] = field(default_factory=set)  # members serving the decided version again
    all_applied: asyncio.Event = field(default_factory=asyncio.Event)
    version: int = 0  # committed on success: the plan's, or the one /finish_weight_update names
    # Per-member bookkeeping kept as the calls arrive, so that each poll, report and
    # "applied" costs the same at 1,000 members as at 10 (scanning the members on every
    # call made a round's coordination grow with their square).
    by_id: dict[str, Member] = field(init=False)
    member_ids: frozenset[str] = field(init=False)
    missing: set[str] = field(init=False)  # members that have not reported
    failed: set[str] = field(init=False)  # replicas whose report is an error
    applied_members: int = 0
    # The plan as members that hold its offer get it (the offer named by id alone, see
    # TransferInfo.reference), and who they are; None: every member gets ``plan``.
    by_reference: Optional[Round] = None
    holders: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.version = self.version or self.plan.version
        self.by_id = {m.replica_id: m for m in self.plan.members}
        self.member_ids = frozenset(self.by_id)
        self.missing = set(self.member_ids)
        self.failed = set()

    @property
    def round_id(self) -> str:
        return self.plan.round_id

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

    def plan_for(self, replica_id: str) -> Round:
        """The plan as one member receives it: only its own entry of ``members`` (its rank
        offset; the world size says the rest). The whole list to every member would make
        the bytes a round sends grow with the square of the members. A member that holds
        the round's offer gets it named by id alone."""
        plan = self.by_reference if self.by_reference is not None and replica_id in self.holders else self.plan
        return dataclasses.replace(plan, members=(self.by_id[replica_id],)) if len(plan.members) > 1 else plan

    def complete(self) -> bool:
        """Every participant reported (or one failed): the round can be decided."""
        if self.sender_error or self.copy_error or self.failed:
            return True
        return self.sender_done and not self.missing and (self.copy_rank is None or self.copy_reported)


@dataclass(frozen=True)
class _KeptGroup:
    """A transfer group every participant of a committed publish round still holds."""

    transfer: Transfer  # named
    layout: tuple  # (members, world_size, keeper_rank): reusable only for the same ranks

    @classmethod
    def of(cls, plan: PushRound) -> "_KeptGroup":
        return cls(dataclasses.replace(plan.transfer, group_name=plan.group), (plan.members, plan.transfer.world_size, plan.keeper_rank))


class RoundListener(Protocol):
    """A part above round execution that follows its rounds (route sessions)."""

    def opening(self, plan: Round) -> None:
        """``plan`` opens (its members are about to be woken)."""

    def decided(self, rnd: RoundState) -> None:
        """``rnd`` was decided (``rnd.outcome``)."""


class Rounds:
    def __init__(self, sync: SyncConfig, backend: str, membership: Membership, store: CommittedWeights, metrics: Any = None):
        self.sync = sync
        self.backend = backend
        self.membership = membership
        self.store = store
        self.metrics = metrics
        self.current: Optional[RoundState] = None
        self.last_outcome: Optional[RoundOutcome] = None
        self.history: list[RoundOutcome] = []
        self.listeners: list[RoundListener] = []
        self._kept: Optional[_KeptGroup] = None  # the last committed publish round's transfer group
        # The committed version's per-tensor digests as its publisher sent them (None: it
        # sent none): what a pull round restoring that version is checked against too.
        self.committed_digests: Optional[tuple[int, dict[str, str]]] = None
        self._committed_combined = ""  # their combined digest (rollout.sync.digest.combine)
        # replica -> (version, combined digest) of the weights it received in the last
        # round it committed: what status() shows beside each replica's version.
        self.replica_digests: dict[str, tuple[int, str]] = {}
        # The last complete offer a publisher named an id for (an ipc export: its handles),
        # and the replicas that received it in a committed round (their engines hold it):
        # a later offer naming it by id is completed from it, and only members not among
        # these get it in full (see TransferInfo.reference).
        self._offer: Optional[Any] = None
        self._offer_holders: set[str] = set()
        # (params_digest, params) of the last publish with such an offer: what a request
        # naming its parameters by digest gets.
        self._offer_params: Optional[tuple[str, tuple]] = None
        # Held from opening a round until its decision: one round at a time.
        self._lock = asyncio.Lock()

    # ---- membership as rounds see it -------------------------------------------------

    def busy(self) -> frozenset[str]:
        """Members of the undecided round: they do not poll while in it."""
        rnd = self.current
        return rnd.member_ids if rnd is not None and not rnd.decided.is_set() else frozenset()

    def live(self) -> dict[str, int]:
        return self.membership.live(self.busy())

    def pending(self, replica_id: str) -> Optional[Round]:
        """The plan of the undecided round ``replica_id`` is a member of and has not reported."""
        rnd = self.current
        if rnd is None or rnd.decided.is_set() or replica_id in rnd.reports:
            return None
        return rnd.plan_for(replica_id) if replica_id in rnd.member_ids else None

    # ---- opening ---------------------------------------------------------------------

    async def _acquire(self) -> None:
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout=self.sync.timeout_s)
        except asyncio.TimeoutError:
            busy = self.current.round_id if self.current else "another round"
            raise SyncError(f"{busy} is still in progress after {self.sync.timeout_s}s; rounds run one at a time") from None

    @contextlib.asynccontextmanager
    async def opening(self) -> AsyncIterator[None]:
        """Take the round lock to open a round: a decision releases it, and so does a
        failure before the round opened."""
        await self._acquire()
        try:
            yield
        except BaseException:
            self._lock.release()
            raise

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the round lock for work that opens no round (a route session's join)."""
        await self._acquire()
        self._kept = None  # a route session's join inits the replicas' engines on its own group
        try:
            yield
        finally:
            self._lock.release()

    def fields(self, kind: str, version: int, members: tuple[Member, ...], **overrides: Any) -> dict[str, Any]:
        """The fields every kind of round shares: the one place a round's id is made."""
        return dict(
            round_id=f"{kind}-{version}-{uuid.uuid4().hex[:8]}",
            version=version,
            backend=self.backend,
            members=members,
            params=tuple(overrides.pop("params", self.membership.params)),
            bucket_bytes=overrides.pop("bucket_bytes", self.sync.bucket_bytes),
            timeout_s=self.sync.timeout_s,
            **overrides,
        )

    def open(self, plan: Round) -> RoundState:
        """Open ``plan`` (under :meth:`opening`): wake its members, arm its deadline."""
        for listener in self.listeners:
            listener.opening(plan)
        copy_rank = plan.keeper_rank if isinstance(plan, (PushRound, SessionRound)) else None
        rnd = RoundState(plan=plan, deadline=time.monotonic() + 3 * plan.timeout_s, copy_rank=copy_rank)
        offer = plan.transfer_info if isinstance(plan, PushRound) else None
        slim = offer.reference() if isinstance(offer, TransferInfo) and offer is self._offer else None
        if slim is not None:
            # Its members that hold the offer hold these parameters too (the plan that gave
            # them the offer carried them, under this digest): neither travels again.
            rnd.by_reference = dataclasses.replace(plan, transfer_info=slim, params=())
            rnd.holders = frozenset(self._offer_holders & rnd.member_ids)
        self.current = rnd
        self.membership.wake(m.replica_id for m in plan.members)
        loop = asyncio.get_running_loop()
        loop.create_task(self._enforce_deadline(rnd))
        if isinstance(plan, RESTORE_ROUNDS):
            # The restored replica forgets the publish group (it may have broken it): the
            # next publish forms a new one.
            self._kept = None
        if isinstance(plan, PushRound) and copy_rank is not None:
            self.copy_receives(rnd)
        elif isinstance(plan, (ReloadRound, AdapterRound, AdapterRemovalRound)):
            rnd.sender_done = True  # nothing is sent (an adapter's bytes are in the plan): the members' reports decide
        elif isinstance(plan, PullRound):
            loop.create_task(self._send_from_copy(rnd))
        return rnd

    def copy_receives(self, rnd: RoundState) -> None:
        """The coordinator's copy receives ``rnd`` as its ``copy_rank`` (in the background)."""
        asyncio.get_running_loop().create_task(self._copy_receive(rnd))

    async def _copy_receive(self, rnd: RoundState) -> None:
        error, unreachable = await self.store.receive(rnd.plan, rnd.copy_rank)
        if rnd.decided.is_set():
            self.store.discard(rnd.round_id)  # decided without it (aborted)
            return
        if unreachable:
            rnd.unreachable = unreachable
        rnd.copy_reported, rnd.copy_error = True, error
        self._decide_if_complete(rnd)

    async def _send_from_copy(self, rnd: RoundState) -> None:
        await self.finish(rnd.round_id, await self.store.send(rnd.plan))

    # ---- the kinds a caller opens here: a publish, a restore -------------------------

    async def push(self, request: RoundRequest) -> PushRound:
        """Validate a publish and open its round; no replica changes before this succeeds."""
        if self.membership.params is None:
            raise SyncError("no engine replica has registered yet")
        offered = get_backend(self.backend).check_transfer_info(request.transfer_info)  # typed by the backend
        if request.params or not request.params_digest:
            check_spec(list(request.params), self.membership.params)
        else:  # checked when they came in full (against the same served model)
            request = self._params_by_digest(request, offered)
        if offered is not None:
            offered.check_params(request.params)  # a count per parameter, over HTTP as over Serve
        self.store.check_checkpoint(request.checkpoint)
        self._check_version(request.version)
        async with self.opening():
            refuse_round(self.membership.control.sleep, "a publish")  # under the lock: a /sleep may have come while it waited
            self._check_delta_base(offered)  # under the lock: no commit moves the base meanwhile
            offered = self._complete_offer(offered)  # under the lock: no round moves the last offer meanwhile
            plan = self._plan_push(request, offered)
            self.store.offered(plan.round_id, request.checkpoint)
            rnd = self.open(plan)
        logger.info(
            "opened %s: version %d to %d replicas (world size %d, %s)",
            plan.round_id, plan.version, len(plan.members), plan.transfer.world_size,
            f"reusing group {plan.transfer.group_name}" if plan.transfer.group_name else "new group",
        )
        # The members' plans before the publisher's answer: a member's plan is on the
        # round's critical path, the publisher's answer is not (its finish waits for the
        # members anyway). The woken long polls run before this call returns.
        await asyncio.sleep(0)
        # The publisher sent the offer: it gets it back named by id where it can be.
        return rnd.by_reference if rnd.by_reference is not None else plan

    def _params_by_digest(self, request: RoundRequest, offered: Any) -> RoundRequest:
        """``request`` with the parameters its digest names: those of the last publish with
        an offer named by id, or OfferUnknownError (the publisher sends them in full then)."""
        if not (isinstance(offered, TransferInfo) and offered.by_reference()):
            raise InvalidRequestError("params_digest", "parameters go by digest only beside an offer named by id (transfer_info)")
        held = self._offer_params
        if held is None or held[0] != request.params_digest:
            raise OfferUnknownError(f"params_digest: parameters {request.params_digest[:16]}… are not the ones this coordinator holds: send them in full")
        return dataclasses.replace(request, params=held[1])

    def _complete_offer(self, offered: Any) -> Any:
        """``offered`` complete: an offer named by id (TransferInfo.by_reference) is the last
        complete offer of that id, or OfferUnknownError (the publisher offers in full
        then). A complete offer with another id replaces the one kept, and nobody holds it yet."""
        if not isinstance(offered, TransferInfo) or not offered.offer_id():
            return offered
        if offered.by_reference():
            if self._offer is None or self._offer.offer_id() != offered.offer_id():
                held = self._offer.offer_id() if self._offer is not None else "none"
                raise OfferUnknownError(f"transfer_info: offer {offered.offer_id()} named by id is not the one this coordinator holds ({held}): offer it in full")
            return self._offer
        if self._offer is None or self._offer.offer_id() != offered.offer_id():
            self._offer_holders = set()
        self._offer = offered
        return offered

    def forget_holder(self, replica_id: str) -> None:
        """``replica_id`` (re)registered: its engine may not hold the kept offer."""
        self._offer_holders.discard(replica_id)

    def _check_delta_base(self, offered: Any) -> None:
        """A delta (rollout.sync.delta) applies only onto the committed version, and onto
        its bytes where the coordinator knows their digest (its publisher sent them)."""
        base = delta_base_of(offered)
        if base is None:
            return
        if base != self.store.version:
            raise DeltaBaseError(f"the delta applies onto version {base}, the committed version is {self.store.version}: publish in full")
        claimed = offered.base_digest()
        if claimed is not None and self.committed_digests is not None and self.committed_digests[0] == base and claimed != self._committed_combined:
            raise DeltaBaseError(
                f"the delta applies onto version {base} with digest {claimed[:16]}…, the committed version's digest is "
                f"{self._committed_combined[:16]}…: publish in full"
            )

    def _check_version(self, version: Optional[int]) -> None:
        if version is not None and version <= self.store.version:
            raise InvalidRequestError("version", f"{version} must be greater than the committed version {self.store.version}")

    def _plan_push(self, request: RoundRequest, offered: Any) -> PushRound:
        self._check_version(request.version)  # again: a round may have committed while this one waited
        version = self.store.version + 1 if request.version is None else request.version
        live = self.live()
        if not live and not self.store.keeps_copy:
            raise SyncError("no live engine replica to publish to")
        # With no replica (scaled to zero) the round commits into the copy alone;
        # replicas that start later catch up from it.
        members, world_size = assign_ranks(live)
        copy_after = self.store.copy_after(bool(live), bool(request.copy_group))
        keeper_rank = None
        if self.store.keeps_copy and not copy_after:
            keeper_rank, world_size = world_size, world_size + 1
        transfer = Transfer(request.master_address, request.master_port, world_size)
        last = self._kept
        if request.reuse_group is not None and last is not None and last.transfer.group_name == request.reuse_group and last.layout == (members, world_size, keeper_rank):
            transfer = last.transfer
        digest = ""
        if isinstance(offered, TransferInfo) and offered.offer_id():
            held = self._offer_params
            digest = request.params_digest or (held[0] if held is not None and held[1] == request.params else params_digest(request.params))
            self._offer_params = (digest, request.params)
        return PushRound(
            **self.fields("round", version, members, params=request.params),  # the publisher's order: its tensors and handles follow it
            params_digest=digest,
            transfer=transfer,
            pause_mode=self.sync.pause_mode,
            keeper_rank=keeper_rank,
            transfer_info=offered,
            copy=CopyGroup(request.copy_group, request.copy_port) if copy_after else None,
        )

    async def storage(self, request: StorageRequest) -> StorageRound:
        """Validate a publish through shared storage and open its round: every live replica
        verifies the checkpoint against its manifest, then reloads it. No replica changes
        before this succeeds. With no live replica it commits on the publisher's finish,
        and replicas that start later reload the checkpoint."""
        if self.membership.params is None:
            raise SyncError("no engine replica has registered yet")
        check_spec(list(request.params), self.membership.params)
        if not request.checkpoint:
            raise InvalidRequestError("checkpoint", "a storage publish names the directory every replica reloads")
        self.store.check_checkpoint(request.checkpoint)
        self._check_version(request.version)
        async with self.opening():
            refuse_round(self.membership.control.sleep, "a storage publish")
            self._check_version(request.version)  # again: a round may have committed while this one waited
            version = self.store.version + 1 if request.version is None else request.version
            members, _ = assign_ranks(self.live())
            plan = StorageRound(
                **self.fields("storage", version, members, params=request.params),
                checkpoint=request.checkpoint,
                manifest=request.manifest,
                pause_mode=self.sync.pause_mode,
            )
            self.store.offered(plan.round_id, request.checkpoint, request.manifest)
            self.open(plan)
        logger.info("opened %s: version %d to %d replicas from %s", plan.round_id, plan.version, len(plan.members), plan.checkpoint)
        return plan

    async def adapter(self, request: AdapterRequest, *, max_rank: Optional[int] = None, served_name: str = "", inplace: bool = True) -> RoundOutcome:
        """Publish a LoRA adapter: check it (:func:`~rollout.sync.adapters.check_adapter`,
        against the served model's parameters where a replica registered them), open its
        round, and return the decision once every member serves it (or the round aborted:
        every replica keeps the adapter's version before). With no live replica it commits
        into the store alone, and replicas that start later load it. ``inplace`` False
        (vLLM's ``load_inplace``): refused, naming ``name``, while the name is loaded."""
        check_adapter(request, self.membership.params, max_rank=max_rank, served_name=served_name)
        self._check_adapter_version(request, inplace)
        async with self.opening():
            refuse_round(self.membership.control.sleep, f"publishing adapter {request.name!r}")
            self._check_adapter_version(request, inplace)  # again: a round may have committed while this one waited
            version = self.store.last_adapter_version(request.name) + 1 if request.version is None else request.version
            members, _ = assign_ranks(self.live())
            plan = AdapterRound(**self.fields("adapter", version, members, params=()), adapter=adapter_of(request, version))
            self.open(plan)
        logger.info("opened %s: adapter %s version %d (%d bytes) to %d replicas", plan.round_id, request.name, version, len(request.tensors), len(plan.members))
        return await self.finish(plan.round_id)

    def _check_adapter_version(self, request: AdapterRequest, inplace: bool = True) -> None:
        if not inplace and self.store.adapter_version(request.name):
            # vLLM's own answer to load_inplace=false on a loaded name.
            raise InvalidRequestError(
                "name", f"The lora adapter '{request.name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            )
        last = self.store.last_adapter_version(request.name)
        if request.version is not None and request.version <= last:
            raise InvalidRequestError("version", f"{request.version} must be greater than adapter {request.name!r}'s committed version {last}")

    async def remove_adapter(self, name: str) -> RoundOutcome:
        """Unload LoRA adapter ``name`` from every live replica and the store: its round
        commits once every member reported, and the decision returns once every member
        stopped serving it (an abort leaves it served everywhere and committed).
        :class:`AdapterNotFoundError` when no version of ``name`` is committed."""
        async with self.opening():
            refuse_round(self.membership.control.sleep, f"unloading adapter {name!r}")
            version = self.store.adapter_version(name)
            if not version:
                # vLLM's own answer (a 404) to unloading a name it does not serve.
                raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            members, _ = assign_ranks(self.live())
            plan = AdapterRemovalRound(**self.fields("unload", version, members, params=()), name=name)
            self.open(plan)
        logger.info("opened %s: removing adapter %s (version %d) from %d replicas", plan.round_id, name, version, len(members))
        return await self.finish(plan.round_id)

    async def restore(self, replica_id: str) -> Union[PullRound, ReloadRound]:
        """Open a round that brings one replica to the committed weights, from whichever
        source the store names (see :mod:`rollout.sync.store`)."""
        r = self.membership.registered(replica_id)
        # Asked by a replica whose round failed or that starts behind: it no longer vouches
        # for the publish group, even where no restore round can open (no copy to restore from).
        self._kept = None
        await self.store.ready_to_restore(replica_id)
        async with self.opening():  # the store decides again: a round may commit while this waits
            plan = self.store.restore_round(Member(replica_id, 1, r.ranks), self.fields)
            self.open(plan)
        source = plan.checkpoint if isinstance(plan, ReloadRound) else "the coordinator's copy"
        logger.info("opened %s: version %d on %s from %s", plan.round_id, plan.version, replica_id, source)
        return plan

    # ---- reports and the decision ----------------------------------------------------

    def get(self, round_id: str) -> RoundState:
        if self.current is None or self.current.round_id != round_id:
            raise SyncError(f"unknown round {round_id}")
        return self.current

    def past_outcome(self, round_id: str) -> Optional[RoundOutcome]:
        """A recent round's outcome: a member that reports after the decision (its receive
        timed out late, a new round already opened) still learns it."""
        return next((o for o in reversed(self.history) if o.round_id == round_id), None)

    async def report(
        self, round_id: str, replica_id: str, error: Optional[str], unreachable: Optional[str] = None, *, digests: Optional[dict[str, str]] = None
    ) -> RoundOutcome:
        """``digests``: the member's per-tensor digests of what it received (see
        :mod:`rollout.sync.digest`), compared with the sender's when the round is decided."""
        past = self.past_outcome(round_id)
        if past is not None:
            return past
        rnd = self.get(round_id)
        if digests is not None:
            rnd.received[replica_id] = dict(digests)
        rnd.record_report(replica_id, error)
        if error and unreachable:
            rnd.unreachable = unreachable
        self._decide_if_complete(rnd)
        await rnd.decided.wait()
        return rnd.outcome

    async def finish(self, round_id: str, error: Optional[str] = None, *, digests: Optional[dict[str, str]] = None, wait: PublishWait = "serving") -> RoundOutcome:
        """The sender is done (or, with ``error``, aborts): wait for the decision and, after
        a commit, for the members to serve it, so a publisher that returns finds every
        replica on the new version (it never waits longer than one step deadline).
        ``digests``: the sender's per-tensor digests of what it sent; every member's must
        equal them for the round to commit. ``wait`` "committed": return at the decision
        (the members' phases and ``unconfirmed`` then reach status() only)."""
        past = self.past_outcome(round_id)
        if past is not None:
            return past
        rnd = self.get(round_id)
        rnd.sender_done = True
        rnd.sender_error = error
        if digests is not None:
            rnd.sender_digests = dict(digests)
        self._decide_if_complete(rnd)
        await rnd.decided.wait()
        if rnd.outcome.committed and rnd.plan.members and wait == "serving":
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

    def applied(self, round_id: str, replica_id: str, phases: Optional[dict[str, float]]) -> None:
        rnd = self.current
        if rnd is not None and rnd.round_id == round_id:
            if rnd.outcome is not None and phases:
                rnd.outcome.phases[replica_id] = dict(phases)
            rnd.record_applied(replica_id)
        elif phases:
            # A publish that returned at the commit (wait="committed") may have opened the
            # next round before this member was done: its phases still go with its outcome.
            past = self.past_outcome(round_id)
            if past is not None:
                past.phases[replica_id] = dict(phases)

    def _decide_if_complete(self, rnd: RoundState) -> None:
        if rnd.complete():
            self.close(rnd)

    async def _enforce_deadline(self, rnd: RoundState) -> None:
        try:
            await asyncio.wait_for(rnd.decided.wait(), timeout=max(0.0, rnd.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            silent = [m.replica_id for m in rnd.plan.members if m.replica_id not in rnd.reports]
            window = rnd.deadline - rnd.opened_at
            self.close(rnd, f"deadline of {window:.0f}s passed; no report from {silent or 'the trainer'}", reason="deadline")

    def close(self, rnd: RoundState, error: Optional[str] = None, reason: Optional[str] = None) -> None:
        """Decide ``rnd``: commit it unless ``error`` or a participant's report says otherwise."""
        if rnd.decided.is_set():
            return
        failed = [rid for rid, err in rnd.reports.items() if err]
        if error is None and rnd.sender_error:
            error, reason = f"trainer: {rnd.sender_error}", "trainer"
        if error is None and failed:
            error = "; ".join(f"{rid}: {rnd.reports[rid]}" for rid in failed)
            reason = "replica"
        if error is None and rnd.copy_error:
            error, reason = f"the coordinator's copy: {rnd.copy_error}", "keeper"
        plan = rnd.plan
        expected = self._expected_digests(rnd)
        mismatched = self._mismatched(rnd, expected) if error is None else {}
        if mismatched:
            error = "; ".join(
                f"{rid}: received bytes differ from those sent in {digests_.describe(names)}" for rid, names in mismatched.items()
            )
            reason = "digest"
            failed = sorted(mismatched)
            if self.metrics is not None:
                for rid in mismatched:
                    self.metrics.digest_mismatch(rid)
        committed = error is None
        restore = isinstance(plan, RESTORE_ROUNDS)
        if self.metrics is not None:
            nbytes = sum(p.nbytes for p in plan.params)
            kind = "restore" if restore else "adapter" if isinstance(plan, (AdapterRound, AdapterRemovalRound)) else "publish"
            self.metrics.round(kind, committed, time.monotonic() - rnd.opened_at, nbytes, reason)
        self.store.decided(plan, committed, rnd.version)
        received = {rid: digests_.combine(d) for rid, d in rnd.received.items()}
        if committed:
            # A storage round sent nothing: no digest names the committed bytes any more.
            if isinstance(plan, (PushRound, SessionRound, StorageRound)):
                self.committed_digests = (rnd.version, rnd.sender_digests) if rnd.sender_digests is not None else None
                self._committed_combined = digests_.combine(rnd.sender_digests) if rnd.sender_digests is not None else ""
            for rid, combined in received.items():
                self.replica_digests[rid] = (rnd.version, combined)
        if isinstance(plan, PushRound):
            # Every participant keeps a committed round's group; after an abort some
            # have dropped it, so the next round forms a new one.
            self._kept = _KeptGroup.of(plan) if committed else None
            if committed and self._offer is not None and plan.transfer_info is self._offer:
                self._offer_holders |= rnd.member_ids  # every member received it
            elif not committed:
                # Whatever a member's engine holds after a failed round (its failure may be
                # that it lacks the export), the next round gives every member the offer in full.
                self._offer_holders -= rnd.member_ids
        elif isinstance(plan, (SessionRound, StorageRound)):
            # A storage round forms no group, but its members forget the one they held
            # (an engine keeps it only across the publish rounds it serves).
            self._kept = None
        rnd.outcome = RoundOutcome(
            plan.round_id, committed, self.store.committed_version(plan), error or "", failed, unreachable="" if committed else rnd.unreachable,
            digest=digests_.combine(expected) if expected is not None else "", replica_digests=received, mismatched=mismatched,
        )
        self.last_outcome = rnd.outcome
        self.history.append(rnd.outcome)
        del self.history[:-HISTORY]
        rnd.decided.set()
        self._lock.release()
        for listener in self.listeners:
            listener.decided(rnd)
        log = logger.info if committed else logger.error
        log("%s %s (committed version %d)%s", plan.round_id, "committed" if committed else "aborted", self.store.version, f": {error}" if error else "")

    def _expected_digests(self, rnd: RoundState) -> Optional[dict[str, str]]:
        """What every member must have received: the publisher's digests of what it sent;
        in a pull round of the committed version, that version's publisher's. None: the
        round has none to check against (the sender gave none, or a reload)."""
        if rnd.sender_digests is not None:
            return rnd.sender_digests
        if isinstance(rnd.plan, PullRound) and self.committed_digests is not None and self.committed_digests[0] == rnd.plan.version:
            return self.committed_digests[1]
        return None

    @staticmethod
    def _mismatched(rnd: RoundState, expected: Optional[dict[str, str]]) -> dict[str, list[str]]:
        """replica -> the tensors whose received digests differ from ``expected``. A member
        that reported no digests (its backend computes none) is not compared; logged."""
        if expected is None:
            return {}
        out: dict[str, list[str]] = {}
        for rid in sorted(rnd.member_ids):
            got = rnd.received.get(rid)
            if got is None:
                logger.info("%s: %s reported no digests of what it received; not compared", rnd.round_id, rid)
                continue
            names = digests_.differing(expected, got)
            if names:
                out[rid] = names
        return out

    def committed_digest(self) -> Optional[dict[str, Any]]:
        """The committed version's combined digest as its publisher sent it, or None."""
        if self.committed_digests is None:
            return None
        return {"version": self.committed_digests[0], "digest": self._committed_combined}

    def replica_digest(self, replica_id: str) -> Optional[dict[str, Any]]:
        """The version and combined digest of what ``replica_id`` received in the last
        round it committed, or None (it has received none since the coordinator started)."""
        held = self.replica_digests.get(replica_id)
        return {"version": held[0], "digest": held[1]} if held is not None else None

    def status(self) -> dict[str, Any]:
        return {
            "round_in_progress": self.current.round_id if self.current and not self.current.decided.is_set() else None,
            "last_outcome": vars(self.last_outcome) if self.last_outcome else None,
            "recent_rounds": [vars(o) for o in self.history],
        }
