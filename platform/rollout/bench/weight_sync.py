"""Publish-to-committed latency against vLLM's own round, the wire floor and the
per-tensor pattern.

One run, one machine, one model (the ``medium`` preset, ~30M parameters, so transfer
cost matters on CPU):

* ``publish``: ``WeightPublisher.publish`` into real vLLM replicas (1, then 2), from
  the call to the committed version: validation, rendezvous, pause, packed gloo
  broadcast, vLLM's layerwise load, commit, resume, every replica confirming.
* ``engine_round``: bare vLLM engines (no Serve, no coordinator) driven through vLLM's
  weight-transfer protocol with the same packed buckets, one ``update_weights`` a round,
  as a trainer driving vLLM by hand would: ``pause_generation``, join, start, receive,
  finish, ``resume_generation``. The target is the platform's overhead over this round.
  Publishes and bare rounds take turns (the order rotated every round) with both sets of
  engines up, so drift of the machine hits both; the ratio is paired round by round.
* ``floor``: a raw gloo broadcast of the same bytes as one flat buffer to as many
  receiving processes as replicas (the coordinator's copy is sent after the commit),
  over a group formed beforehand. The receivers keep the bytes and load nothing:
  nothing can beat it.
* ``per_tensor``: what OpenRLHF-style loops do, into the bare engines: for every tensor,
  one RPC to each engine (``update_weights`` naming that tensor), then one broadcast of it.
* ``digests``: what the received-bytes digests (:mod:`rollout.sync.digest`) cost. A publish
  always digests, so the cost is measured on the bare round, which runs the same code the
  publish runs on each side (the sender's :class:`SentDigests` in ``send_buckets``, the
  engine's ``digest_path`` in the update info): without digests, with the sender's only,
  the replicas' only, and both, taking turns with the publish and the plain bare round.
  Each side's cost is its round minus the plain round next to it, as a share of the
  publish of the same turn.
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import ray
import torch

from rollout.bench.machine import machine
from rollout.contracts.net import free_port, own_address
from rollout.contracts.sync_protocol import ParamSpec
from rollout.local import cpu_config, local_platform
from rollout.modelbuild import build_model, is_built
from rollout.stats_summary import median_interval, paired_ratios
from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, Rendezvous
from rollout.sync import digest
from rollout.sync.backends.gloo_stream import SentDigests, send_buckets

REPEATS = 3  # floor rounds
ROUNDS = 15  # rounds of each compared path
DIGEST_SIDES = ("sender", "replica", "both")  # who digests, in the bare rounds that measure it
DIGEST_GOAL = 0.05  # the digests' share of a publish (both sides), at most


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
        from rollout.engine.args import engine_kwargs, prepare_engine_environment
        from rollout.sync.vllm_plugin import register

        register()
        model_config = ModelConfig.model_validate(model)
        kwargs = engine_kwargs(model_config, "cpu")
        prepare_engine_environment("cpu", model_config)  # as a replica's engine starts
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, weight_transfer_config=WeightTransferConfig(backend="gloo")))

    async def begin(self, address: str, port: int, rank: int, world: int, bucket_bytes: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.pause_generation(mode="keep", clear_cache=True)
        info = dict(master_address=address, master_port=port, rank_offset=rank, world_size=world, group_name=f"direct-{port}", timeout_s=120.0, bucket_bytes=bucket_bytes)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        await self.engine.start_weight_update()

    async def receive(self, specs: list[ParamSpec], digest_path: Optional[str] = None) -> Optional[float]:
        """Receive ``specs``; with ``digest_path``, the engine digests what it receives as a
        replica's does, and the seconds it spent digesting are returned."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = dict(names=[s.name for s in specs], dtype_names=[s.dtype for s in specs], shapes=[list(s.shape) for s in specs])
        if digest_path is not None:
            info["digest_path"] = digest_path
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
        if digest_path is None:
            return None
        got = digest.read_received(digest_path)
        if got is None or len(got.digests) != len(specs):
            raise RuntimeError(f"the engine digested {0 if got is None else len(got.digests)} of {len(specs)} tensors")
        return got.seconds

    async def end(self) -> None:
        await self.engine.finish_weight_update()
        await self.engine.resume_generation()


