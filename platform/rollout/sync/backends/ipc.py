"""The ``ipc`` backend: a trainer sharing the replicas' GPU, vLLM's CUDA IPC engine
reading straight into the live parameters.

Nothing is broadcast. Before the round opens the publisher *offers* one CUDA IPC
handle per parameter (torch's ``reduce_tensor``, the format of vLLM's
``IPCWeightTransferEngine``, unpacked), named by an ``export_id``; the plan carries them
and each replica's engine (ours, :mod:`rollout.sync.backends.ipc_worker`) maps the
trainer's memory and copies from it into the parameters with one ``_foreach_copy_``
where the direct plan allows (vLLM's ``load_weights`` path otherwise). Contiguous CUDA
parameters are shared in place, so a publish costs the trainer no copy and no GPU
memory. While the trainer's tensors stay where they were, the publisher offers the same
export again and the replicas keep it mapped (:mod:`rollout.sync.backends.ipc_handles`):
a steady-state publish maps nothing. The handles name this process's GPU by UUID: a
replica on another GPU fails the round with vLLM's "IPC handle not found for GPU UUID".

While the same export is offered again after a round that committed with it, the
publisher names it by its id alone (:meth:`IpcTransferInfo.reference`): the coordinator
keeps the last complete offer, puts its handles only into the plan of a member that did
not receive that export in a committed round (one that joined or restarted since), and
every other message of the round carries the id, not ~100 KiB of handles (under Ray's
inline-object limit, issue 41); the round's parameter list goes by its digest alongside
(``RoundRequest.params_digest``, ``PushRound.params_digest``). A member whose engine lacks the export anyway fails the
round (every replica keeps the committed version) and the next offer repeats the handles.

The handles travel pickled (vLLM's ``ipc_handles_pickled``, a string that crosses vLLM's
engine-core channel as plain msgpack) and our engine unpickles them itself: vLLM's own
IPC engine does so only under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, a factor of vLLM's
compile-cache key (replicas compiled under another key than ``vllm serve``, issue 41)
that also lets every engine-core message fall back to pickle. Only an authenticated
publisher inside the Ray cluster can open a round that carries them (never over HTTP).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from rollout.contracts.backend import Sender, SyncBackend, TransferInfo, TransferRound
from rollout.contracts.sync_protocol import Member
from rollout.sync.backends.cuda_device import sending_device
from rollout.sync.backends.ipc_handles import ExportSignature, pickle_handles

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

IPC_HANDLES = "ipc_handles_pickled"  # the field of vLLM's IPCWeightTransferUpdateInfo
EXPORT_ID = "export_id"  # the field of ours (ipc_worker.DirectIpcUpdateInfo)
_NEEDS_HANDLES = (
    "the 'ipc' backend needs the publisher's CUDA IPC handles (and nothing else); "
    "publish with WeightPublisher.connect from a process on the replicas' GPU node"
)


@dataclass(frozen=True)
class IpcTransferInfo(TransferInfo):
    """What an ``ipc`` publisher offers: one CUDA IPC handle per parameter, in the round's
    ``params`` order, pickled and base64-encoded (vLLM's ``ipc_handles_pickled``), and the
    export's id (the same while the publisher offers the same handles again; "" names
    none, and replicas then map the handles every round). Without handles, the export
    ``export_id`` names, offered before (:meth:`reference`)."""

    ipc_handles_pickled: str
    export_id: str = ""

    def __post_init__(self) -> None:
        from rollout.errors import InvalidRequestError

        if not isinstance(self.ipc_handles_pickled, str) or not isinstance(self.export_id, str):
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)
        if not self.ipc_handles_pickled and not self.export_id:
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)

    def offer_id(self) -> str:
        return self.export_id

    def by_reference(self) -> bool:
        return not self.ipc_handles_pickled

    def reference(self) -> Optional["IpcTransferInfo"]:
        return IpcTransferInfo("", self.export_id) if self.export_id else None


class IpcSender(Sender):
    # No transfer group (group_name stays None): replicas read the handles.
    pushes = False

    def __init__(self) -> None:
        super().__init__()
        # What the offered handles point into. reduce_tensor's handles do not keep the
        # storage alive, so these must outlive every replica's load: kept until an offer
        # of other tensors or close(), i.e. past the round's commit. Holding them is also
        # what makes an equal ExportSignature the same memory.
        self._shared: list[torch.Tensor] = []
        self._signature: Optional[ExportSignature] = None
        self._offered: Optional[IpcTransferInfo] = None
        # Whether the last offer was the held export again (no new handles).
        self.export_reused = False
        # The export the last round committed with: every member of that round holds it,
        # and the coordinator keeps its handles, so offering it again names it by id.
        self._committed_export: Optional[str] = None
        # Whether the last offer named the export by id alone.
        self.by_reference = False

    def offer(self, tensors: Sequence[torch.Tensor]) -> IpcTransferInfo:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        # The handles name the GPU holding the tensors; it must be the replicas' GPU.
        device = sending_device(tensors, "ipc")
        shared = [t.detach().to(device).contiguous() for t in tensors]
        signature = ExportSignature.of(shared)
        self.export_reused = self._offered is not None and signature == self._signature
        if not self.export_reused:
            gpu = str(torch.cuda.get_device_properties(device).uuid)
            self.close()
            self._shared, self._signature = shared, signature
            handles = [{gpu: reduce_tensor(t)[1]} for t in shared]
            self._offered = IpcTransferInfo(pickle_handles(handles), uuid.uuid4().hex)
        # Replicas start reading as soon as the round opens: the trainer's pending
        # writes (the optimizer step, the copies above) must have landed. This is also why
        # replicas need not wait on the handles' IPC events.
        torch.cuda.synchronize(device)
        self.phases = {"offer": time.perf_counter() - t0}
        self.by_reference = self.export_reused and self._committed_export == self._offered.export_id
        return self._offered.reference() if self.by_reference else self._offered

    def decided(self, version: Optional[int]) -> None:
        self._committed_export = self._offered.export_id if version is not None and self._offered is not None else None

    def offer_unknown(self) -> None:
        self._committed_export = None

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        pass  # the replicas pull through the offered handles

    def close(self) -> None:
        self._shared, self._signature, self._offered, self._committed_export = [], None, None, None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let the driver free storage no replica maps any more


class IpcBackend(SyncBackend):
    name = "ipc"
    sender_cls = IpcSender
    transfer_info_cls = IpcTransferInfo
    has_rendezvous = False  # every parameter has its own handle (zero-copy for the trainer)
    init_once = True  # the init only records packed=False: replicas init their engine once
    # Replicas receive with vLLM's IPC engine less its per-round rebuild and layerwise
    # reload (ipc_worker); "ipc" in vLLM's factory stays vLLM's engine.
    worker_engine = "rollout.sync.backends.ipc_worker:DirectIpcWeightTransferEngine"
    engine_name = "rollout-ipc-direct"

    def init_info(self, plan: TransferRound, member: Member) -> "IPCWeightTransferInitInfo":
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

        return IPCWeightTransferInitInfo(packed=False)

    def check_transfer_info(self, transfer_info: Union[TransferInfo, dict, None]) -> Optional[TransferInfo]:
        """Replicas pull from the publisher's handles: required, and nothing else."""
        from rollout.errors import InvalidRequestError

        if isinstance(transfer_info, dict) and not (set(transfer_info) and set(transfer_info) <= {IPC_HANDLES, EXPORT_ID}):
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)
        if transfer_info is None:
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)
        return super().check_transfer_info(transfer_info)
