"""The ``sparse_nccl`` backend's receiving engine: vLLM's sparse NCCL engine, taking a
tensor whole as well as patched.

vLLM's ``SparseNCCLWeightTransferEngine`` receives, per tensor, ``num_updates`` int32
indices then as many values, and applies them through ``load_checkpoint_weight_patches``.
A patch costs 6 bytes per bf16 element it carries, so a tensor most of whose elements
changed (and every tensor of a first publish) is cheaper whole: 2 bytes per element.
This engine (registered as ``SparseNcclBackend.engine_name`` by
:mod:`rollout.sync.vllm_plugin`; "sparse_nccl" stays vLLM's) takes a count of
:data:`~rollout.sync.backends.delta_info.DENSE` (-1) for such a tensor: it receives the
tensor's values alone and applies them as a patch whose indices (``arange``) it builds on
its own device, so every byte still lands through vLLM's same loader (NaN-masked, the
same in-place copies) and nothing on the wire pays for those indices. Counts >= 0 are
received exactly as vLLM's engine receives them (its trainer engine can send here too).

Memory stays bounded: received tensors are applied in groups of about
:data:`APPLY_CHUNK_BYTES` (checkpoint bytes) as they arrive, not held for the whole model;
an unchanged tensor (an empty patch) is received and not loaded (a patch of nothing
changes nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine, SparseNCCLWeightTransferUpdateInfo
from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

from rollout.sync.backends.delta_info import DENSE

# Checkpoint bytes applied per loader call (vLLM's loader stages each tensor full-size,
# NaN where unchanged; a whole tensor's indices add 4 bytes per element on top).
APPLY_CHUNK_BYTES = 256 << 20


@dataclass
class DenseOrSparseUpdateInfo(SparseNCCLWeightTransferUpdateInfo):
    """vLLM's sparse update info, whose ``num_updates_list`` may also hold
    :data:`DENSE` (-1): that tensor travels whole, its values only."""

    def __post_init__(self) -> None:
        bad = [n for n in self.num_updates_list if not isinstance(n, int) or n < DENSE]
        if bad:
            raise ValueError(f"`num_updates_list` entries are {DENSE} (sent whole), 0 (unchanged) or a count of patched elements; got {bad[0]!r}")
        # vLLM's own checks of the rest (lists that line up), a whole tensor counted as 0.
        SparseNCCLWeightTransferUpdateInfo(self.names, self.dtype_names, self.shapes, [max(n, 0) for n in self.num_updates_list])


def received_patch(name: str, shape: tuple[int, ...], dtype: torch.dtype, values: torch.Tensor, indices: Optional[torch.Tensor]) -> CheckpointWeightPatch:
    """A received tensor as vLLM's loader takes it: a patch, or for a whole tensor
    (``indices`` None) a patch of every element, its indices made here."""
    if indices is None:
        indices = torch.arange(math.prod(shape), dtype=torch.int32, device=values.device)
    return CheckpointWeightPatch(name=name, shape=tuple(shape), dtype=dtype, values=values, indices=indices)


def apply_patches(model: torch.nn.Module, patches: Iterable[tuple[CheckpointWeightPatch, bool]], chunk_bytes: int = APPLY_CHUNK_BYTES) -> set[str]:
    """Load ``(patch, whole)`` pairs into ``model`` through vLLM's
    ``load_checkpoint_weight_patches`` as they come, about ``chunk_bytes`` of checkpoint
    tensors per call; empty patches are skipped. Whole tensors' indices are ``arange``
    (unique by construction), so vLLM's duplicate check (a sort of every index) runs on
    the received patches only. Returns the names the loader reported."""
    loaded: set[str] = set()
    pending: dict[bool, list[CheckpointWeightPatch]] = {False: [], True: []}
    sizes = {False: 0, True: 0}

    def flush(whole: bool) -> None:
        if pending[whole]:
            loaded.update(load_checkpoint_weight_patches(model, pending[whole], max_chunk_bytes=chunk_bytes, validate_unique_indices=not whole))
        pending[whole], sizes[whole] = [], 0

    for patch, whole in patches:
        if patch.values.numel() == 0:
            continue
        pending[whole].append(patch)
        sizes[whole] += math.prod(patch.shape) * patch.values.element_size()
        if sizes[whole] >= chunk_bytes:
            flush(whole)
    flush(False)
    flush(True)
    return loaded


def receive(group: Any, info: DenseOrSparseUpdateInfo, device: torch.device, stream: Any) -> Iterator[tuple[CheckpointWeightPatch, bool]]:
    """Each tensor of ``info`` as it arrives over ``group`` (the order of
    :func:`rollout.sync.backends.sparse_nccl.broadcast_patches`): a patch's indices then
    its values, as vLLM's engine receives them, or a whole tensor's values alone."""
    for name, dtype_name, shape, n in zip(info.names, info.dtype_names, info.shapes, info.num_updates_list, strict=True):
        dtype = getattr(torch, dtype_name)
        indices = None
        if n != DENSE:
            indices = torch.empty(n, dtype=torch.int32, device=device)
            group.broadcast(indices, src=0, stream=stream)
        values = torch.empty(math.prod(shape) if n == DENSE else n, dtype=dtype, device=device)
        group.broadcast(values, src=0, stream=stream)
        yield received_patch(name, tuple(shape), dtype, values, indices), n == DENSE


class DenseOrSparseNCCLWeightTransferEngine(SparseNCCLWeightTransferEngine):
    """vLLM's sparse NCCL engine (its communicator, init and shutdown inherited) whose
    update info allows whole tensors; every tensor applied through vLLM's loader."""

    update_info_cls = DenseOrSparseUpdateInfo

    def receive_weights(self, update_info: DenseOrSparseUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        # As vLLM's engine: receive on the communicator's device, not the RPC thread's.
        device = self.model_update_group.device
        with torch.accelerator.device_index(device.index):
            stream = torch.cuda.current_stream(device=device)
            apply_patches(self.model, receive(self.model_update_group, update_info, device, stream))
