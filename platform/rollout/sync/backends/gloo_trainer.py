"""The ``gloo`` backend's trainer side in vLLM's trainer-engine shape.

For trainers written for ``vllm serve`` (its RL routes and vLLM's
``TrainerWeightTransferEngine``): on CPU they swap vLLM's NCCL trainer engine for this
one and keep everything else::

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.base import ModuleSource

    info = GlooTrainerInitInfo(master_address=addr, master_port=port, world_size=1 + world, rank=0)
    engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client, source=ModuleSource(model))
    engine.send_weights()   # /start_weight_update → /update_weights + broadcast → /finish_weight_update

Registered in vLLM's ``WeightTransferTrainerFactory`` as ``gloo`` too. The wire is the
platform's own (packed buckets of ``bucket_bytes``, see :mod:`gloo_stream`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

from rollout.contracts.sync_protocol import DEFAULT_BUCKET_BYTES, ParamSpec
from rollout.sync.backends.gloo_group import GlooGroup, Rendezvous
from rollout.sync.backends.gloo_stream import send_buckets
from rollout.sync.backends.gloo_worker import GlooInitInfo
from rollout.vllm_compat import source_metadata, source_tensors

DEFAULT_GROUP_NAME = "rollout-weights"


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int  # the trainer's rank + every inference rank (/get_world_size)
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = 60.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.info = info
        self.group: GlooGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the gloo trainer engine sends a full copy each round: pass a WeightSource")
        engine = cls(client=client, source=source, info=init_info)
        if not engine.is_sender:
            raise ValueError("the gloo trainer engine has one sender, rank 0; other trainer ranks do not take part")
        i = init_info
        worker = GlooInitInfo(
            master_address=i.master_address, master_port=i.master_port, rank_offset=1, world_size=i.world_size,
            group_name=i.group_name, timeout_s=i.timeout_s, bucket_bytes=i.bucket_bytes,
        )
        # The workers block in init until every rank joined: join as rank 0 meanwhile.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group = GlooGroup(Rendezvous(i.group_name, i.master_address, i.master_port, i.world_size, i.timeout_s), 0)
            joined.result(timeout=i.timeout_s)  # the workers' rendezvous has the same deadline
        return engine

    def send_weights(self) -> None:
        meta = source_metadata(self.source)
        specs = [ParamSpec(m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for m in meta]
        tensors = []
        for (name, tensor), spec in zip(source_tensors(self.source), specs):
            if name != spec.name:
                raise ValueError(f"WeightSource yielded {name!r} where its metadata declared {spec.name!r}")
            tensors.append(tensor.detach())
        update_info = {"names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs], "shapes": [list(s.shape) for s in specs]}
        self.client.start_weight_update()
        # The workers receive inside update_weights: broadcast meanwhile.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, update_info)
            send_buckets(self.group, specs, tensors, self.info.bucket_bytes)
            received.result(timeout=self.info.timeout_s)  # the workers' receive ends by then too
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the RPC may never return
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
