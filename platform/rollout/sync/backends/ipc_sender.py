"""Trainer-side sender of the ``ipc`` backend: a trainer sharing the replicas' GPU.

Nothing is broadcast. Before the round opens the publisher *offers* one CUDA IPC
handle per parameter (torch's ``reduce_tensor``, the format of vLLM's
``IPCWeightTransferEngine``, unpacked); the plan carries them and each replica's
engine maps the trainer's memory and loads straight from it. Contiguous CUDA
parameters are shared in place, so a publish costs the trainer no copy and no GPU
memory. The handles name this process's GPU by UUID: a replica on another GPU fails
the round with vLLM's "IPC handle not found for GPU UUID".

The handles travel pickled (vLLM's ``ipc_handles_pickled``): they hold torch classes
that vLLM's engine-core messages only carry as pickles, so ``ipc`` replicas run with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. Only an authenticated publisher inside the
Ray cluster can open a round that carries them (never over HTTP).
"""

from __future__ import annotations

import base64
import pickle
from typing import Sequence

import torch

from rollout.sync.backends.cuda_device import sending_device
from rollout.sync.plan import RoundPlan


IPC_HANDLES = "ipc_handles_pickled"  # the field of vLLM's IPCWeightTransferUpdateInfo


class IpcSender:
    group_name = None  # no transfer group: replicas read the handles

    def __init__(self) -> None:
        # What the offered handles point into. reduce_tensor's handles do not keep the
        # storage alive, so these must outlive every replica's load: kept until the next
        # offer or close(), i.e. past the round's commit.
        self._shared: list[torch.Tensor] = []

    def offer(self, tensors: Sequence[torch.Tensor]) -> dict:
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
        return {IPC_HANDLES: base64.b64encode(pickle.dumps(handles)).decode()}

    def send(self, plan: RoundPlan, tensors: Sequence[torch.Tensor]) -> None:
        pass  # the replicas pull through the offered handles

    def close(self) -> None:
        self._shared = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let the driver free storage no replica maps any more
