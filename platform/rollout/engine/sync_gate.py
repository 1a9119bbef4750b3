"""Whether a replica may serve now, and when a batch may run, by the policy version its
weights hold.

The replica reads weight sync through :class:`SyncState`: the sync agent
(:class:`rollout.sync.agent.SyncAgent`) when sync is on, :class:`NoSync` when it is off.
:class:`SyncGate` applies the serving rules to either, so no code path asks whether sync
is enabled: with it off, the replica always serves version 0, is never held, and refuses
only a request that needs a newer version.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Protocol, runtime_checkable

from rollout.config import SyncConfig
from rollout.engine.admission import Prepared
from rollout.errors import EngineUnavailableError, InvalidRequestError, NotServingError, StaleWeightsError
from rollout.sync.adapters import ServedAdapter, ServedAdapters
from rollout.sync.salt import CacheSalts


@runtime_checkable
class SyncState(Protocol):
    """What the replica reads from weight sync (the sync agent's surface it uses)."""

    # Read-only state (the agent serves these as properties):
    held: bool  # generation is paused by a trainer's ``/pause`` until its ``/resume``
    broken: Optional[str]  # why this replica must not serve (it should be replaced), or None
    awaiting_publish: Optional[str]  # why it refuses requests until the next publish, or None
    asleep: Optional[str]  # why it refuses requests while a trainer's /sleep holds it, or None
    sleep_level: int  # the sleep level its engine is at (0: awake)
    version: int  # the policy version its weights hold
    committed: int  # the newest committed version it has heard of
    salts: CacheSalts  # each request's prefix-cache salt, by the version it starts under
    adapters: Optional[ServedAdapters]  # the LoRA adapters it serves (None: no weight sync, so none can be published)
    known_committed: Optional[int]  # the committed version as far as it can vouch for it (None: it cannot)

    def coordinator_lost_s(self) -> Optional[float]:
        """Seconds without an answer from the coordinator, once past its bound; else None."""

    def may_arrive(self, version: int) -> bool:
        """Whether ``version`` can come without a publish that has not begun."""

    async def wait_for_version(self, version: int, timeout_s: float) -> None:
        """Return once ``version`` or newer is served; raise StaleWeightsError after ``timeout_s``."""

    async def start(self) -> None:
        """Register with the coordinator and catch up to the committed version."""

    def stop(self) -> None: ...


class NoSync:
    """Weight sync disabled: always serving, version 0 (the weights it loaded), never held,
    and nothing newer can come."""

    held = False
    broken: Optional[str] = None
    awaiting_publish: Optional[str] = None
    asleep: Optional[str] = None  # sleep is driven through the coordinator: never without it
    sleep_level = 0
    version = 0
    committed = 0
    known_committed: Optional[int] = 0
    adapters: Optional[ServedAdapters] = None  # adapters come through weight sync

    def __init__(self) -> None:
        # The weights never change: nothing to salt, a caller's salt stays as it is.
        self.salts = CacheSalts(salting=False)

    def coordinator_lost_s(self) -> Optional[float]:
        return None  # no coordinator to lose

    def may_arrive(self, version: int) -> bool:
        return version <= self.version

    async def wait_for_version(self, version: int, timeout_s: float) -> None:
        # The gate refuses a newer version first (may_arrive); this only says so if asked.
        if version > self.version:
            raise StaleWeightsError(f"weight sync is disabled: version {version} never arrives; version 0 is all this platform serves")

    async def start(self) -> None:
        pass  # nothing to register with, nothing to catch up to

    def stop(self) -> None:
        pass


# Why a request's min_weight_version is refused at once rather than held: held, it would
# pin a connection for sync.timeout_s and then fail anyway.
AHEAD = (
    "{version} is ahead of the committed version {committed} and of any publish in progress; "
    "send it once the publish of that version has begun"
)
DISABLED = "{version}: weight sync is disabled; version 0 is all this platform serves"


class SyncGate:
    """The serving rules of weight sync over a :class:`SyncState`."""

    def __init__(self, sync: SyncState, rules: SyncConfig, replica_id: str, unreachable: str = AHEAD):
        self.sync = sync
        self.rules = rules  # read when asked: sync.timeout_s and sync.max_staleness
        self.replica_id = replica_id
        self._unreachable = unreachable  # why a version that cannot arrive is refused

    @classmethod
    def over(cls, sync: Optional[SyncState], rules: SyncConfig, replica_id: str) -> SyncGate:
        """The gate over the replica's sync agent, or over :class:`NoSync` (with what it
        says of a newer version) when there is none: the one place that asks."""
        if sync is None:
            return cls(NoSync(), rules, replica_id, unreachable=DISABLED)
        return cls(sync, rules, replica_id)

    @property
    def held(self) -> bool:
        return self.sync.held

    @property
    def version(self) -> int:
        return self.sync.version

    @property
    def asleep(self) -> bool:
        """A trainer's /sleep holds this replica: requests are refused and nothing runs."""
        return self.sync.asleep is not None

    @property
    def sleep_level(self) -> int:
        return self.sync.sleep_level

    @property
    def known_committed(self) -> Optional[int]:
        return self.sync.known_committed

    @contextlib.contextmanager
    def salted(self, caller: Optional[str] = None) -> Iterator[Optional[str]]:
        """The ``cache_salt`` of one request handed to vLLM now (``caller``: the caller's
        own, folded in), the request counted as unfinished until the block ends. Add the
        request to vLLM in the same step of the event loop (no await before it): see
        :mod:`rollout.sync.salt`."""
        with self.sync.salts.request(self.sync.version, caller) as salt:
            yield salt

    def adapter(self, name: str, field: str = "adapter") -> ServedAdapter:
        """The newest committed version of LoRA adapter ``name`` this replica serves;
        :class:`InvalidRequestError` on ``field`` when none was published,
        :class:`NotServingError` when it is committed but not loadable here."""
        adapters = self.sync.adapters
        if adapters is None:
            raise InvalidRequestError(field, f"{name!r}: no adapter can be published here (weight sync is disabled, sync.enabled: false)")
        self.raise_if_adapter_unavailable(name)
        served = adapters.get(name)
        if served is None:
            published = ", ".join(sorted(adapters.versions())) or "none"
            raise InvalidRequestError(field, f"{name!r} is not a published LoRA adapter (published: {published})")
        return served

    @property
    def adapters_unavailable(self) -> bool:
        """Whether any committed adapter is not loadable here (the rare case after a
        coordinator restart): only then is an OpenAI body read for the adapter it names."""
        adapters = self.sync.adapters
        return adapters is not None and bool(adapters.unavailable)

    def raise_if_adapter_unavailable(self, name: str) -> None:
        """:class:`NotServingError` when LoRA adapter ``name`` is committed but not loadable
        here (see rollout.sync.store): refused before any work, retryably (other replicas
        serve it), rather than serve an older version. Any other name passes (the OpenAI
        path leaves it to vLLM: the base model, or its own 404 for an unknown one)."""
        adapters = self.sync.adapters
        unavailable = adapters.unavailable.get(name) if adapters is not None else None
        if unavailable is not None:
            raise NotServingError(
                f"replica {self.replica_id}: LoRA adapter {name!r} version {unavailable} is committed but not loaded here (the weight-sync "
                "coordinator restarted and holds no copy of it to load from); replicas that hold it serve it, and its next publish loads it here",
                self.replica_id,
            )

    def check_adapters(self, prepared: Prepared, offset: int = 0) -> None:
        """Refuse a batch naming an adapter that was not published, before any engine work."""
        for i, (req, _) in enumerate(prepared, start=offset):
            if req.adapter is not None:
                self.adapter(req.adapter, f"requests[{i}].adapter")

    def raise_if_broken(self) -> None:
        if self.sync.broken:
            raise EngineUnavailableError(f"replica {self.replica_id}: {self.sync.broken}")

    def raise_if_awaiting_publish(self) -> None:
        """Alive but waiting for the next publish, or asleep (a trainer's /sleep, until its
        /wake_up has the committed weights back): its health check passes; its requests are
        refused at once, retryably."""
        if self.sync.awaiting_publish:
            raise NotServingError(f"replica {self.replica_id}: {self.sync.awaiting_publish}", self.replica_id)
        if self.sync.asleep:
            raise NotServingError(f"{self.sync.asleep}; retry once the trainer wakes the replicas", self.replica_id)

    async def admit(self, prepared: Prepared, offset: int = 0) -> None:
        """Hold a batch until this replica serves the policy version it needs: the
        requests' ``min_weight_version`` and, with ``sync.max_staleness``, no more than
        that many versions behind the committed one."""
        sync = self.sync
        wanted = 0
        for i, (req, _) in enumerate(prepared, start=offset):
            if req.min_weight_version and not sync.may_arrive(req.min_weight_version):
                raise InvalidRequestError(
                    f"requests[{i}].min_weight_version", self._unreachable.format(version=req.min_weight_version, committed=sync.committed)
                )
            wanted = max(wanted, req.min_weight_version or 0)
        lost = sync.coordinator_lost_s()
        if lost is not None and (self.rules.max_staleness is not None or wanted > sync.version):
            # Its staleness rule cannot be checked: a round may have committed without it.
            raise StaleWeightsError(
                f"replica {self.replica_id} has not reached the weight-sync coordinator for {lost:.0f}s and cannot vouch that "
                f"version {sync.version} is recent enough ({self._version_rule(wanted)}); retry (another replica may serve it)"
            )
        if self.rules.max_staleness is not None:
            wanted = max(wanted, sync.committed - self.rules.max_staleness)
        if wanted > sync.version:
            await sync.wait_for_version(wanted, self.rules.timeout_s)

    def _version_rule(self, wanted: int) -> str:
        if self.rules.max_staleness is not None:
            return f"sync.max_staleness {self.rules.max_staleness}"
        return f"min_weight_version {wanted}"

    async def start(self) -> None:
        """Registration (and catch-up) happen before the replica's constructor returns, so
        Serve routes no request to it until it holds the committed version."""
        await self.sync.start()

    def stop(self) -> None:
        self.sync.stop()
