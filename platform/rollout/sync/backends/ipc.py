"""The ``ipc`` backend: a trainer sharing the replicas' GPU, vLLM's CUDA IPC engine.

Nothing is broadcast. Before the round opens the publisher *offers* one CUDA IPC
handle per parameter (torch's ``reduce_tensor``, the format of vLLM's
``IPCWeightTransferEngine``, unpacked); the plan carries them and each replica's
engine maps the trainer's memory and loads straight from it. Contiguous CUDA
parameters are shared in place, so a publish costs the trainer no copy and no GPU
memory. The handles name this process's GPU by UUID: a replica on another GPU fails
the round with vLLM's "IPC handle not found for GPU UUID".

The handles travel pickled (vLLM's ``ipc_handles_pickled``): they hold torch classes
that vLLM's engine-core messages only carry as pickles. The replicas' engine
(:mod:`rollout.sync.backends.ipc_worker`) unpickles them in the worker, so replicas run
without ``VLLM_ALLOW_INSECURE_SERIALIZATION`` (which vLLM's own IPC engine needs, and which
enters vLLM's compile-cache key). Only an authenticated publisher inside the Ray cluster
can open a round that carries them (never over HTTP).
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from rollout.contracts.backend import Sender, SyncBackend, TransferInfo, TransferRound
from rollout.contracts.sync_protocol import Member
from rollout.sync.backends.cuda_device import sending_device

if TYPE_CHECKING:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

IPC_HANDLES = "ipc_handles_pickled"  # the field of vLLM's IPCWeightTransferUpdateInfo
_NEEDS_HANDLES = (
    "the 'ipc' backend needs the publisher's CUDA IPC handles (and nothing else); "
    "publish with WeightPublisher.connect from a process on the replicas' GPU node"
)


@dataclass(frozen=True)
class IpcTransferInfo(TransferInfo):
    """What an ``ipc`` publisher offers: one CUDA IPC handle per parameter, in the round's
    ``params`` order, pickled and base64-encoded (vLLM's ``ipc_handles_pickled``)."""

    ipc_handles_pickled: str

    def __post_init__(self) -> None:
        if not isinstance(self.ipc_handles_pickled, str) or not self.ipc_handles_pickled:
            from rollout.errors import InvalidRequestError

            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)


class IpcSender(Sender):
    # No transfer group (group_name stays None): replicas read the handles.

    def __init__(self) -> None:
        super().__init__()
        # What the offered handles point into. reduce_tensor's handles do not keep the
        # storage alive, so these must outlive every replica's load: kept until the next
        # offer or close(), i.e. past the round's commit.
        self._shared: list[torch.Tensor] = []

    def offer(self, tensors: Sequence[torch.Tensor]) -> IpcTransferInfo:
        from torch.multiprocessing.reductions import reduce_tensor

        # The handles name the GPU holding the tensors; it must be the replicas' GPU.
        device = sending_device(tensors, "ipc")
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.close()
        self._shared = [t.detach().to(device).contiguous() for t in tensors]
        handles = [{uuid: reduce_tensor(t)[1]} for t in self._shared]
        # Replicas start reading as soon as the round opens: the trainer's pending
        # writes (the optimizer step, the copies above) must have landed.
        torch.cuda.synchronize(device)
        return IpcTransferInfo(base64.b64encode(pickle.dumps(handles)).decode())

    def send(self, plan: TransferRound, tensors: Sequence[torch.Tensor]) -> None:
        pass  # the replicas pull through the offered handles

    def close(self) -> None:
        self._shared = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let the driver free storage no replica maps any more


class IpcBackend(SyncBackend):
    name = "ipc"
    sender_cls = IpcSender
    transfer_info_cls = IpcTransferInfo
    has_rendezvous = False  # every parameter has its own handle (zero-copy for the trainer)
    # vLLM's IPC engine, unpickling the handles itself: no VLLM_ALLOW_INSECURE_SERIALIZATION
    # in the replicas' environment (it would change vLLM's compile-cache key). Trainers
    # written for `vllm serve` ask for vLLM's own "ipc" trainer engine.
    worker_engine = "rollout.sync.backends.ipc_worker:UnpicklingIpcWeightTransferEngine"
    engine_name = "rollout-ipc"

    def init_info(self, plan: TransferRound, member: Member) -> "IPCWeightTransferInitInfo":
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo

        return IPCWeightTransferInitInfo(packed=False)

    def check_transfer_info(self, transfer_info: Union[TransferInfo, dict, None]) -> Optional[TransferInfo]:
        """Replicas pull from the publisher's handles: required, and nothing else."""
        from rollout.errors import InvalidRequestError

        if isinstance(transfer_info, dict) and set(transfer_info) != {IPC_HANDLES}:
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)
        if transfer_info is None:
            raise InvalidRequestError(f"transfer_info.{IPC_HANDLES}", _NEEDS_HANDLES)
        return super().check_transfer_info(transfer_info)
