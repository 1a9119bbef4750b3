"""Who the coordinator serves: the registered replicas, which of them are live, how to
wake their long polls, and the :class:`Control` each applied.

Replicas *pull*: each one long-polls the coordinator, so membership is simply "who polled
recently". One silent for ``silent_polls`` polls of ``poll_s`` is dropped (a round may then
commit without it); the two come from ``sync.poll_s`` and ``sync.silent_polls``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from rollout.contracts.sync_protocol import Control, NotRegisteredError, ParamSpec

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    ranks: int
    version: int
    last_seen: float
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    control: Control = Control()  # what the replica last applied
    reset_ok: bool = True  # its last prefix-cache reset succeeded


class Membership:
    def __init__(self, poll_s: float, silent_polls: int):
        self.poll_s = poll_s
        self.silent_polls = silent_polls
        self.replicas: dict[str, Replica] = {}
        # The served model's parameters, as the first replica announced them: what a publish must carry.
        self.params: Optional[list[ParamSpec]] = None
        # What a trainer asked of every replica through vLLM's routes; replicas converge to it.
        self.control = Control()
        self._departed: list[str] = []  # dropped since the metrics last asked

    def register(self, replica_id: str, ranks: int, version: int, params: list[ParamSpec]) -> None:
        if self.params is None:
            self.params = list(params)
        self.replicas[replica_id] = Replica(ranks=ranks, version=version, last_seen=time.monotonic())

    def get(self, replica_id: str) -> Optional[Replica]:
        return self.replicas.get(replica_id)

    def registered(self, replica_id: str) -> Replica:
        r = self.replicas.get(replica_id)
        if r is None:
            raise NotRegisteredError(f"replica {replica_id} is not registered")
        return r

    def seen(self, replica_id: str, version: Optional[int] = None) -> None:
        r = self.replicas.get(replica_id)
        if r is not None:
            r.last_seen = time.monotonic()
            if version is not None:
                r.version = version

    def polled(self, replica_id: str, version: int, control: Control, reset_ok: bool) -> Optional[Replica]:
        """A poll: what the replica serves and applied; None when it is not registered."""
        r = self.replicas.get(replica_id)
        if r is not None:
            r.last_seen = time.monotonic()
            r.version, r.control, r.reset_ok = version, control, reset_ok
        return r

    async def wait(self, replica_id: str) -> None:
        """The body of a long poll: until the replica is woken, at most ``poll_s``."""
        r = self.replicas[replica_id]
        r.wake.clear()
        try:
            await asyncio.wait_for(r.wake.wait(), timeout=self.poll_s)
        except asyncio.TimeoutError:
            pass
        r.last_seen = time.monotonic()

    def control_due(self, replica_id: str) -> Optional[Control]:
        """The Control to answer a replica that applied another one."""
        return self.control if self.replicas[replica_id].control != self.control else None

    def wake(self, replica_ids) -> None:
        for rid in replica_ids:
            r = self.replicas.get(rid)
            if r is not None:
                r.wake.set()

    def wake_all(self) -> None:
        for r in self.replicas.values():
            r.wake.set()

    def live(self, busy: frozenset[str] = frozenset()) -> dict[str, int]:
        """Replica -> ranks of those that polled within the silence horizon, dropping the
        rest. ``busy``: members of an undecided round, which do not poll while in it
        (receiving, or blocked in report() until the decision); its deadline bounds how long."""
        horizon = time.monotonic() - self.silent_polls * self.poll_s
        for rid in [rid for rid, r in self.replicas.items() if r.last_seen < horizon and rid not in busy]:
            logger.warning("replica %s stopped polling; dropped from membership", rid)
            del self.replicas[rid]
            self._departed.append(rid)
        return {rid: r.ranks for rid, r in self.replicas.items()}

    def take_departed(self) -> list[str]:
        gone, self._departed = self._departed, []
        return gone

    def versions(self) -> dict[str, int]:
        return {rid: r.version for rid, r in self.replicas.items()}
