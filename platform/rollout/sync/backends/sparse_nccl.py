"""The ``sparse_nccl`` backend, for GPU engines: vLLM's own sparse NCCL engine on the
replicas (``vllm.distributed.weight_transfer.sparse_nccl_engine``), which receives
flat-index patches in checkpoint coordinates and applies them in place through the
model's loader (``load_checkpoint_weight_patches``).

Every round is a patch: against the publisher's committed base, the elements that changed
(:func:`rollout.sync.delta.changed_indices`), int32 indices then values per tensor, as
vLLM's ``SparseNCCLTrainerWeightTransferEngine`` broadcasts them; the first publish (no
base) patches every element. The offer (:class:`SparseNcclDelta`) carries vLLM's
``num_updates_list`` and the base version: the coordinator refuses a delta whose base is
not the committed version, and every replica one whose base is not the version it serves,
before anything loads. The live weights are the base (the engine patches them in place),
so no copy is kept on the replicas; the trainer keeps its base on the tensors' device.

The engine digests nothing and the coordinator keeps no copy (catch-up and rollback reload
the checkpoint a publish names, as with ``nccl``). Where vLLM's sparse loader cannot
patch (a model whose loaders do more than one final same-shaped copy, quantized weights,
values that are NaN) use ``nccl``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from rollout.sync import delta
from rollout.sync.backends.base import SendChoice, TransferRound
from rollout.sync.backends.delta_info import INT32_MAX, SparseNcclDelta  # torch-free: the ingress types it too
from rollout.sync.backends.cuda_device import sending_device
from rollout.sync.backends.nccl import NcclBackend, NcclSender
from rollout.sync.protocol import Member, PushRound

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

logger = logging.getLogger(__name__)

INDEX_BYTES = 4  # vLLM's sparse engine takes int32 indices


@dataclass(frozen=True)
class Patch:
    indices: torch.Tensor  # int32, on the sending device
    values: torch.Tensor


def patches_for(base: Optional[dict[str, torch.Tensor]], named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[Patch], SendChoice]:
    """Each tensor's patch against ``base`` (every element where there is none), and the
    choice it comes to. Raises ``ValueError`` naming the tensor where vLLM's sparse loader
    would refuse it (not floating, NaN values, more elements than int32 indexes)."""
    out: list[Patch] = []
    full = sent = changed = 0
    for name, t in named:
        if not t.is_floating_point():
            raise ValueError(f"sparse_nccl: {name} is {t.dtype}; vLLM's sparse loader patches floating tensors only (use 'nccl')")
        if t.numel() > INT32_MAX:
            raise ValueError(f"sparse_nccl: {name} has {t.numel()} elements, more than int32 indices address (use 'nccl')")
        flat = t.detach().reshape(-1)
        idx = delta.changed_indices(base[name], t) if base is not None else torch.arange(flat.numel(), device=flat.device)
        values = flat[idx.to(flat.device)]
        if bool(torch.isnan(values).any()):
            raise ValueError(f"sparse_nccl: {name} holds NaN values; vLLM's sparse loader reserves NaN for unchanged elements (use 'nccl')")
        out.append(Patch(idx.to(device=flat.device, dtype=torch.int32), values.contiguous()))
        full += t.numel() * t.element_size()
        sent += idx.numel() * (INDEX_BYTES + t.element_size())
        changed += idx.numel()
    if base is None:
        rule = f"no committed base held by this publisher: every element patched, {sent} bytes (a dense nccl send: {full})"
        return out, SendChoice(mode="full", bytes_sent=sent, full_bytes=full, delta_bytes=None, changed_elements=changed, rule=rule)
    rule = f"{changed} changed elements: {sent} bytes as a delta, {full} bytes in full"
    return out, SendChoice(mode="delta", bytes_sent=sent, full_bytes=full, delta_bytes=sent, changed_elements=changed, rule=rule)


class SparseNcclSender(NcclSender):
    """Rank 0 of vLLM's sparse NCCL engine's communicator (kept across rounds as
    :class:`NcclSender` keeps it), broadcasting what vLLM's sparse trainer engine does."""

    def __init__(self) -> None:
        super().__init__()
        self._base: Optional[tuple[int, dict[str, torch.Tensor]]] = None  # (version, tensors) committed
        self._sent: Optional[dict[str, torch.Tensor]] = None
        self._patches: list[Patch] = []
        self._was_delta = False

    def prepare(self, named: Sequence[tuple[str, torch.Tensor]], full_because: Optional[str] = None) -> None:
        base = self._base[1] if self._base is not None and not full_because else None
        if base is not None and set(base) != {n for n, _ in named}:
            base = None
        self._patches, self.choice = patches_for(base, named)
        self._was_delta = base is not None
        # The next base (copied: the trainer changes its tensors after publish returns).
        self._sent = {n: t.detach().clone() for n, t in named}
        logger.info("publish as %s: %s", self.choice.mode, self.choice.rule)

    def offer(self, tensors: Sequence[torch.Tensor]) -> SparseNcclDelta:
        return SparseNcclDelta(tuple(p.indices.numel() for p in self._patches), self._base[0] if self._was_delta else None)

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        if not isinstance(plan, PushRound) or not isinstance(plan.transfer_info, SparseNcclDelta):
            raise RuntimeError(f"{plan.round_id}: sparse_nccl sends only the patches it offered")

        def broadcast(group: Any, device: torch.device) -> None:
            stream = torch.cuda.current_stream()
            # vLLM's SparseNCCLTrainerWeightTransferEngine._broadcast_chunk: per tensor, its
            # indices then its values; the engine receives in the same order.
            for p in self._patches:
                group.broadcast(p.indices.to(device), src=0, stream=stream)
                group.broadcast(p.values.to(device), src=0, stream=stream)

        self._over_communicator(plan, sending_device(tensors, "sparse_nccl"), broadcast)

    def decided(self, version: Optional[int]) -> None:
        sent, self._sent = self._sent, None
        if version is not None and sent is not None:
            self._base = (version, sent)
        elif self._was_delta:
            logger.warning("a delta round aborted: the next publish patches every element")
            self._base = None
        self._patches = []

    def close(self) -> None:
        super().close()
        self._base = self._sent = None
        self._patches = []


class SparseNcclBackend(NcclBackend):
    name = "sparse_nccl"
    sender_cls = SparseNcclSender
    transfer_info_cls = SparseNcclDelta
    worker_engine = None  # vLLM's own engine of this name
    engine_name = None

    def init_info(self, plan: TransferRound, member: Member) -> "NCCLWeightTransferInitInfo":
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        # Unpacked: sparse transfers are never packed (vLLM's sparse trainer engine).
        return NCCLWeightTransferInitInfo(**self.group_fields(plan, member))
