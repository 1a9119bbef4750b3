"""The ``sparse_nccl`` backend, for GPU engines: vLLM's sparse NCCL engine on the
replicas (``vllm.distributed.weight_transfer.sparse_nccl_engine``), which receives
flat-index patches in checkpoint coordinates and applies them in place through the
model's loader (``load_checkpoint_weight_patches``), extended by our engine
(:mod:`~rollout.sync.backends.sparse_nccl_worker`) to take a tensor whole as well.

Each publish is priced as ``gloo_delta``'s is (:func:`rollout.sync.delta.compute`, with
vLLM's int32 indices): against the publisher's committed base, a tensor goes as a patch
(its changed elements' int32 indices, then their values) where that is cheaper than its
dense bytes, else whole (its values only, no indices), and nothing where nothing changed
(an empty patch, as vLLM's trainer engine sends one). The publish is a delta where the
sum beats a full send; otherwise, and with no base (the first publish, or after an
aborted delta), every tensor goes whole: a full round, the bytes of a dense send. The
offer (:class:`SparseNcclDelta`) carries the per-tensor counts (-1 whole, 0 unchanged, k
patched) and, for a delta, its base version: the coordinator refuses a delta whose base is
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

from rollout.contracts.backend import SendChoice, TransferRound
from rollout.contracts.sync_protocol import Member, PushRound
from rollout.sync import delta
from rollout.sync.backends.delta_info import DENSE, INT32_MAX, SparseNcclDelta  # torch-free: the ingress types it too
from rollout.sync.backends.cuda_device import sending_device
from rollout.sync.backends.nccl import NcclBackend, NcclSender

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

logger = logging.getLogger(__name__)

INDEX_BYTES = 4  # vLLM's sparse engine takes int32 indices


@dataclass(frozen=True)
class Patch:
    """One tensor as it goes on the wire: ``indices`` (int32) then ``values`` for a patch
    (empty for an unchanged tensor), ``values`` alone, the whole tensor flat, where
    ``indices`` is None (it travels whole)."""

    values: torch.Tensor  # on the sending device
    indices: Optional[torch.Tensor] = None

    @property
    def count(self) -> int:
        """The tensor's count in the offer: DENSE where it travels whole."""
        return DENSE if self.indices is None else self.indices.numel()


def _check_patchable(name: str, t: torch.Tensor) -> None:
    """``ValueError`` naming the tensor where vLLM's sparse loader would refuse it."""
    if not t.is_floating_point():
        raise ValueError(f"sparse_nccl: {name} is {t.dtype}; vLLM's sparse loader patches floating tensors only (use 'nccl')")
    if t.numel() > INT32_MAX:
        raise ValueError(f"sparse_nccl: {name} has {t.numel()} elements, more than int32 indices address (use 'nccl')")


def patches_for(base: Optional[dict[str, torch.Tensor]], named: Sequence[tuple[str, torch.Tensor]], why_full: str = "no committed base") -> tuple[list[Patch], SendChoice]:
    """What each tensor sends against ``base`` (priced by :func:`rollout.sync.delta.compute`;
    every tensor whole where there is no base, ``why_full`` saying why), and the choice it
    comes to. Raises ``ValueError`` naming the tensor where vLLM's sparse loader would refuse
    it (not floating, NaN values, more elements than int32 indexes)."""
    for name, t in named:
        _check_patchable(name, t)
    if base is None:
        choice = delta.full_choice(named, f"{why_full}: every tensor whole")
        counts = [DENSE] * len(named)
        computed = None
    else:
        computed = delta.compute(base, named, INDEX_BYTES)
        choice = computed.choice
        # A full publish sends every tensor whole (compute comes to "full" only where each
        # changed tensor is cheaper whole and none is unchanged).
        counts = computed.counts if choice.mode == "delta" else [DENSE] * len(named)
    out: list[Patch] = []
    for i, ((name, t), count) in enumerate(zip(named, counts)):
        flat = t.detach().reshape(-1)
        if count == DENSE:
            # The sparse loader stages NaN for "unchanged": a NaN value cannot land (nor could a patch carry one).
            if bool(torch.isnan(flat).any()):
                raise ValueError(f"sparse_nccl: {name} holds NaN values; vLLM's sparse loader reserves NaN for unchanged elements (use 'nccl')")
            out.append(Patch(flat.contiguous()))
        else:
            d = computed.tensors[i]
            out.append(Patch(d.values.contiguous(), d.indices.to(device=flat.device, dtype=torch.int32)))
    return out, choice


