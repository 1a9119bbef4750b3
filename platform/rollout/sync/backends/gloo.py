"""The ``gloo`` backend, for CPU engines: rank 0 broadcasts packed buckets over gloo.

The replicas run our :class:`~rollout.sync.backends.gloo_worker.GlooWeightTransferEngine`.
The only backend whose wire the coordinator's copy (the keeper, on CPU) can ride, so the
only one that catches replicas up without a checkpoint: the publisher sends that copy
after the round commits, over a group of two, from the packed buckets it sent the
replicas. Its groups outlive their round while membership is unchanged.
"""

from __future__ import annotations

import uuid
from typing import Optional, Sequence

import torch

from rollout.sync.backends.base import SyncBackend
from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, Rendezvous
from rollout.sync.backends.gloo_stream import send_buckets, send_packed
from rollout.sync.net import PORTS_ENV, PortRange, free_port
from rollout.sync.protocol import Member, RoundPlan


def rendezvous(plan: RoundPlan) -> Rendezvous:
    """Where the round's gloo group forms (the same for the sender, the keeper and every worker)."""
    return Rendezvous(plan.group, plan.master_address, plan.master_port, plan.world_size, plan.timeout_s)


def copy_rendezvous(plan: RoundPlan) -> Rendezvous:
    """Where the group of two forms that carries the coordinator's copy after the commit."""
    return Rendezvous(plan.copy_group, plan.master_address, plan.copy_port, 2, plan.timeout_s)


class GlooBackend(SyncBackend):
    name = "gloo"
    keeps_copy = True
    transport_has_deadline = True  # the TCPStore's and gloo's own timeouts (the round's)

    def make_sender(self) -> "GlooSender":
        return GlooSender()

    def init_info(self, plan: RoundPlan, member: Member) -> dict:
        return {**self.group_fields(plan, member), "group_name": plan.group, "timeout_s": plan.timeout_s, "bucket_bytes": plan.bucket_bytes}


class GlooSender:
    def __init__(self) -> None:
        self._slot = GroupSlot()
        # The coordinator's copy goes over a group of two of its own after the commit
        # (the replicas do not wait for it), from the packed buckets the round sent.
        self._kept: Optional[list[torch.Tensor]] = None

    @property
    def group_name(self) -> Optional[str]:
        """The group this sender still holds; offered to the coordinator for reuse."""
        return self._slot.name

    def offer(self, tensors: Sequence[torch.Tensor]) -> None:
        return None  # pushed by send()

    def copy_offer(self, ports: Optional[PortRange] = None, setting: str = PORTS_ENV) -> tuple[str, int]:
        """Where the coordinator's copy of the next round goes: a group of two formed for
        that copy alone (off the critical path, so its rendezvous costs no round anything,
        and no stale group can outlive a restarted coordinator), its rendezvous on a port
        of ``ports`` (the publisher's range) where one is set."""
        return f"copy-{uuid.uuid4().hex[:8]}", free_port(ports, setting)

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        # With a copy to send after the commit, the packed buckets are kept for it: the
        # trainer may change its tensors as soon as publish() returns.
        kept: Optional[list[torch.Tensor]] = [] if plan.copy_group else None
        self._kept = None
        with self._slot.use(rendezvous(plan), 0) as group:
            send_buckets(group, plan.params, tensors, plan.bucket_bytes, keep=kept)
        self._kept = kept

    def send_copy(self, plan: RoundPlan) -> None:
        """After ``plan`` committed: the round's buckets to the coordinator's copy."""
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError(f"{plan.round_id}: no buckets kept for the coordinator's copy")
        group = GlooGroup(copy_rendezvous(plan), 0)
        try:
            send_packed(group, kept)
        finally:
            group.close()

    def drop_kept(self) -> None:
        self._kept = None

    def close(self) -> None:
        self._kept = None
        self._slot.drop()
