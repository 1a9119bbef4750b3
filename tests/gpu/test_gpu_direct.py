"""The ``nccl`` backend's receiving engine against vLLM's own, on the same bytes: a trainer
on GPU 0 broadcasts the 1.5B model (vLLM's ``trainer_init`` + packed producer, the bytes
and buckets our ``NcclSender`` sends) over a kept NCCL group into a bare ``AsyncLLM`` on
GPU 1, first one with vLLM's "nccl" engine, then one with ours ("rollout-nccl-direct",
the copy plan into the live parameters). Two engines do not fit one GPU beside the
compile and graph memory, so they take turns: each its own several rounds.

Recorded: each round's receive (the engine's ``update_weights`` call) and publish (the
trainer's whole round: pause, start, receive, finish, resume), per engine. Asserted (vLLM's
per-parameter checksums, ~seconds each for 3 GB, so taken only where they decide): after
a round publishing the original weights each engine is back on the start's checksums;
after the last (perturbed) round the engines' weights are identical and not the start's,
and their greedy tokens equal; our rounds took the direct path and are faster than vLLM's.

Skipped without two CUDA GPUs or the built model (``tests/gpu/check.sh models``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from tests.gpu.engines import stop_actor
from tests.gpu.machine import MODEL, needs_gpus

pytestmark = needs_gpus(2)
ROUNDS = 5  # per engine: perturbed, original, ..., perturbed (odd: the last is perturbed)
PROMPTS = [[5, 17, 42, 99, 3], [100, 200, 300], [7] * 40, list(range(10, 74))]
VLLM_ENGINE = "nccl"


def _engine_state(worker: Any) -> dict:
    """Runs in vLLM's worker (collective_rpc): which engine it has and the path it took."""
    engine = worker.weight_transfer_engine
    return {"engine": type(engine).__name__, "last_path": getattr(engine, "last_path", None)}


def _replica_cls():
    import ray

    @ray.remote(num_cpus=0, num_gpus=0)
    class Replica:
        """A bare AsyncLLM with a given weight-transfer engine, driven like a replica."""

        async def start(self, model: dict, engine: str) -> float:
            from vllm.config import WeightTransferConfig
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            from rollout.config import ModelConfig
            from rollout.engine.args import engine_kwargs
            from rollout.sync.vllm_plugin import register

            register()  # this process resolves the engine name too (as the replica does)
            t0 = time.perf_counter()
            kwargs = engine_kwargs(ModelConfig.model_validate(model), "cuda")
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=engine)
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            return time.perf_counter() - t0

        async def join(self, address: str, port: int, bucket_bytes: int) -> None:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            info = dict(master_address=address, master_port=port, rank_offset=1, world_size=2, packed=True, packed_buffer_size_bytes=bucket_bytes, packed_num_buffers=2)
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

        async def update(self, info: dict, version: str) -> dict:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            t0 = time.perf_counter()
            await self.engine.pause_generation(mode="keep", clear_cache=True)
            await self.engine.start_weight_update()
            t1 = time.perf_counter()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            t2 = time.perf_counter()
            await self.engine.finish_weight_update(weight_version=version)
            await self.engine.resume_generation()
            return {"receive_s": t2 - t1, "replica_round_s": time.perf_counter() - t0}

        async def checksums(self) -> dict:
            merged: dict = {}
            for worker in await self.engine.compute_weight_checksums():
                merged.update(worker)
            return merged

        async def state(self) -> list[dict]:
            return await self.engine.collective_rpc(_engine_state)

        async def greedy(self, prompts: list[list[int]]) -> list[list[int]]:
            from vllm import SamplingParams

            out = []
            for i, p in enumerate(prompts):
                final = None
                async for o in self.engine.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=16), f"greedy-{i}-{time.monotonic_ns()}"):
                    final = o
                out.append(list(final.outputs[0].token_ids))
            return out

        def shutdown(self) -> None:
            self.engine.shutdown()

    return Replica


@pytest.fixture(scope="module")
def ray_up():
    import sys

    import ray
    from ray import cloudpickle

    started = not ray.is_initialized()
    if started:
        ray.init(namespace="rollout-gpu-direct", log_to_driver=False)
    # Workers cannot import the tests package: ship this module's code by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    if started:
        ray.shutdown()


def _model_cfg() -> dict:
    # test_gpu_platform's engine settings: vLLM's compile cache from its checks serves these.
    return {"path": str(MODEL), "dtype": "bfloat16", "device": "cuda", "max_model_len": 2048, "max_num_seqs": 256, "gpu_memory_utilization": 0.35, "seed": 0}


