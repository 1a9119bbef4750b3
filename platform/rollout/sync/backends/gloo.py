"""The ``gloo`` backend, for CPU engines: rank 0 broadcasts packed buckets over gloo.

The replicas run our :class:`~rollout.sync.backends.gloo_worker.GlooWeightTransferEngine`.
The only backend whose wire the coordinator's copy (the keeper, on CPU) can ride, so the
only one that catches replicas up without a checkpoint: the publisher sends that copy
after the round commits, over a group of two, from the packed buckets it sent the
replicas. Its groups outlive their round while membership is unchanged.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rollout.contracts.backend import CopyOffer, CopySender, SyncBackend, TransferRound
from rollout.contracts.net import PORTS_ENV, PortRange, free_port
from rollout.contracts.sync_protocol import Member, PushRound
from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, copy_rendezvous, rendezvous
from rollout.sync.backends.gloo_stream import SentDigests, send_buckets, send_packed

if TYPE_CHECKING:
    from rollout.sync.backends.gloo_worker import GlooInitInfo

__all__ = ["GlooBackend", "GlooSender", "copy_rendezvous", "rendezvous"]  # the round's rendezvous live in gloo_group


class GlooSender(CopySender):
    def __init__(self) -> None:
        super().__init__()
        self._slot = GroupSlot()
        # The coordinator's copy goes over a group of two of its own after the commit
        # (the replicas do not wait for it), from the packed buckets the round sent.
        self._kept: Optional[list[torch.Tensor]] = None

    @property
    def group_name(self) -> Optional[str]:
        """The group this sender still holds; offered to the coordinator for reuse."""
        return self._slot.name

    def copy_offer(self, ports: Optional[PortRange] = None, setting: str = PORTS_ENV) -> CopyOffer:
        """Where the coordinator's copy of the next round goes: a group of two formed for
        that copy alone (off the critical path, so its rendezvous costs no round anything,
        and no stale group can outlive a restarted coordinator), its rendezvous on a port
        of ``ports`` (the publisher's range) where one is set."""
        return CopyOffer(f"copy-{uuid.uuid4().hex[:8]}", free_port(ports, setting))

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        # With a copy to send after the commit, the packed buckets are kept for it: the
        # trainer may change its tensors as soon as publish() returns.
        kept: Optional[list[torch.Tensor]] = [] if isinstance(plan, PushRound) and plan.copy is not None else None
        self._kept = None
        self.sent_digests = None
        sent = SentDigests()
        with self._slot.use(rendezvous(plan), 0) as group:
            send_buckets(group, plan.params, tensors, plan.bucket_bytes, keep=kept, digests=sent)
        self._kept = kept
        self.sent_digests = sent.digests
        self.phases = {"digest": sent.seconds}

    def send_copy(self, plan: PushRound) -> None:
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


class GlooBackend(SyncBackend):
    name = "gloo"
    digests_received = True  # GlooWeightTransferEngine digests what it receives (rollout.sync.digest)
    sender_cls = GlooSender  # a CopySender: the coordinator keeps a copy
    transport_has_deadline = True  # the TCPStore's and gloo's own timeouts (the round's)
    worker_engine = "rollout.sync.backends.gloo_worker:GlooWeightTransferEngine"
    trainer_engine = "rollout.sync.backends.gloo_trainer:GlooTrainerWeightTransferEngine"

    def make_copy(self, model_path: str) -> Any:
        """The coordinator's copy (the keeper, on its CPU), from the checkpoint until the first commit."""
        from rollout.sync.keeper import WeightKeeper

        return WeightKeeper(model_path)

    def init_info(self, plan: TransferRound, member: Member) -> "GlooInitInfo":
        from rollout.sync.backends.gloo_worker import GlooInitInfo

        return GlooInitInfo(**self.group_fields(plan, member), group_name=plan.group, timeout_s=plan.timeout_s, bucket_bytes=plan.bucket_bytes)
