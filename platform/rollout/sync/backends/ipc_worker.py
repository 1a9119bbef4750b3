"""The ``ipc`` backend's receiving engine: vLLM's CUDA IPC engine, taking the publisher's
pickled handles without ``VLLM_ALLOW_INSECURE_SERIALIZATION``.

Registered in vLLM's ``WeightTransferEngineFactory`` under ``IpcBackend.engine_name`` (see
:mod:`rollout.sync.vllm_plugin`; "ipc" is vLLM's own engine). vLLM's
``IPCWeightTransferUpdateInfo`` unpickles ``ipc_handles_pickled`` only in a process whose
environment sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and that variable is one of the
factors of vLLM's compile-cache key (``vllm.envs.compile_factors``): replicas that set it
compiled under another key than ``vllm serve`` with the same arguments (issue 41), and the
same switch lets every message between the engine's processes fall back to pickle.

This engine unpickles the handles itself, once per round, and hands vLLM's dataclass the
handles (``ipc_handles``): everything else (mapping the trainer's memory, loading) is
vLLM's. The handles come only from a round an authenticated publisher opened inside the
Ray cluster: no HTTP route carries a pickle (rollout.sync.sessions, rollout.sync.remote).
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, IPCWeightTransferUpdateInfo

from rollout.sync.backends.ipc import IPC_HANDLES


class UnpicklingIpcWeightTransferEngine(IPCWeightTransferEngine):
    def parse_update_info(self, update_dict: dict[str, Any]) -> IPCWeightTransferUpdateInfo:
        pickled = update_dict.get(IPC_HANDLES)
        if pickled is not None:
            if update_dict.get("ipc_handles") is not None:
                raise ValueError(f"update_info carries both ipc_handles and {IPC_HANDLES}")
            handles = pickle.loads(base64.b64decode(pickled))
            update_dict = {**{k: v for k, v in update_dict.items() if k != IPC_HANDLES}, "ipc_handles": handles}
        return super().parse_update_info(update_dict)
