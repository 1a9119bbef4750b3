"""The ``gloo_delta`` backend: ``gloo`` that sends only what changed, where that is cheaper.

The sender keeps the weights it last committed (its base: version, tensors in host memory,
their digests) and, before each round opens, prices a delta against a full send
(:mod:`rollout.sync.delta`); it offers the delta (:class:`GlooDelta`: base version, base
digest, per-tensor counts) as the round's transfer info, or nothing for a full send. The
coordinator refuses a delta whose base is not the committed version, every replica one
whose base is not the version it serves (the agent) or not the bytes its engine holds
(:class:`~rollout.sync.backends.gloo_delta_worker.GlooDeltaWeightTransferEngine`, by digest),
and the coordinator's copy one whose base it does not hold: a delta never lands on the
wrong base. A round that carried a delta and aborted makes the next send full.

What it costs: the trainer keeps one copy of the model in host memory (the base; a full
round's packed buckets, kept rather than dropped), each replica's engine one copy in
checkpoint layout (to digest the full tensors it holds after a patch, and to check the
base). After a delta commits the publisher sends the coordinator's copy in full (from its
base), off the round's critical path, so catch-up and rollback never depend on a chain of
deltas.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from rollout.contracts.backend import TransferInfo, TransferRound
from rollout.contracts.sync_protocol import PushRound
from rollout.sync import delta, digest
from rollout.sync.backends.gloo import GlooBackend, GlooSender
from rollout.sync.backends.gloo_group import GlooGroup, copy_rendezvous, rendezvous
from rollout.sync.backends.gloo_stream import SentDigests, send_buckets
from rollout.sync.backends.delta_info import GlooDelta  # torch-free: the ingress types it too
from rollout.sync.wire import plan_buckets, unpack

logger = logging.getLogger(__name__)

INDEX_BYTES = 8  # int64 indices on gloo's wire


@dataclass
class _Held:
    """Weights the sender sent: the base once committed."""

    version: Optional[int]  # None until committed
    tensors: dict[str, torch.Tensor]  # host copies, untouched by the trainer's later steps
    digests: dict[str, str]

    @property
    def combined(self) -> str:
        return digest.combine(self.digests)


class GlooDeltaSender(GlooSender):
    def __init__(self) -> None:
        super().__init__()
        self._base: Optional[_Held] = None  # what is committed, as this sender sent it
        self._sent: Optional[_Held] = None  # the last round's weights, until it is decided
        self._delta: Optional[delta.Delta] = None  # what prepare() priced, for offer() and send()

    def prepare(self, named: Sequence[tuple[str, torch.Tensor]], full_because: Optional[str] = None) -> None:
        """Before the round opens: price a delta against the committed base."""
        self._delta, self._sent = None, None
        names = [n for n, _ in named]
        if full_because:
            self.choice = delta.full_choice(named, f"{full_because}: full")
        elif self._base is None or self._base.version is None:
            self.choice = delta.full_choice(named, "no committed base held by this publisher (its first publish, or the last delta round aborted): full")
        elif set(self._base.tensors) != set(names):
            self.choice = delta.full_choice(named, "the tensors differ from the base's: full")
        else:
            computed = delta.compute(self._base.tensors, named, INDEX_BYTES)
            self.choice = computed.choice
            if computed.choice.mode == "delta":
                self._delta = computed
        logger.info("publish as %s: %s", self.choice.mode, self.choice.rule)

    def offer(self, tensors: Sequence[torch.Tensor]) -> Optional[GlooDelta]:
        if self._delta is None:
            return None
        return GlooDelta(self._base.version, self._base.combined, tuple(self._delta.counts))

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        offered = plan.transfer_info if isinstance(plan, PushRound) else None
        if not isinstance(offered, GlooDelta):
            self._send_full(plan, tensors)
            return
        if self._delta is None or self._base is None:
            raise RuntimeError(f"{plan.round_id} carries a delta this sender did not price")
        self._kept = None
        self.sent_digests = None
        wire = delta.wire_specs(plan.params, offered.delta_counts)
        with self._slot.use(rendezvous(plan), 0) as group:
            send_buckets(group, wire, delta.wire_tensors(self._delta, tensors), plan.bucket_bytes)
        # The new weights in full (changed tensors copied to the host, the rest the base's),
        # digested as a full round's are: what every replica must now hold.
        held = dict(self._base.tensors)
        digests = dict(self._base.digests)
        t0 = time.perf_counter()
        for d, t in zip(self._delta.tensors, tensors):
            if d.count != 0:
                held[d.name] = t.detach().to("cpu", copy=True)
                digests[d.name] = digest.tensor_digest(held[d.name])
        self.phases = {"digest": time.perf_counter() - t0}
        self._sent = _Held(None, held, digests)
        self.sent_digests = digests

    def _send_full(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        # GlooSender's send, with the packed buckets always kept: they become the base.
        kept: list[torch.Tensor] = []
        self._kept = None
        self.sent_digests = None
        sent = SentDigests()
        with self._slot.use(rendezvous(plan), 0) as group:
            send_buckets(group, plan.params, tensors, plan.bucket_bytes, keep=kept, digests=sent)
        self._kept = kept if isinstance(plan, PushRound) and plan.copy is not None else None
        held: dict[str, torch.Tensor] = {}
        for buffer, bucket in zip(kept, plan_buckets(plan.params, plan.bucket_bytes)):
            held.update(unpack(buffer, [plan.params[i] for i in bucket]))
        self._sent = _Held(None, held, dict(sent.digests))
        self.sent_digests = sent.digests
        self.phases = {"digest": sent.seconds}

    def decided(self, version: Optional[int]) -> None:
        sent, self._sent = self._sent, None
        if version is not None and sent is not None:
            sent.version = version
            self._base = sent
        elif self._delta is not None:
            # Replicas that loaded part of it were restored, some maybe from a checkpoint
            # their engine's base copy does not follow: the next send is full.
            logger.warning("a delta round aborted: the next publish sends in full")
            self._base = None
        self._delta = None

    def send_copy(self, plan: PushRound) -> None:
        """After ``plan`` committed: the coordinator's copy, in full (see the module doc)."""
        if self._kept is not None:
            super().send_copy(plan)
            return
        base = self._base
        if base is None or base.version != plan.version:
            raise RuntimeError(f"{plan.round_id}: no committed weights held for the coordinator's copy")
        group = GlooGroup(copy_rendezvous(plan), 0)
        try:
            send_buckets(group, plan.params, [base.tensors[p.name] for p in plan.params], plan.bucket_bytes)
        finally:
            group.close()

    def close(self) -> None:
        super().close()
        self._base = self._sent = None
        self._delta = None


class GlooDeltaBackend(GlooBackend):
    name = "gloo_delta"
    sender_cls = GlooDeltaSender
    transfer_info_cls = GlooDelta
    worker_engine = "rollout.sync.backends.gloo_delta_worker:GlooDeltaWeightTransferEngine"
    trainer_engine = None  # vLLM-route trainers send in full: they use "gloo"

    def check_transfer_info(self, transfer_info: Union[TransferInfo, dict, None]) -> Optional[TransferInfo]:
        # Optional here: nothing offered is a full send.
        return None if transfer_info is None else super().check_transfer_info(transfer_info)
