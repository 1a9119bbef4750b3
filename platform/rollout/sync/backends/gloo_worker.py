"""The ``gloo`` weight-transfer engine: vLLM's worker-side interface, for CPU engines.

Registered in vLLM's ``WeightTransferEngineFactory`` (see :mod:`rollout.sync.vllm_plugin`)
so ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` run on it exactly as they run on vLLM's own NCCL engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout.contracts.sync_protocol import DEFAULT_BUCKET_BYTES, ParamSpec
from rollout.sync import digest
from rollout.sync.backends.gloo_group import GroupSlot, Rendezvous
from rollout.sync.backends.gloo_stream import receive_buckets

if TYPE_CHECKING:
    import torch


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # Where this engine writes its digests of the received tensors (one file per rank,
    # rollout.sync.digest.write_received), for the agent to report; None: none computed.
    digest_path: Optional[str] = None

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per parameter "
                f"(got {len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})"
            )

    def specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.slot = GroupSlot()
        self.bucket_bytes = DEFAULT_BUCKET_BYTES

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # Called every round; joins (or keeps) the group the round names.
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.bucket_bytes = init_info.bucket_bytes
        i = init_info
        self.slot.join(Rendezvous(i.group_name, i.master_address, i.master_port, i.world_size, i.timeout_s), rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on
        # CPU-only torch; gloo's broadcast has completed when wait() returns.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # Dropping the group closes our sockets, so a sender still writing to us
            # gets an error instead of blocking forever; the next round forms a new one.
            self.shutdown()
            # vLLM's worker ends the update session on error without finishing it,
            # which would leave layers on the meta device and break the next
            # start_weight_update. Finalizing materializes them again (with a mix of
            # weights, never served: the replica stays paused until a restore round
            # overwrites every tensor).
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.slot.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        # vLLM's layerwise reload may hold the views until a layer is complete:
        # receive_buckets gives every bucket its own buffer.
        path = update_info.digest_path
        received: Optional[digest.TensorDigests] = {} if path else None
        corrupt = bool(path) and digest.take_corruption(path)  # test hook, inert unless a test set it
        digest_s = 0.0
        import torch

        # On a GPU replica each bucket goes to the GPU whole before it is digested and
        # loaded: the digest then runs there (GPU check 10: 83 GB/s against 4.6 GB/s for one
        # host thread), and the load copies device to device.
        device = torch.device(self.device) if self.device is not None else None
        for named in receive_buckets(self.slot.group, update_info.specs(), self.bucket_bytes, device):
            if corrupt:
                digest.corrupt(named[0][1])  # as a transfer that flipped a byte would
                corrupt = False
            if received is not None:
                # Digested before loading: the bytes that arrived, under the trainer's names
                # (the live parameters are in vLLM's layout). The next buckets are in flight.
                t0 = time.perf_counter()
                digest.digest_all(named, into=received)
                digest_s += time.perf_counter() - t0
            self.model.load_weights(named)
            self._loaded(named)
        if path:
            self._write_digests(path, received, digest_s)

    def _loaded(self, named: list[tuple[str, "torch.Tensor"]]) -> None:
        """One bucket's tensors, loaded (their buffer is theirs to keep: gloo_delta keeps them)."""

    def _write_digests(self, path: str, received: digest.TensorDigests, seconds: float) -> None:
        pc = self.parallel_config
        digest.write_received(path, pc.data_parallel_index * pc.world_size + pc.rank, received, seconds)

    def shutdown(self) -> None:
        self.slot.drop()
