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

from rollout.contracts import net
from rollout.contracts.sync_protocol import PullRound, PushRound, SessionRound


@dataclass(frozen=True)
class Rendezvous:
    """Where and how a group forms: the same for every rank of it."""

    name: str
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float


def rendezvous(plan: "PushRound | PullRound | SessionRound") -> Rendezvous:
    """Where a round's group forms (the same for the sender, the keeper and every worker)."""
    t = plan.transfer
    return Rendezvous(plan.group, t.master_address, t.master_port, t.world_size, plan.timeout_s)


def copy_rendezvous(plan: PushRound) -> Rendezvous:
    """Where the group of two forms that carries the coordinator's copy after ``plan`` commits."""
    if plan.copy is None:
        raise ValueError(f"{plan.round_id} sends no copy to the coordinator")
    return Rendezvous(plan.copy.group_name, plan.transfer.master_address, plan.copy.port, 2, plan.timeout_s)


def _pairs_hint() -> str:
    ephemeral = net.ephemeral_ports()
    here = f" (here {ephemeral})" if ephemeral else ""
    return (
        f"gloo's listeners bind ports the kernel picks from {net.EPHEMERAL_SYSCTL}{here}, and of each pair the host "
        "with the higher address connects to the lower one's listener: every host's firewall or NetworkPolicy must "
        "admit that range from its peers (docs/sync-ports.md)"
    )


def local_address(rendezvous: Rendezvous, rank: int) -> net.Choice:
    """The address this rank's gloo pairs listen on and announce to their peers.

    Rank 0 hosts the rendezvous, so its address is the one it advertised there (the
    master address), which the others already proved they reach. Every other rank's is
    :func:`rollout.contracts.net.choose`'s: an engine worker's is its node's address in the Ray
    cluster. gloo's own default (the hostname's address, or ``GLOO_SOCKET_IFNAME``)
    would announce loopback from a host whose hostname maps to 127.0.0.1, and every
    peer on another host would be refused.
    """
    if rank == 0:
        return net.Choice(rendezvous.master_address, "the address it advertised for the rendezvous")
    return net.choose(toward=rendezvous.master_address)


def _options(rendezvous: Rendezvous, rank: int, timeout: timedelta) -> "dist.ProcessGroupGloo._Options":
    local = local_address(rendezvous, rank)
    try:
        device = dist.ProcessGroupGloo.create_device(hostname=local.address)
    except RuntimeError as e:  # gloo binds to it: an address of another host fails here
        raise RuntimeError(
            f"gloo cannot use {local.address!r} ({local.source}) for rank {rank} of {rendezvous.name}: it is not an address of this host ({e})"
        ) from None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [device]
    # _threads keeps gloo's default (2), what the (store, rank, size, timeout) constructor uses.
    return options


class GlooGroup:
    def __init__(self, rendezvous: Rendezvous, rank: int):
        r = rendezvous
        timeout = timedelta(seconds=r.timeout_s)
        self.name = r.name
        self.rank = rank
        self.world_size = r.world_size
        self.master = (r.master_address, r.master_port)
        # First, since it only binds: an address that is not this host's fails here,
        # before the store (whose master connects to its own address) sends anything.
        options = _options(r, rank, timeout)
        # The store's own timeout bounds the rendezvous: a rank that never joins
        # ends the round with an error instead of a hang.
        self._store = dist.TCPStore(r.master_address, r.master_port, r.world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(r.name, self._store)
        try:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, r.world_size, options)
        except RuntimeError as e:
            # gloo's own message ("Connect timeout [none]") names neither side nor port.
            raise RuntimeError(f"rank {rank} of {r.name} at {local_address(r, rank).address} could not connect gloo's pairs: {e}. {_pairs_hint()}") from None

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
        # The rendezvous's address too: a trainer that starts a new transfer engine with the
        # same group name (vLLM's trainers use a fixed one) hosts a new store, and a member
        # keeping the old group would never join it.
        if g is not None and (g.name, g.rank, g.world_size, g.master) == (rendezvous.name, rank, rendezvous.world_size, (rendezvous.master_address, rendezvous.master_port)):
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
