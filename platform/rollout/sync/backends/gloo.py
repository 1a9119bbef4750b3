"""The ``gloo`` backend, for CPU engines: rank 0 broadcasts packed buckets over gloo.

The replicas run our :class:`~rollout.sync.backends.gloo_worker.GlooWeightTransferEngine`.
The only backend whose wire the coordinator's copy (the keeper, on CPU) can ride, so the
only one that catches replicas up without a checkpoint. Its groups outlive their round
while membership is unchanged.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rollout.sync.backends.base import SyncBackend
from rollout.sync.backends.gloo_group import GroupSlot, Rendezvous
from rollout.sync.backends.gloo_stream import send_buckets
from rollout.sync.protocol import Member, RoundPlan


def rendezvous(plan: RoundPlan) -> Rendezvous:
    """Where the round's gloo group forms (the same for the sender, the keeper and every worker)."""
    return Rendezvous(plan.group, plan.master_address, plan.master_port, plan.world_size, plan.timeout_s)


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

    @property
    def group_name(self) -> Optional[str]:
        """The group this sender still holds; offered to the coordinator for reuse."""
        return self._slot.name

    def offer(self, tensors: Sequence[torch.Tensor]) -> None:
        return None  # pushed by send()

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        with self._slot.use(rendezvous(plan), 0) as group:
            send_buckets(group, plan.params, tensors, plan.bucket_bytes)

    def close(self) -> None:
        self._slot.drop()