def _run_engine(engine: str, weight_sets: list[dict[str, torch.Tensor]], bucket_bytes: int) -> dict:
    """Start a bare engine with ``engine`` on GPU 1, publish ``ROUNDS`` rounds from GPU 0
    over one kept group (weight sets in turn), and report what each round took."""
    import ray
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    from rollout.contracts.net import free_port, own_address

    replica = _replica_cls().options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}}).remote()
    group = None
    try:
        start_s = ray.get(replica.start.remote(_model_cfg(), engine), timeout=600)
        before = ray.get(replica.checksums.remote(), timeout=300)
        address, port = own_address(), free_port()
        joined = replica.join.remote(address, port, bucket_bytes)
        with torch.cuda.device(0):
            group = trainer_init({"master_address": address, "master_port": port, "world_size": 2})
        ray.get(joined, timeout=120)
        rounds, sums, states = [], {}, []
        for r in range(ROUNDS):
            tensors = weight_sets[r % len(weight_sets)]
            info = dict(names=list(tensors), dtype_names=[str(t.dtype).removeprefix("torch.") for t in tensors.values()], shapes=[list(t.shape) for t in tensors.values()])
            with torch.cuda.device(0):
                t0 = time.perf_counter()
                pending = replica.update.remote(info, str(r + 1))
                packed_nccl_broadcast_producer(iterator=iter(tensors.items()), group=group, src=0, post_iter_func=lambda item: item[1], buffer_size_bytes=bucket_bytes, num_buffers=2)
                torch.cuda.synchronize()
                replica_s = ray.get(pending, timeout=120)
                rounds.append({"publish_s": round(time.perf_counter() - t0, 4), **{k: round(v, 4) for k, v in replica_s.items()}})
            if r >= ROUNDS - 2:  # the last original round and the last (perturbed) one
                sums[r] = ray.get(replica.checksums.remote(), timeout=300)
            states.append(ray.get(replica.state.remote(), timeout=60))
        greedy = ray.get(replica.greedy.remote(PROMPTS), timeout=300)
        return {"start_s": round(start_s, 1), "before": before, "rounds": rounds, "checksums": sums, "states": states, "greedy": greedy}
    finally:
        if group is not None:
            group.destroy()
        stop_actor(replica)


def test_our_direct_nccl_engine_receives_the_same_weights_faster_than_vllms(ray_up, record):
    from safetensors.torch import load_file

    from rollout.contracts.sync_protocol import DEFAULT_BUCKET_BYTES

    if not (MODEL / "model.safetensors").exists():
        pytest.skip(f"no model at {MODEL}: run tests/gpu/check.sh models")
    original = {n: t.to("cuda:0") for n, t in load_file(str(MODEL / "model.safetensors")).items()}
    g = torch.Generator(device="cuda:0").manual_seed(1)
    perturbed = {n: (t.float() + 0.01 * torch.randn(t.shape, generator=g, device="cuda:0")).to(t.dtype) for n, t in original.items()}
    nbytes = sum(t.numel() * t.element_size() for t in original.values())
    record(bytes=nbytes, tensors=len(original), rounds_per_engine=ROUNDS, bucket_bytes=DEFAULT_BUCKET_BYTES)

    # Rounds alternate perturbed (versions 1, 3, 5) / original (2, 4).
    sets = [perturbed, original]
    theirs = _run_engine(VLLM_ENGINE, sets, DEFAULT_BUCKET_BYTES)
    ours = _run_engine("rollout-nccl-direct", sets, DEFAULT_BUCKET_BYTES)

    steady = slice(1, None)  # the first round of each also warms the receive path
    summary = {}
    for label, run in (("vllm", theirs), ("direct", ours)):
        summary[label] = {
            "start_s": run["start_s"],
            "rounds": run["rounds"],
            "publish_s_median": round(statistics.median(r["publish_s"] for r in run["rounds"][steady]), 4),
            "receive_s_median": round(statistics.median(r["receive_s"] for r in run["rounds"][steady]), 4),
            "paths": [s[0]["last_path"] for s in run["states"]],
        }
    record(**summary, speedup_publish=round(summary["vllm"]["publish_s_median"] / summary["direct"]["publish_s_median"], 2))

    assert ours["states"][0][0]["engine"] == "DirectNcclWeightTransferEngine"
    assert theirs["states"][0][0]["engine"] == "NCCLWeightTransferEngine"
    assert summary["direct"]["paths"] == ["direct"] * ROUNDS, "our engine fell back to vLLM's path (see the replica's log for the reason)"
    assert ours["before"] == theirs["before"], "the two engines started from different weights"
    last_original, last = ROUNDS - 2, ROUNDS - 1
    for run in (ours, theirs):
        assert run["checksums"][last_original] == run["before"], "a round publishing the original weights did not restore them"
        assert run["checksums"][last] != run["before"], "the perturbed round left the weights as they were"
    assert ours["checksums"][last] == theirs["checksums"][last], "the engines hold different weights after the same round"
    assert ours["greedy"] == theirs["greedy"]
    assert summary["direct"]["publish_s_median"] < summary["vllm"]["publish_s_median"]
