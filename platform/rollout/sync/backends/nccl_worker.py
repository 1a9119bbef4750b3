"""The ``nccl`` backend's receiving engine: vLLM's NCCL engine, receiving straight into
the live parameters where it can.

Registered in vLLM's ``WeightTransferEngineFactory`` under
``NcclBackend.engine_name`` (see :mod:`rollout.sync.vllm_plugin`; "nccl" is vLLM's own
engine). It joins and keeps the communicator exactly as vLLM's ``NCCLWeightTransferEngine``
does (inherited), and receives the same packed stream with vLLM's own
``packed_nccl_broadcast_consumer`` (same buckets as the trainer's producer). What changes
is what each received bucket goes into: vLLM's engine runs every round inside the
layerwise-reload lifecycle (each of ~345 modules put on meta, materialized, copied back)
and calls ``model.load_weights`` per bucket; this one replays a copy plan baked once from
``load_weights`` (:mod:`rollout.sync.backends.direct_plan`): one ``_foreach_copy_`` per
bucket into the parameters' storage, no reload.

The direct path is taken only where the plan reproduces ``load_weights`` exactly; every
other round is vLLM's own (layerwise reload + ``load_weights``), whole, with the reason
logged once: not CUDA (on CPU vLLM repacks linear weights after loading, so the live
tensors are not what the loaders write), quantization, LoRA, pipeline or tensor
parallelism, a draft-model round, an unpacked transfer, or a plan :func:`bake` refuses.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

from rollout.sync.backends.direct_engine import DIRECT, VLLM, DirectReceiver
from rollout.sync.backends.direct_plan import Ineligible

logger = logging.getLogger(__name__)


class DirectNcclWeightTransferEngine(DirectReceiver, NCCLWeightTransferEngine):
    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._direct_init()

    # ---- which path ---------------------------------------------------------------

    def _static_reason(self) -> Optional[str]:
        """Why no round of this engine (as configured now) can take the direct path."""
        reason = super()._static_reason()
        if reason is None and not self.packed:
            return "the transfer is not packed"
        return reason

    # ---- vLLM's engine interface ----------------------------------------------------

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        if self._mode == VLLM:
            self.last_path = VLLM
            return super().receive_weights(update_info)
        try:
            plan = self._plan_for(update_info.names, update_info.dtype_names, update_info.shapes)
        except Ineligible as e:
            if self._mode == DIRECT:
                # A later chunk of a round already received directly: no reload can start
                # now (it would put half-updated layers on meta). Plain load_weights is what
                # the plan would have replayed, for a CUDA model without quantization.
                self._fall_back(f"{e.reason} (a later chunk: plain load_weights)")
                self.last_path = "load_weights"
                return self._receive(update_info, self.model.load_weights)
            self._fall_back(e.reason)
            self._start_vllm()
            self.last_path = VLLM
            return super().receive_weights(update_info)
        self._mode = self.last_path = DIRECT
        # Fills (vocab padding rows) touch no received bytes: once, before the copies.
        plan.apply_fills()
        self._receive(update_info, plan.apply)

    def _receive(self, info: NCCLWeightTransferUpdateInfo, post_unpack) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        specs = ((n, (s, getattr(torch, d))) for n, d, s in zip(info.names, info.dtype_names, info.shapes))
        # vLLM's own consumer, so the buckets split exactly as the trainer's producer
        # packs them; each bucket's copies run on the stream it was received on.
        packed_nccl_broadcast_consumer(
            iterator=specs,
            group=self.model_update_group,
            src=0,
            post_unpack_func=post_unpack,
            buffer_size_bytes=self.packed_buffer_size_bytes,
            num_buffers=self.packed_num_buffers,
            device=self.device,
        )
