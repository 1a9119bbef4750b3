"""Publish-to-committed latency, against the wire floor and the per-tensor pattern.

One run, one machine, one model (the ``medium`` preset, ~30M parameters, so transfer
cost matters on CPU):

* ``publish``: ``WeightPublisher.publish`` into real vLLM replicas (1, then 2), from
  the call to the committed version: validation, rendezvous, pause, packed gloo
  broadcast, vLLM's layerwise load, commit, resume, every replica confirming.
* ``floor``: a raw gloo broadcast of the same bytes as one flat buffer to as many
  receiving processes (the replicas and the coordinator's copy), over a group formed
  beforehand. The receivers keep the bytes and load nothing: nothing can beat it.
* ``per_tensor``: what OpenRLHF-style loops do, into bare vLLM engines (no Serve, no
  coordinator) driven through vLLM's weight-transfer protocol: for every tensor, one
  RPC to each engine (``update_weights`` naming that tensor), then one broadcast of it.
* ``engine_round``: the same bare engines and protocol with our packed buckets, one
  ``update_weights`` per round: what vLLM's own load costs on top of the wire, without
  the platform's coordination.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import ray
import torch

from rollout.local import cpu_config, local_platform
from rollout.modelbuild import build_model, is_built
from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, Rendezvous
from rollout.sync.backends.gloo_stream import send_buckets
from rollout.sync.net import free_port, own_address
from rollout.sync.protocol import ParamSpec

REPEATS = 3


@ray.remote(num_cpus=0)
class Receiver:
    """A floor receiver: joins the group and receives flat buffers."""

    def __init__(self, address: str, port: int, rank: int, world: int):
        self.group = GlooGroup(Rendezvous(f"bench-{port}", address, port, world, 120.0), rank)

    def recv_flat(self, nbytes: int) -> None:
        self.group.broadcast(torch.empty(nbytes, dtype=torch.uint8))


@ray.remote(num_cpus=0)
class DirectEngine:
    """A bare vLLM engine with our gloo weight-transfer engine, driven by the bench."""

    async def start(self, model: dict) -> None:
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.config import ModelConfig
        from rollout.engine.args import engine_kwargs
        from rollout.sync.vllm_plugin import register

        register()
        kwargs = engine_kwargs(ModelConfig.model_validate(model), "cpu")
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, weight_transfer_config=WeightTransferConfig(backend="gloo")))

    async def begin(self, address: str, port: int, rank: int, world: int, bucket_bytes: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.pause_generation(mode="keep", clear_cache=True)
        info = dict(master_address=address, master_port=port, rank_offset=rank, world_size=world, group_name=f"direct-{port}", timeout_s=120.0, bucket_bytes=bucket_bytes)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        await self.engine.start_weight_update()

    async def receive(self, specs: list[ParamSpec]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = dict(names=[s.name for s in specs], dtype_names=[s.dtype for s in specs], shapes=[list(s.shape) for s in specs])
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def end(self) -> None:
        await self.engine.finish_weight_update()
        await self.engine.resume_generation()


def _floor(tensors: dict[str, torch.Tensor], receivers_n: int) -> dict[str, Any]:
    address, port = own_address(), free_port()
    receivers = [Receiver.remote(address, port, i + 1, receivers_n + 1) for i in range(receivers_n)]
    group = GlooGroup(Rendezvous(f"bench-{port}", address, port, receivers_n + 1, 120.0), 0)
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])
    rounds = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        pending = [r.recv_flat.remote(flat.numel()) for r in receivers]
        group.broadcast(flat)
        ray.get(pending)
        rounds.append(time.perf_counter() - t0)
    for r in receivers:
        ray.kill(r)
    return {"floor_s": statistics.median(rounds), "floor_rounds": rounds}


def _direct_rounds(engines: Sequence[Any], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> dict[str, Any]:
    """Rounds into bare engines: packed buckets in one ``update_weights`` vs one per tensor."""
    specs = [ParamSpec.of(n, t) for n, t in tensors.items()]
    values = list(tensors.values())
    address, port, world = own_address(), free_port(), len(engines) + 1
    slot = GroupSlot()

    def one_round(chunks: list[list[int]]) -> float:
        t0 = time.perf_counter()
        begun = [e.begin.remote(address, port, i + 1, world, bucket_bytes) for i, e in enumerate(engines)]
        group = slot.join(Rendezvous(f"direct-{port}", address, port, world, 120.0), 0)
        ray.get(begun)
        for chunk in chunks:  # one RPC per engine per chunk, then the chunk's broadcast
            pending = [e.receive.remote([specs[i] for i in chunk]) for e in engines]
            send_buckets(group, [specs[i] for i in chunk], [values[i] for i in chunk], bucket_bytes)
            ray.get(pending)
        ray.get([e.end.remote() for e in engines])
        return time.perf_counter() - t0

    everything = [list(range(len(specs)))]
    one_round(everything)  # warm-up: forms the group, first load
    bucketed = [one_round(everything) for _ in range(REPEATS)]
    per_tensor = [one_round([[i] for i in range(len(specs))]) for _ in range(2)]  # slow; two suffice
    slot.drop()
    return {
        "engine_round_s": statistics.median(bucketed),
        "engine_round_rounds": bucketed,
        "per_tensor_s": statistics.median(per_tensor),
        "per_tensor_rounds": per_tensor,
    }


def _phases(publisher) -> dict[str, float]:
    """One round's seconds per step: the trainer's (open, send, commit) and each
    replica's (pause, join, start, receive, decision, finish, resume), replicas in a fixed order."""
    out = {f"trainer.{k}": v for k, v in publisher.last_phases.items()}
    for i, (_, steps) in enumerate(sorted(publisher.last_outcome.phases.items())):
        out.update({f"replica{i}.{k}": v for k, v in steps.items()})
    return out