def _model_facts(model_dir, tensors: dict) -> dict:
    """What a result says of the weights it moved."""
    return {
        "model": str(model_dir),
        "parameters": sum(t.numel() for t in tensors.values()),
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


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


class DirectRounds:
    """Rounds into bare engines over one kept group: packed buckets in one
    ``update_weights`` a round (vLLM's own round), or one per tensor."""

    def __init__(self, engines: Sequence[Any], tensors: dict[str, torch.Tensor], bucket_bytes: int):
        self.engines = list(engines)
        self.specs = [ParamSpec.of(n, t) for n, t in tensors.items()]
        self.values = list(tensors.values())
        self.bucket_bytes = bucket_bytes
        self.address, self.port, self.world = own_address(), free_port(), len(self.engines) + 1
        self.slot = GroupSlot()
        self.rounds = 0  # names each round's digest files

    def round(self, chunks: Optional[list[list[int]]] = None, digests: str = "none") -> tuple[float, dict[str, float]]:
        """Seconds of one round, and of its steps (begin: pause, join, start; transfer:
        ``update_weights`` while the buckets go out; end: finish and resume). ``digests``
        (one of :data:`DIGEST_SIDES` or ``"none"``): who digests the bytes, as in a publish;
        the seconds spent inside the digests are added to the steps."""
        if digests not in ("none", *DIGEST_SIDES):
            raise ValueError(f"digests: {digests!r} is not one of none, {', '.join(DIGEST_SIDES)}")
        engines, specs, values = self.engines, self.specs, self.values
        chunks = chunks or [list(range(len(specs)))]
        sent = SentDigests() if digests in ("sender", "both") else None
        self.rounds += 1
        paths = [digest.received_path(f"bench-engine-{i}", f"round-{self.rounds}") if digests in ("replica", "both") else None for i in range(len(engines))]
        t0 = time.perf_counter()
        begun = [e.begin.remote(self.address, self.port, i + 1, self.world, self.bucket_bytes) for i, e in enumerate(engines)]
        group = self.slot.join(Rendezvous(f"direct-{self.port}", self.address, self.port, self.world, 120.0), 0)
        ray.get(begun)
        t_begun = time.perf_counter()
        received: list[Optional[float]] = []
        for chunk in chunks:  # one RPC per engine per chunk, then the chunk's broadcast
            pending = [e.receive.remote([specs[i] for i in chunk], path) for e, path in zip(engines, paths)]
            send_buckets(group, [specs[i] for i in chunk], [values[i] for i in chunk], self.bucket_bytes, digests=sent)
            received = ray.get(pending)
        t_sent = time.perf_counter()
        ray.get([e.end.remote() for e in engines])
        t_end = time.perf_counter()
        steps = {"begin": t_begun - t0, "transfer": t_sent - t_begun, "end": t_end - t_sent}
        if sent is not None:
            steps["sender_digest"] = sent.seconds
        if received and received[0] is not None:
            steps["replica_digest"] = max(received)  # the slowest replica's, as a round waits for it
        return t_end - t0, steps

    def per_tensor(self) -> float:
        return self.round([[i] for i in range(len(self.specs))])[0]

    def close(self) -> None:
        self.slot.drop()


def _interleaved(paths: dict[str, Callable[[], tuple[float, dict[str, float]]]], rounds: int) -> dict[str, list[tuple[float, dict[str, float]]]]:
    """Each path's rounds, the paths taking turns (order rotated every round)."""
    names = list(paths)
    for name in names:
        paths[name]()  # warm-up: first group formation, first load
    out: dict[str, list] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out[name].append(paths[name]())
    return out


def _phases(publisher) -> dict[str, float]:
    """One round's seconds per step: the trainer's (open, send, commit) and each
    replica's (pause, join, start, receive, decision, finish, resume), replicas in a fixed order."""
    out = {f"trainer.{k}": v for k, v in publisher.last_phases.items()}
    for i, (_, steps) in enumerate(sorted(publisher.last_outcome.phases.items())):
        out.update({f"replica{i}.{k}": v for k, v in steps.items()})
    return out


def _median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds if k in r) for k in rounds[0]}


