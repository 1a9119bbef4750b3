"""A gloo process group over a TCPStore, outside torch.distributed's global state.

The round's sender (the trainer, or the keeper in a restore round) is rank 0 and hosts
the store; every engine worker joins as ``rank_offset + its rank within the engine``.
A group outlives its round while membership stays the same (:class:`GroupSlot`):
forming one costs a rendezvous and a full mesh of connections, hundreds of
milliseconds on a busy host. Any failure drops it, and a membership change names a
new one, so a round never inherits a dead rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where and how a group forms: the same for every rank of it."""

    name: str
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float


class GlooGroup:
    def __init__(self, rendezvous: Rendezvous, rank: int):
        r = rendezvous
        timeout = timedelta(seconds=r.timeout_s)
        self.name = r.name
        self.rank = rank
        self.world_size = r.world_size
        # The store's own timeout bounds the rendezvous: a rank that never joins
        # ends the round with an error instead of a hang.
        self._store = dist.TCPStore(r.master_address, r.master_port, r.world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(r.name, self._store)
        self._pg = dist.ProcessGroupGloo(prefixed, rank, r.world_size, timeout)

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0):
        """Start a broadcast; ``.wait()`` on the result. gloo runs it on its own
        threads, so the caller can pack or load another bucket meanwhile."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return self._pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self.broadcast_async(tensor, root).wait()

    def barrier(self) -> None:
        self.broadcast(torch.zeros(1, dtype=torch.uint8))

    def close(self) -> None:
        self._pg = None
        self._store = None


class GroupSlot:
    """One participant's transfer group across rounds: kept while rounds name the same
    group, re-formed when they name another, dropped by :meth:`drop` after a failure."""

    def __init__(self) -> None:
        self.group: Optional[GlooGroup] = None

    @property
    def name(self) -> Optional[str]:
        return self.group.name if self.group is not None else None

    def join(self, rendezvous: Rendezvous, rank: int) -> GlooGroup:
        g = self.group
        if g is not None and g.name == rendezvous.name and g.rank == rank and g.world_size == rendezvous.world_size:
            return g
        self.drop()
        self.group = GlooGroup(rendezvous, rank)
        return self.group

    @contextmanager
    def use(self, rendezvous: Rendezvous, rank: int) -> Iterator[GlooGroup]:
        """:meth:`join` for the length of one transfer; a failure inside drops the group
        (peers may be gone or out of step), so the next round forms a new one."""
        group = self.join(rendezvous, rank)
        try:
            yield group
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
