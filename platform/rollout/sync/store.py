"""The committed weights: which version is committed, and what holds a copy of it that a
lagging replica can be brought back from, whichever backend moved the bytes.

The one owner of restore and catch-up. A replica that starts behind the committed
version (catch-up) or whose transfer broke off mid-way (rollback) gets, first that holds
the committed version:

* a :class:`ReloadRound`: the directory a publisher named (``RoundRequest.checkpoint``,
  or the checkpoint of a storage publish, with its manifest id, which the replica
  verifies first), which the replica reloads itself with vLLM's ``reload_weights`` (any
  backend);
* a :class:`PullRound`: the coordinator's own copy (where the backend keeps one, gloo's
  :class:`~rollout.sync.keeper.WeightKeeper`), which the coordinator sends;
* at version 0 (nothing published yet), a :class:`ReloadRound` of the model directory the
  replicas started from (a level-2 sleep discards a replica's weights before any publish);
* else :class:`NoCommittedCopyError`: the next publish brings the weights.

It also keeps every committed LoRA adapter (:class:`~rollout.contracts.sync_protocol.Adapter`, name ->
its newest committed version, bytes included: a few MB each), which a replica that starts
later loads before its first request, until an unload removes it. Adapters have versions
of their own: an adapter round leaves the base version as it is.

A restarted coordinator learns its adapters back from the replicas, as it learns the base
version (:meth:`CommittedWeights.learn_adapters`): each registers with the adapters it
serves (and the versions an unload removed), so the next publish of a name continues after
the newest version any replica holds (each version's vLLM LoRA name, "math@2", keys the
replicas' prefix caches: a reused number would serve another version's KV), and status lists
them. It holds no bytes of a learned adapter: a replica that starts later cannot load it, and
is told so (:class:`~rollout.contracts.sync_protocol.CommittedAdapters`): it serves the adapters it
could load and refuses requests naming that one, retryably, until its next publish (see
:meth:`~rollout.sync.adapters.ServedAdapters.unavailable`). Waiting for that publish
instead would keep the replica from serving the base model and every other adapter for as
long as no trainer publishes that one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Optional, Protocol, Union

from rollout.contracts import net
from rollout.contracts.backend_registry import get_backend
from rollout.contracts.net import PortRange
from rollout.contracts.sync_protocol import RESTORE_ROUNDS, Adapter, AdapterRemovalRound, CommittedAdapters, HeldAdapter, AdapterRound, Member, NoCommittedCopyError, PullRound, PushRound, ReloadRound, Round, SessionRound, StorageRound, Transfer
from rollout.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class CommittedCopy(Protocol):
    """A backend's copy of the committed weights on the coordinator, a rank of the rounds
    that feed it and the sender of pull rounds (gloo's: :class:`~rollout.sync.keeper.WeightKeeper`)."""

    version: int  # the version it holds: 0 is the checkpoint the replicas started from

    def join(self, plan: SessionRound, rank: int) -> None: ...  # a route session's group, ahead of its rounds

    def receive(self, plan: Union[PushRound, SessionRound], rank: int) -> None: ...  # staged until commit/discard

    def receive_copy(self, plan: PushRound) -> dict: ...  # after the commit, over plan.copy

    def install(self, version: int, tensors: dict) -> None: ...

    def commit(self, round_id: str, version: int) -> None: ...

    def discard(self, round_id: str) -> None: ...

    def send(self, plan: PullRound) -> None: ...


def copy_for(backend: str, model_path: str) -> Optional[CommittedCopy]:
    """The backend's copy of the committed weights, where it keeps one (the backend makes
    it: the store knows no particular backend)."""
    return get_backend(backend).make_copy(model_path)


class CommittedWeights:
    def __init__(self, backend: str, model_path: str, timeout_s: float, rendezvous_ports: Optional[PortRange]):
        self.backend = backend
        self.model_path = model_path  # what every replica loaded at start: version 0's weights
        self.timeout_s = timeout_s
        self.rendezvous_ports = rendezvous_ports  # where pull rounds' rendezvous listen (sync.rendezvous_ports)
        # The committed version. A restarted coordinator starts at 0 and learns it back
        # from the replicas (:meth:`learn`), which keep it in their engines.
        self.version = 0
        self.keeper: Optional[CommittedCopy] = copy_for(backend, model_path)
        # open publish round -> the directory its publisher named, and its manifest id ("": none)
        self._offered: dict[str, tuple[str, str]] = {}
        self._checkpoint: Optional[tuple[int, str, str]] = None  # (version, directory, manifest id) of the last commit that named one
        self._copy: Optional[asyncio.Task] = None  # the keeper receiving the last commit's copy
        # name -> the committed version of each adapter published to this coordinator.
        self.adapters: dict[str, Adapter] = {}
        # name -> the committed version of each adapter learned back from the replicas after
        # a restart (learn_adapters), whose bytes this coordinator does not hold: until the
        # next publish of each. A name is here or in ``adapters``, never both.
        self.learned: dict[str, int] = {}
        # name -> the version an unload removed (here, or on the replicas before a restart):
        # a later publish of the name continues after it, since each version's vLLM LoRA name
        # ("math@2") keys the replicas' prefix caches. Also the newest version a replica
        # reported above the one held here (see learn_adapters).
        self._removed: dict[str, int] = {}

    def adapter_version(self, name: str) -> int:
        """The committed version of adapter ``name`` (0: none committed)."""
        held = self.adapters.get(name)
        return held.version if held is not None else self.learned.get(name, 0)

    def adapter_versions(self) -> dict[str, int]:
        """name -> committed version of every committed adapter, learned ones included."""
        return {**self.learned, **{name: a.version for name, a in self.adapters.items()}}

    def committed_adapters(self) -> CommittedAdapters:
        """What a replica catching up loads, and what it cannot (learned, no bytes here)."""
        return CommittedAdapters(
            copies=tuple(self.adapters.values()), without_copy=tuple(HeldAdapter(name, version) for name, version in self.learned.items())
        )

    def learn_adapters(self, replica_id: str, held: tuple[HeldAdapter, ...]) -> None:
        """Replica ``replica_id`` holds these adapter versions, committed by this coordinator
        or one before it (a restart): learn the newest of each. Never a version this
        coordinator knows an unload removed, or one older than it holds; the replica that
        lags behind one held here loads it at catch-up."""
        for h in held:
            if not h.served:
                if h.version > self._removed.get(h.name, 0):
                    self._removed[h.name] = h.version
                if 0 < self.learned.get(h.name, 0) <= h.version:
                    # Another replica still serves it (it missed the unload): the unload committed.
                    del self.learned[h.name]
                    logger.info("replica %s: adapter %s was unloaded at version %d; not committed", replica_id, h.name, h.version)
                continue
            if h.version <= self._removed.get(h.name, 0):
                continue  # removed, or superseded by a version a replica reported
            copy = self.adapters.get(h.name)
            if copy is not None:
                if h.version > copy.version:
                    # Committed by a coordinator before this one, which then restarted and
                    # published the name again before this replica registered. The version
                    # published here stays committed (the newest publish); the next one goes
                    # past both, so no number names two versions from here on.
                    self._removed[h.name] = h.version
                    logger.warning(
                        "replica %s serves adapter %s version %d, newer than the committed version %d (published after a "
                        "coordinator restart): it serves its version until the next publish of %s, which continues after %d",
                        replica_id, h.name, h.version, copy.version, h.name, h.version,
                    )
                continue
            if h.version > self.learned.get(h.name, 0):
                self.learned[h.name] = h.version
                logger.info(
                    "learned adapter %s version %d from replica %s: committed before this coordinator started; no copy is "
                    "held here until its next publish, so replicas that start before then serve it only where loaded",
                    h.name, h.version, replica_id,
                )

    def last_adapter_version(self, name: str) -> int:
        """The newest version adapter ``name`` ever had here (committed or removed since)."""
        return max(self.adapter_version(name), self._removed.get(name, 0))

    def committed_version(self, plan: Round) -> int:
        """The committed version after deciding ``plan``, as its outcome names it: an
        adapter round's adapter's (0 once removed), else the base weights'."""
        if isinstance(plan, AdapterRound):
            return self.adapter_version(plan.adapter.name)
        if isinstance(plan, AdapterRemovalRound):
            return self.adapter_version(plan.name)
        return self.version

    @property
    def keeps_copy(self) -> bool:
        return self.keeper is not None

    @property
    def copy_version(self) -> Optional[int]:
        return self.keeper.version if self.keeper is not None else None

    def learn(self, version: int) -> None:
        """A replica serves ``version``: committed by a coordinator before this one."""
        self.version = max(self.version, version)

    # ---- publish rounds -------------------------------------------------------------

    @staticmethod
    def check_checkpoint(checkpoint: Optional[str]) -> None:
        if checkpoint is not None and not os.path.isabs(checkpoint):
            raise InvalidRequestError("checkpoint", f"{checkpoint!r} must be an absolute path that every replica can read")

    def offered(self, round_id: str, checkpoint: Optional[str], manifest: str = "") -> None:
        """Publish round ``round_id``'s weights are also at ``checkpoint``: restores reload it
        once committed (verified against ``manifest``, its manifest id, where it has one)."""
        if checkpoint is not None:
            self._offered[round_id] = (checkpoint, manifest)

    def copy_after(self, has_members: bool, copy_offered: bool) -> bool:
        """Whether a publish round's copy comes after the commit, over the group of two the
        publisher offered (its replicas then never wait for it). With no replica to send to,
        the copy receives in the round (it commits into the copy alone)."""
        return self.keeper is not None and copy_offered and has_members

    # ---- the copy as a rank of a round ----------------------------------------------

    async def join(self, plan: SessionRound, rank: int) -> None:
        await asyncio.to_thread(self.keeper.join, plan, rank)

    async def receive(self, plan: Union[PushRound, SessionRound], rank: int) -> tuple[Optional[str], str]:
        """Receive ``plan`` as ``rank`` (staged until the decision); (error or None, the
        unreachable "address:port" or "")."""
        try:
            # The copy is a rank like the replicas (the only one with none live): an
            # unreachable publisher fails the round in seconds here too. A kept group's
            # (and a route session's) rendezvous was reached when it formed.
            if isinstance(plan, PushRound) and not plan.transfer.group_name:
                await net.check_reachable(plan.transfer.master_address, plan.transfer.master_port, plan.timeout_s)
            await asyncio.to_thread(self.keeper.receive, plan, rank)
        except net.RendezvousUnreachable as e:
            return f"the coordinator {e}", e.target
        except Exception as e:
            return f"{type(e).__name__}: {e}", ""
        return None, ""

    def discard(self, round_id: str) -> None:
        """A receive that ended after its round was decided (aborted) without it."""
        if self.keeper is not None:
            self.keeper.discard(round_id)

    # ---- decisions ----------------------------------------------------------------------

    def decided(self, plan: Round, committed: bool, version: int) -> None:
        """Round ``plan`` was decided: on a commit ``version`` is the committed version, and
        whatever holds its weights (the named directory, the copy) is what restores use."""
        if isinstance(plan, AdapterRound):
            if committed:
                self.adapters[plan.adapter.name] = plan.adapter
                self.learned.pop(plan.adapter.name, None)
            return  # the base weights, and what holds them, are as they were
        if isinstance(plan, AdapterRemovalRound):
            if committed and (self.adapters.pop(plan.name, None), self.learned.pop(plan.name, None)) != (None, None):
                self._removed[plan.name] = plan.version
            return
        checkpoint = self._offered.pop(plan.round_id, None)
        if committed:
            self.version = version
        if isinstance(plan, RESTORE_ROUNDS):
            return  # they bring back what is committed; nothing new to hold
        if committed:
            self._checkpoint = (version, *checkpoint) if checkpoint else None
        if self.keeper is None or isinstance(plan, StorageRound):
            # A storage round sends nothing: the copy keeps the version it holds, and
            # restores reload the committed checkpoint instead.
            return
        if committed and isinstance(plan, PushRound) and plan.copy is not None:
            self._copy = asyncio.get_running_loop().create_task(self._receive_copy(plan, version))
        elif committed:
            self.keeper.commit(plan.round_id, version)
        else:
            self.keeper.discard(plan.round_id)

    async def _receive_copy(self, plan: PushRound, version: int) -> None:
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

    # ---- restore and catch-up -----------------------------------------------------------

    def _committed_checkpoint(self) -> Optional[tuple[str, str]]:
        """(directory, manifest id) holding the committed version, or None."""
        return self._checkpoint[1:] if self._checkpoint and self._checkpoint[0] == self.version else None

    def _base_model(self) -> Optional[tuple[str, str]]:
        """At version 0 with no copy holding it: the model directory itself (what every
        replica started from), e.g. for a replica whose weights a level-2 sleep discarded
        before any publish. None otherwise."""
        if self.version != 0 or (self.keeper is not None and self.keeper.version == 0):
            return None
        return self.model_path, ""

    async def ready_to_restore(self, replica_id: str) -> None:
        """Wait (up to a step deadline) for the copy of the last commit, if restores need it
        and it is on its way; :class:`NoCommittedCopyError` at once when nothing will hold
        the committed weights (before the caller waits for the round lock)."""
        if self._committed_checkpoint() is not None or self._base_model() is not None:
            return
        copy = self._copy
        if copy is not None and not copy.done():
            await asyncio.wait({copy}, timeout=self.timeout_s)
        self._check_copy_holds_committed(replica_id)

    def restore_round(self, member: Member, fields: Callable[..., dict]) -> Union[ReloadRound, PullRound]:
        """The round that brings ``member`` to the committed weights, from the first source
        holding them; ``fields(kind, version, members)`` are the round's shared fields."""
        checkpoint = self._committed_checkpoint() or self._base_model()
        if checkpoint is not None:
            directory, manifest = checkpoint
            return ReloadRound(**fields("reload", self.version, (member,)), checkpoint=directory, manifest=manifest)
        self._check_copy_holds_committed(member.replica_id)
        port = net.free_port(self.rendezvous_ports, "sync.rendezvous_ports")
        return PullRound(**fields("restore", self.version, (member,)), transfer=Transfer(net.own_address(), port, 1 + member.ranks))

    def _check_copy_holds_committed(self, replica_id: str) -> None:
        if self.keeper is None:
            raise NoCommittedCopyError(
                f"cannot restore {replica_id}: backend {self.backend!r} keeps no copy of the committed weights; "
                "publish with checkpoint=<a directory every replica reads> so replicas can reload them"
            )
        if self.keeper.version != self.version:
            # E.g. this coordinator restarted: it knows the committed version from the
            # replicas but holds no copy of those weights until the next publish.
            raise NoCommittedCopyError(
                f"cannot restore {replica_id}: the coordinator's copy holds version {self.keeper.version}, "
                f"the committed version is {self.version}; the next publish refreshes it"
            )

    async def send(self, plan: PullRound) -> Optional[str]:
        """Send the copy in pull round ``plan`` as rank 0; the error, or None."""
        try:
            await asyncio.to_thread(self.keeper.send, plan)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