def _digest_costs(measured: dict[str, list[tuple[float, dict[str, float]]]]) -> dict[str, Any]:
    """Per side (sender, replica, both): the bare round with those digests, its cost over
    the plain bare round of the same turn as a share of that turn's publish (median, 90%
    interval), and the seconds spent inside the digests (medians)."""
    publish = [t for t, _ in measured["publish"]]
    plain = [t for t, _ in measured["engine_round"]]
    out: dict[str, Any] = {}
    for side in DIGEST_SIDES:
        rounds = measured[f"engine_round_{side}_digests"]
        with_s = [t for t, _ in rounds]
        shares = [(w - p) / pub for w, p, pub in zip(with_s, plain, publish)]
        inside = {k: statistics.median(steps[k] for _, steps in rounds) for k in ("sender_digest", "replica_digest") if k in rounds[0][1]}
        out[side] = {
            "round_s": statistics.median(with_s),
            "rounds": with_s,
            "vs_engine_round": round(statistics.median(paired_ratios(with_s, plain)), 3),
            "share_of_publish": round(statistics.median(shares), 4),
            "share_of_publish_interval_90": [round(v, 4) for v in median_interval(shares)],
            "inside_digest_s": inside,
        }
    return out


def _digest_goal_met(points: list[dict[str, Any]]) -> Optional[bool]:
    """Whether both sides' digests stay under :data:`DIGEST_GOAL` of a publish: True when
    every point's 90% interval lies under it, False when one lies over it, None when an
    interval spans it (this run does not tell: on a busy machine the rounds spread more
    than the digests cost)."""
    intervals = [p["digests"]["both"]["share_of_publish_interval_90"] for p in points]
    if any(low >= DIGEST_GOAL for low, _ in intervals):
        return False
    return True if all(high < DIGEST_GOAL for _, high in intervals) else None


def _publish_fn(publisher, tensors):
    def fn() -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()
        publisher.publish(tensors)
        t_done = time.perf_counter()
        phases = _phases(publisher)
        # The coordinator's copy goes out after publish() returns; it must not overlap
        # the bare round that may come next (it would slow the baseline).
        publisher.flush()
        phases["copy_after_publish"] = time.perf_counter() - t_done
        return t_done - t0, phases

    return fn