def broadcast_patches(group: Any, patches: Sequence[Patch], device: torch.device, stream: Any) -> None:
    """The round's bytes, in the order our engine receives them
    (``sparse_nccl_worker``): per tensor, a patch's int32 indices then its values, as vLLM's
    ``SparseNCCLTrainerWeightTransferEngine._broadcast_chunk`` sends them, or a whole
    tensor's values alone."""
    for p in patches:
        if p.indices is not None:
            group.broadcast(p.indices.to(device), src=0, stream=stream)
        group.broadcast(p.values.to(device), src=0, stream=stream)


class SparseNcclSender(NcclSender):
    """Rank 0 of the sparse NCCL engine's communicator (kept across rounds as
    :class:`NcclSender` keeps it), broadcasting patches as vLLM's sparse trainer engine
    does and whole tensors as values alone (:func:`broadcast_patches`)."""

    def __init__(self) -> None:
        super().__init__()
        self._base: Optional[tuple[int, dict[str, torch.Tensor]]] = None  # (version, tensors) committed
        self._sent: Optional[dict[str, torch.Tensor]] = None
        self._patches: list[Patch] = []
        self._was_delta = False

    def prepare(self, named: Sequence[tuple[str, torch.Tensor]], full_because: Optional[str] = None) -> None:
        base = self._base[1] if self._base is not None and not full_because else None
        why = full_because or "no committed base held by this publisher (its first publish, or the last delta round aborted)"
        if base is not None and set(base) != {n for n, _ in named}:
            base, why = None, "the tensors differ from the base's"
        self._patches, self.choice = patches_for(base, named, why)
        self._was_delta = self.choice.mode == "delta"
        # The next base (copied: the trainer changes its tensors after publish returns).
        self._sent = {n: t.detach().clone() for n, t in named}
        logger.info("publish as %s: %s", self.choice.mode, self.choice.rule)

    def offer(self, tensors: Sequence[torch.Tensor]) -> SparseNcclDelta:
        return SparseNcclDelta(tuple(p.count for p in self._patches), self._base[0] if self._was_delta else None)

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        if not isinstance(plan, PushRound) or not isinstance(plan.transfer_info, SparseNcclDelta):
            raise RuntimeError(f"{plan.round_id}: sparse_nccl sends only what it offered")
        if plan.transfer_info.num_updates_list != tuple(p.count for p in self._patches):
            raise RuntimeError(f"{plan.round_id}: the round's counts are not the ones this sender offered")

        def broadcast(group: Any, device: torch.device) -> None:
            broadcast_patches(group, self._patches, device, torch.cuda.current_stream())

        self._over_communicator(plan, sending_device(tensors, "sparse_nccl"), broadcast)

    def decided(self, version: Optional[int]) -> None:
        sent, self._sent = self._sent, None
        if version is not None and sent is not None:
            self._base = (version, sent)
        elif self._was_delta:
            logger.warning("a delta round aborted: the next publish sends every tensor whole")
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
    # Replicas receive with vLLM's sparse NCCL engine, extended to take a tensor whole (its
    # values, no indices) through the same loader (sparse_nccl_worker). Registered under a
    # name of its own: "sparse_nccl" in vLLM's factory is vLLM's engine.
    worker_engine = "rollout.sync.backends.sparse_nccl_worker:DenseOrSparseNCCLWeightTransferEngine"
    engine_name = "rollout-sparse-nccl"

    def init_info(self, plan: TransferRound, member: Member) -> "NCCLWeightTransferInitInfo":
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        # Unpacked: sparse transfers are never packed (vLLM's sparse trainer engine).
        return NCCLWeightTransferInitInfo(**self.group_fields(plan, member))