def _median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in rounds[0]}


def run(out_root: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rollout.app import deploy
    from rollout.sync import WeightPublisher

    model_dir = out_root / "model-medium"
    if not is_built(model_dir):
        build_model(model_dir, size="medium")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "bench")
    cfg = cpu_config(model_dir, http={"port": 8766}, deployment={"num_cpus": 0.5})
    points = []
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False)
    try:
        with local_platform(cfg):
            publisher = WeightPublisher.connect(app_name=cfg.app_name)
            for replicas in (1, 2):
                if replicas > 1:
                    deploy(cfg.model_copy(update={"deployment": cfg.deployment.model_copy(update={"replicas": replicas})}))
                publisher.publish(tensors)  # warm-up (first group formation, first load)
                rounds, phases = [], []
                for _ in range(REPEATS):
                    t0 = time.perf_counter()
                    publisher.publish(tensors)
                    rounds.append(time.perf_counter() - t0)
                    phases.append(_phases(publisher))
                points.append({"replicas": replicas, "publish_s": statistics.median(rounds), "publish_rounds": rounds, "publish_phases_s": _median_phases(phases)})
        # The baselines run after the platform is gone, on engines of the same config.
        engines = [DirectEngine.remote() for _ in range(2)]
        ray.get([e.start.remote(cfg.model.model_dump()) for e in engines])
        for point in points:
            n = point["replicas"]
            point.update(_direct_rounds(engines[:n], tensors, cfg.sync.bucket_bytes))
            point.update(receivers=n + 1, **_floor(tensors, n + 1))  # the coordinator's copy receives too
            point.update(
                publish_vs_engine_round=point["publish_s"] / point["engine_round_s"],
                publish_vs_floor=point["publish_s"] / point["floor_s"],
                engine_round_vs_floor=point["engine_round_s"] / point["floor_s"],
                per_tensor_vs_publish=point["per_tensor_s"] / point["publish_s"],
            )
    finally:
        ray.shutdown()
    return {
        "benchmark": "weight_sync",
        "model": str(model_dir),
        "parameters": sum(t.numel() for t in tensors.values()),
        "tensors": len(tensors),
        "bytes": nbytes,
        "bucket_bytes": cfg.sync.bucket_bytes,
        "repeats": REPEATS,
        "targets": "publish_vs_engine_round <= 1.1 (the platform's overhead over vLLM's own round)",
        "target_met": all(p["publish_vs_engine_round"] <= 1.1 for p in points),
        "points": points,
    }
