"""The ``ipc`` backend's receiving engine: vLLM's CUDA IPC engine, reading the trainer's
memory straight into the live parameters.

Registered in vLLM's ``WeightTransferEngineFactory`` under ``IpcBackend.engine_name``
(see :mod:`rollout.sync.vllm_plugin`; "ipc" stays vLLM's own engine). vLLM's engine
rebuilds every offered handle each round (``rebuild_cuda_tensor``: an IPC memory
mapping, a shared-memory reference count and an IPC event per tensor) and loads through
``model.load_weights`` inside the layerwise-reload lifecycle; a 2.96 GB publish of 339
tensors on one H200 spent 0.10-0.23 s there, for what is a ~2 ms device-to-device copy.
This one:

- keeps the trainer's mapped tensors from one round to the next. The publisher
  (:class:`~rollout.sync.backends.ipc.IpcSender`) names each export (``export_id``) and
  offers the same one again while its tensors' storage is unchanged; a round offering the
  export this engine holds maps nothing, and the handles are not even unpickled. A new
  export is rebuilt in full (torch's own cache then reuses the mappings of the storage it
  shares with the old one) and the old one released, which is what lets the trainer free
  memory it no longer publishes (its ``ipc_collect``). So the trainer's last exported
  memory stays mapped here between rounds until the next export or this engine's
  shutdown: the trainer's own weights, no memory of the replica's.
- replays the direct plan (:mod:`rollout.sync.backends.direct_plan`) from the mapped
  tensors: one ``torch._foreach_copy_`` from the trainer's memory into the parameters, no
  layerwise reload, where the plan reproduces ``load_weights`` exactly; vLLM's own path
  otherwise (the reasons of :class:`~rollout.sync.backends.direct_engine.DirectReceiver`,
  or a plan :func:`~rollout.sync.backends.direct_plan.bake` refuses), with the reason
  logged once.

Reading the mapped memory needs no IPC event: the publisher synchronizes its device before
it offers (the handles reach a replica only after that), and the trainer does not write
its weights while a round it opened is in flight.

Unpacked transfers only (what ``IpcBackend.init_info`` asks for).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

from rollout.sync.backends.direct_engine import DIRECT, VLLM, DirectReceiver
from rollout.sync.backends.direct_plan import Ineligible
from rollout.sync.backends.ipc_handles import HeldExport, unpickle_handles

logger = logging.getLogger(__name__)


@dataclass
class DirectIpcUpdateInfo(WeightTransferUpdateInfo):
    """vLLM's ``IPCWeightTransferUpdateInfo`` (unpacked, pickled handles) plus the
    publisher's ``export_id``. The handles stay pickled until a round needs them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles_pickled: str  # "" where the round names the export this engine holds by its id alone
    export_id: str = ""  # "" where the publisher names no export: rebuilt every round

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes must have one entry per parameter (got {len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})")
        if not isinstance(self.ipc_handles_pickled, str) or not (self.ipc_handles_pickled or self.export_id):
            raise ValueError("`ipc_handles_pickled` is required: the trainer's CUDA IPC handles (or the `export_id` of the export this engine holds)")


class DirectIpcWeightTransferEngine(DirectReceiver, IPCWeightTransferEngine):
    update_info_cls = DirectIpcUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._direct_init()
        self._held = HeldExport()
        # Seconds per step of the last receive ("map", "copy"), for logs and checks.
        self.phases: dict[str, float] = {}

    def start_weight_update(self) -> None:
        if self.packed:
            raise ValueError("the rollout IPC engine receives unpacked transfers only (IpcBackend's init info says packed=False)")
        super().start_weight_update()  # DirectReceiver's: the path, at the round's one update_weights

    def receive_weights(self, update_info: DirectIpcUpdateInfo) -> None:
        import time

        t0 = time.perf_counter()
        weights = self._mapped(update_info)
        t1 = time.perf_counter()
        if self._mode != VLLM:
            try:
                plan = self._plan_for(update_info.names, update_info.dtype_names, update_info.shapes)
            except Ineligible as e:
                self._fall_back(e.reason)
                self._start_vllm()  # nothing was written yet: vLLM's whole path
            else:
                self._mode = self.last_path = DIRECT
                plan.apply_fills()
                plan.apply(zip(update_info.names, weights))
        if self._mode == VLLM:
            self.last_path = VLLM
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            with disable_mtp_completeness_check():
                self.model.load_weights(list(zip(update_info.names, weights)))
        self.phases = {"map": t1 - t0, "copy": time.perf_counter() - t1}

    def _mapped(self, info: DirectIpcUpdateInfo) -> list[torch.Tensor]:
        """The trainer's tensors, mapped here: the held export where the round offers it
        again, else the offered handles rebuilt (and the old export released)."""
        held = self._held.reuse(info.export_id, len(info.names))
        if held is not None:
            return held
        if not info.ipc_handles_pickled:
            # Named by id for a member the coordinator believed holds it: the round fails
            # (every replica keeps the committed version) and the next offer has the handles.
            raise ValueError(f"the round names export {info.export_id} without its handles, but this engine holds {self._held.export_id or 'none'}")
        # Unpickled here, not under vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION (see rollout.sync.backends.ipc).
        handles = unpickle_handles(info.ipc_handles_pickled)
        if len(handles) != len(info.names):
            raise ValueError(f"`ipc_handles` should be of the same size as `names`: got {len(handles)} and {len(info.names)}")
        uuid, device_index = self._gpu()
        return self._held.rebuild(info.export_id, handles, uuid, device_index)

    def _gpu(self) -> tuple[str, int]:
        """This worker's GPU: its UUID (what the handles are keyed by) and index. The
        worker's own device, not the current one (vLLM's engine does the same)."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return str(torch.cuda.get_device_properties(index).uuid), index

    def shutdown(self) -> None:
        self._held.release()
        super().shutdown()

    def held_export(self) -> Optional[str]:
        """The export this engine keeps mapped (its id), for checks."""
        return self._held.export_id
