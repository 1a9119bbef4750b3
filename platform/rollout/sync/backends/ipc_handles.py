"""The ``ipc`` backend's exports, both ends, torch only (unit-tested on CPU).

An *export* is one set of CUDA IPC handles the publisher offers, one per parameter
(torch's ``reduce_tensor``, vLLM's unpacked ``ipc_handles`` format: ``{gpu_uuid:
rebuild_cuda_tensor args}``), named by an ``export_id``. Every ``reduce_tensor`` call is a
fresh export with its own reference-count slots in the trainer, and every rebuild on the
replica maps memory and opens an event: per tensor, per round. Both ends keep one export
instead, as long as the trainer's tensors stay where they were:

- :class:`ExportSignature` (the publisher): what its shared tensors are (storage, offset,
  shape, stride, dtype). The sender holds the tensors it shared, so no storage it
  exported can be freed and reallocated meanwhile: an equal signature is the same
  memory, and the same handles (and ``export_id``) are offered again.
- :class:`HeldExport` (the replica's engine): the tensors rebuilt from the last export,
  kept mapped; a round offering the same ``export_id`` reuses them without touching a
  handle.
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

# Index of the device in rebuild_cuda_tensor's arguments (what reduce_tensor returns):
# the receiver puts its own device index there, as vLLM's IPC engine does.
DEVICE_ARG = 6


def pickle_handles(handles: Sequence[dict]) -> str:
    """vLLM's ``ipc_handles_pickled``: the handles pickled and base64-encoded."""
    return base64.b64encode(pickle.dumps(list(handles))).decode()


def unpickle_handles(payload: str) -> list[dict]:
    """The handles ``payload`` carries (only ever from an authenticated publisher inside
    the cluster: the ``ipc`` backend never takes them over HTTP)."""
    handles = pickle.loads(base64.b64decode(payload))
    if not isinstance(handles, list) or not all(isinstance(h, dict) for h in handles):
        raise ValueError(f"`ipc_handles_pickled` must carry a list of {{gpu_uuid: args}} dicts; got {type(handles).__name__}")
    return handles


@dataclass(frozen=True)
class ExportSignature:
    """Where a publisher's shared tensors live: equal signatures (while the tensors are
    held) are the same memory, so the same handles still point at them."""

    entries: tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...], str, str], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> "ExportSignature":
        return cls(
            tuple(
                (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                for t in tensors
            )
        )


def _rebuild_cuda(args: list) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args)


class HeldExport:
    """The tensors of the last export a replica's engine rebuilt, kept mapped."""

    def __init__(self, rebuild: Callable[[list], torch.Tensor] = _rebuild_cuda) -> None:
        self._rebuild = rebuild
        self.export_id: Optional[str] = None
        self.tensors: list[torch.Tensor] = []

    def reuse(self, export_id: str, count: int) -> Optional[list[torch.Tensor]]:
        """The held tensors where ``export_id`` names the held export (and it has
        ``count`` tensors), else None: rebuild."""
        if export_id and export_id == self.export_id and len(self.tensors) == count:
            return self.tensors
        return None

    def rebuild(self, export_id: str, handles: Sequence[dict], gpu_uuid: str, device_index: int) -> list[torch.Tensor]:
        """Map every handle of a new export on ``device_index`` (the GPU ``gpu_uuid``
        names) and hold them in place of the old export. The old one is dropped only
        after: storage both share is then mapped once (torch's cache of opened handles),
        and the new export's reference counts are settled by torch either way."""
        tensors = []
        for handle in handles:
            if gpu_uuid not in handle:
                # vLLM's message: a replica on another GPU than the publisher's tensors.
                raise ValueError(f"IPC handle not found for GPU UUID {gpu_uuid}. Available UUIDs: {list(handle.keys())}")
            args = list(handle[gpu_uuid])
            args[DEVICE_ARG] = device_index
            tensors.append(self._rebuild(args))
        self.tensors, self.export_id = tensors, (export_id or None)
        return tensors

    def release(self) -> None:
        """Unmap the held export (the trainer can then free what it no longer shares)."""
        self.tensors, self.export_id = [], None