def run(out_root: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from rollout.app import deploy
    from rollout.sync import WeightPublisher

    model_dir = out_root / "model-medium"
    if not is_built(model_dir):
        build_model(model_dir, size="medium")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "bench")
    cfg = cpu_config(model_dir, http={"port": 8766}, deployment={"num_cpus": 0.5})
    points = []
    load_before = os.getloadavg()[0]
    ray.init(num_cpus=8, namespace="rollout-bench", log_to_driver=False)
    try:
        # The bare engines are up beside the platform, idle while it publishes (and the
        # platform idle while they take their round), so both see the same machine.
        engines = [DirectEngine.remote() for _ in range(2)]
        ray.get([e.start.remote(cfg.model.model_dump()) for e in engines])
        with local_platform(cfg):
            publisher = WeightPublisher.connect(app_name=cfg.app_name)
            for replicas in (1, 2):
                if replicas > 1:
                    deploy(cfg.model_copy(update={"deployment": cfg.deployment.model_copy(update={"replicas": replicas})}))
                direct = DirectRounds(engines[:replicas], tensors, cfg.sync.bucket_bytes)
                paths = {"publish": _publish_fn(publisher, tensors), "engine_round": direct.round}
                paths.update({f"engine_round_{side}_digests": partial(direct.round, digests=side) for side in DIGEST_SIDES})
                measured = _interleaved(paths, rounds)
                per_tensor = [direct.per_tensor() for _ in range(2)]  # slow; two suffice
                direct.close()
                publish_s = [t for t, _ in measured["publish"]]
                bare_s = [t for t, _ in measured["engine_round"]]
                ratios = paired_ratios(publish_s, bare_s)
                points.append(
                    {
                        "replicas": replicas,
                        "publish_s": statistics.median(publish_s),
                        "publish_rounds": publish_s,
                        "publish_phases_s": _median_phases([p for _, p in measured["publish"]]),
                        "engine_round_s": statistics.median(bare_s),
                        "engine_round_rounds": bare_s,
                        "engine_round_phases_s": _median_phases([p for _, p in measured["engine_round"]]),
                        "paired_ratios": [round(v, 3) for v in ratios],
                        "publish_vs_engine_round": round(statistics.median(ratios), 3),
                        "publish_vs_engine_round_interval_90": [round(v, 3) for v in median_interval(ratios)],
                        "per_tensor_s": statistics.median(per_tensor),
                        "per_tensor_rounds": per_tensor,
                        "digests": _digest_costs(measured),
                    }
                )
        for e in engines:
            ray.kill(e)
        # The floor runs after the platform is gone: it measures the wire alone.
        for point in points:
            n = point["replicas"]
            point.update(receivers=n, **_floor(tensors, n))  # the coordinator's copy comes after the commit
            point.update(
                publish_vs_floor=point["publish_s"] / point["floor_s"],
                engine_round_vs_floor=point["engine_round_s"] / point["floor_s"],
                per_tensor_vs_publish=point["per_tensor_s"] / point["publish_s"],
            )
    finally:
        ray.shutdown()
    return {
        "benchmark": "weight_sync",
        **_model_facts(model_dir, tensors),
        "bucket_bytes": cfg.sync.bucket_bytes,
        "repeats": rounds,
        "order": "interleaved: a publish and the bare engine rounds (without digests, then with the sender's, the replicas' and both) in turn, the order rotated every round",
        "ratios": "paired: the median of each round's publish / the bare engine round next to it; the interval is a bootstrap 90% interval of that median",
        "machine": machine(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "targets": "publish_vs_engine_round <= 1.1 (the platform's overhead over vLLM's own round)",
        "target_met": all(p["publish_vs_engine_round"] <= 1.1 for p in points),
        "digest_goal": f"the digests (sender and replicas) cost < {DIGEST_GOAL:.0%} of a publish",
        "digest_goal_met": _digest_goal_met(points),
        "points": points,
    }


# ---- deltas: full against delta sends (the gloo_delta backend) -------------------------

DELTA_FRACTIONS = {"delta_1pct": 0.01, "delta_10pct": 0.10}


def changed_weights(tensors: dict[str, torch.Tensor], fraction: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``tensors`` with ``fraction`` of every tensor's elements (at least one) moved: a
    training step that touches few weights (the delta tests use it too)."""
    out = {}
    for name, t in tensors.items():
        new = t.clone()
        flat = new.reshape(-1)
        k = max(1, int(flat.numel() * fraction))
        idx = torch.randperm(flat.numel(), generator=generator)[:k]
        flat[idx] += (torch.rand(k, generator=generator) + 0.5).to(flat.dtype) * 0.01
        out[name] = new
    return out


def _delta_paths(publisher, tensors: dict[str, torch.Tensor]) -> dict[str, Callable[[], tuple[float, dict[str, Any]]]]:
    """Publishes that change the committed weights by 1% (sent in full, and as a delta)
    and by 10% (as a delta); each round's weights are the last commit's, changed."""
    state = {"committed": tensors}
    g = torch.Generator().manual_seed(0)

    def path(fraction: float, as_delta: bool):
        def fn() -> tuple[float, dict[str, Any]]:
            new = changed_weights(state["committed"], fraction, g)
            t0 = time.perf_counter()
            publisher.publish(new, delta=as_delta)
            seconds = time.perf_counter() - t0
            phases = _phases(publisher)
            # The coordinator's copy goes in full after every commit, off the publish's path;
            # it must not overlap the next round.
            publisher.flush()
            phases["copy_after_publish"] = time.perf_counter() - t0 - seconds
            state["committed"] = new
            c = publisher.last_choice
            return seconds, {"mode": c.mode, "bytes_sent": c.bytes_sent, "full_bytes": c.full_bytes, **phases}

        return fn

    return {"full": path(0.01, False), **{name: path(f, True) for name, f in DELTA_FRACTIONS.items()}}


def run_deltas(out_root: Path, rounds: int = ROUNDS, replicas: int = 1) -> dict[str, Any]:
    """Bytes moved and seconds of a publish sent in full against one sent as a delta, at 1%
    and 10% of the elements changed: one platform on ``gloo_delta``, the paths taking
    turns round by round (the order rotated), each delta round paired with the full round
    next to it."""
    from transformers import AutoModelForCausalLM

    from rollout.sync import WeightPublisher

    model_dir = out_root / "model-medium"
    if not is_built(model_dir):
        build_model(model_dir, size="medium")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", "bench")
    cfg = cpu_config(model_dir, http={"port": 8767}, deployment={"num_cpus": 0.5, "replicas": replicas}, sync={"backend": "gloo_delta"})
    # The machine's load over the run (other work on it slows every path alike: the rounds
    # are paired), recorded with the result.
    load = [os.getloadavg()[0]]
    with local_platform(cfg):
        publisher = WeightPublisher.connect(app_name=cfg.app_name)
        try:
            publisher.publish(tensors, delta=False)  # the base every later round changes
            measured = _interleaved(_delta_paths(publisher, tensors), rounds)
        finally:
            publisher.close()
    load.append(os.getloadavg()[0])
    paths = {}
    for name, results in measured.items():
        seconds = [s for s, _ in results]
        paths[name] = {
            "publish_s": statistics.median(seconds),
            "publish_rounds": seconds,
            "modes": sorted({r["mode"] for _, r in results}),
            "bytes_sent": statistics.median(r["bytes_sent"] for _, r in results),
            "phases_s": _median_phases([{k: v for k, v in r.items() if isinstance(v, float)} for _, r in results]),
        }
    full_s = paths["full"]["publish_rounds"]
    for name in DELTA_FRACTIONS:
        ratios = paired_ratios(paths[name]["publish_rounds"], full_s)
        paths[name].update(
            vs_full=round(statistics.median(ratios), 3),
            vs_full_interval_90=[round(v, 3) for v in median_interval(ratios)],
            bytes_vs_full=round(paths[name]["bytes_sent"] / paths["full"]["bytes_sent"], 4),
        )
    return {
        "benchmark": "weight_delta",
        **_model_facts(model_dir, tensors),
        "replicas": replicas,
        "backend": "gloo_delta",
        "repeats": rounds,
        "order": "interleaved: a full publish (1% changed, publish(delta=False)) and delta publishes at 1% and 10% changed in turn, the order rotated every round",
        "bytes_sent": "what the publisher broadcasts to the replicas; after every commit the coordinator's copy gets the full weights too, off the publish's path (copy_after_publish)",
        "ratios": "paired: the median of each round's delta publish / the full publish of the same round; the interval is a bootstrap 90% interval of that median",
        "machine": machine(),
        "load_average_1min": {"start": round(load[0], 2), "end": round(load[1], 2)},
        "paths": paths,
    }
