"""Publish-to-committed latency, against the wire floor and the per-tensor pattern.

One run, one machine, one model (the ``medium`` preset, ~30M parameters, so transfer
cost matters on CPU):

* ``publish``: ``WeightPublisher.publish`` into real vLLM replicas (1, then 2), from
  the call to the committed version: validation, rendezvous, pause, packed gloo
  broadcast, vLLM's layerwise load, commit, resume.
* ``floor``: a raw gloo broadcast of the same bytes as one flat buffer to the same
  number of receiving processes, over a group formed beforehand. Nothing can beat it.
* ``per_tensor``: what OpenRLHF-style loops do: for every tensor, one RPC to each
  receiver announcing it, then one broadcast of that tensor.

Receivers of ``floor`` and ``per_tensor`` are Ray actors that copy into a state dict,
like a worker's ``load_weights``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import ray
import torch

from rollout.local import cpu_config, local_platform
from rollout.modelbuild import build_model, is_built
from rollout.sync.backends.gloo_group import GlooGroup
from rollout.sync.publisher import _free_port, _own_address
from rollout.sync.wire import ParamSpec

REPEATS = 3


@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self, specs: list[ParamSpec]):
        self.specs = {s.name: s for s in specs}
        self.state = {s.name: torch.empty(s.shape, dtype=s.torch_dtype) for s in specs}
        self.group = None

    def join(self, address: str, port: int, rank: int, world: int) -> None:
        self.group = GlooGroup(address, port, rank, world, 120.0, f"bench-{port}")

    def recv_flat(self, nbytes: int) -> None:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.group.broadcast(buf)

    def recv_one(self, name: str) -> None:
        # One RPC per tensor: the receiver learns what comes next, then receives it.
        self.group.broadcast(self.state[name])


def _form_group(receivers, world: int) -> tuple[GlooGroup, str, int]:
    address, port = _own_address(), _free_port()
    joins = [r.join.remote(address, port, i + 1, world) for i, r in enumerate(receivers)]
    group = GlooGroup(address, port, 0, world, 120.0, f"bench-{port}")
    ray.get(joins)
    return group, address, port


def _floor_and_per_tensor(tensors: dict[str, torch.Tensor], receivers_n: int) -> dict[str, Any]:
    specs = [ParamSpec.of(n, t) for n, t in tensors.items()]
    receivers = [Receiver.remote(specs) for _ in range(receivers_n)]
    group, _, _ = _form_group(receivers, receivers_n + 1)
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])
    floor, per_tensor = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        pending = [r.recv_flat.remote(flat.numel()) for r in receivers]
        group.broadcast(flat)
        ray.get(pending)
        floor.append(time.perf_counter() - t0)
    for _ in range(2):  # slow; two rounds suffice
        t0 = time.perf_counter()
        for name, t in tensors.items():
            pending = [r.recv_one.remote(name) for r in receivers]
            group.broadcast(t.contiguous())
            ray.get(pending)
        per_tensor.append(time.perf_counter() - t0)
    for r in receivers:
        ray.kill(r)
    return {"floor_s": statistics.median(floor), "per_tensor_s": statistics.median(per_tensor), "floor_rounds": floor, "per_tensor_rounds": per_tensor}


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
                # The coordinator's copy receives too: the same number of receivers.
                baseline = _floor_and_per_tensor(tensors, replicas + 1)
                publish_s = statistics.median(rounds)
                points.append(
                    {
                        "replicas": replicas,
                        "receivers": replicas + 1,
                        "publish_s": publish_s,
                        "publish_rounds": rounds,
                        "publish_phases_s": _median_phases(phases),
                        **baseline,
                        "publish_vs_floor": publish_s / baseline["floor_s"],
                        "per_tensor_vs_publish": baseline["per_tensor_s"] / publish_s,
                    }
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
        "targets": "publish_vs_floor <= 1.25; per_tensor_vs_publish several times",
        "points": points,
    }
