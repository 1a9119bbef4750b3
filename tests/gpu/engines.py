"""What the GPU checks compare the platform against, in Ray actors pinned to given GPUs.

* :class:`BareEngine`: a fresh vLLM ``AsyncLLM`` built from the same engine arguments as
  the platform's replicas (``rollout.engine.args.engine_kwargs``): the greedy reference
  (its tokens, or its tokens with each position's top-k logprobs),
  the throughput floor, and (with vLLM's NCCL weight-transfer engine) the target of the
  one-RPC-per-tensor publishing pattern.
* :class:`FloorReceiver`: the far end of a raw NCCL broadcast (vLLM's own
  ``PyNcclCommunicator``), the wire floor a publish is measured against.

Both take no Ray GPU: the tests place them with ``CUDA_VISIBLE_DEVICES`` on the GPU they
need, the replica's own included (Ray leaves the variable alone for zero-GPU actors).

* :class:`GpuHolder`: the opposite, one Ray GPU taken and left idle, so that Serve keeps
  its replicas off the GPU a trainer in the driver publishes from.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import ray


def on_gpus(actor_cls, gpus: str):
    """``actor_cls.options`` placing the actor's CUDA work on ``gpus`` (e.g. ``"0"``, ``"0,1"``)."""
    return actor_cls.options(runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": gpus}})


def stop_actor(actor) -> None:
    """End an engine actor: its engine shut down (its GPU memory freed), then the actor."""
    try:
        ray.get(actor.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - killed next anyway
        pass
    ray.kill(actor)
    time.sleep(3)  # the driver's view of GPU memory lags the kill


@ray.remote(num_cpus=0, num_gpus=0)
class BareEngine:
    async def start(self, model: dict, weight_transfer: Optional[str] = None) -> float:
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.config import ModelConfig
        from rollout.engine.args import engine_kwargs

        t0 = time.perf_counter()
        kwargs = engine_kwargs(ModelConfig.model_validate(model), "cuda")
        if "distributed_executor_backend" in kwargs:
            # The platform's TP replicas run their workers as Ray actors in the replica's
            # placement group; a bare engine outside Serve uses vLLM's own processes.
            kwargs["distributed_executor_backend"] = "mp"
        if weight_transfer:
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        return time.perf_counter() - t0

    async def _run(self, requests: list[Any], lora: Optional[tuple[str, int, str]] = None, top_logprobs: Optional[int] = None) -> list[Any]:
        from vllm.lora.request import LoRARequest

        from rollout.engine.convert import to_sampling_params

        adapter = LoRARequest(*lora) if lora else None

        async def one(i: int, r: Any) -> Any:
            final = None
            params = to_sampling_params(r.sampling, r.n)
            if top_logprobs is not None:
                # The request's own config asks for the sampled token's logprob at most
                # (SamplingConfig.logprobs is a flag); the judgement needs the top k.
                params.logprobs = top_logprobs
            async for out in self.engine.generate({"prompt_token_ids": r.prompt_token_ids}, params, f"bare-{i}-{time.monotonic_ns()}", lora_request=adapter):
                final = out
            completion = final.outputs[0]
            if top_logprobs is None:
                return list(completion.token_ids)
            # Plain dicts for Ray: vLLM's Logprob objects (or its FlatLogprobs) stay here.
            return list(completion.token_ids), [{int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs]

        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))

    async def generate(self, requests: list[Any], lora: Optional[tuple[str, int, str]] = None) -> list[list[int]]:
        """Token ids of each request's first sample, in request order; ``lora``: vLLM's
        ``LoRARequest(name, id, path)`` arguments of an adapter to run them with."""
        return await self._run(requests, lora)

    async def generate_with_logprobs(self, requests: list[Any], top_logprobs: int, lora: Optional[tuple[str, int, str]] = None) -> list[tuple[list[int], list[dict[int, float]]]]:
        """As :meth:`generate`, with each position's ``top_logprobs`` most likely tokens and
        their logprobs (token id -> logprob; the sampled token always among them, as vLLM
        adds it when it is not in the top k): what ``tests.gpu.compare.judge`` takes."""
        return await self._run(requests, lora, top_logprobs)

    async def routed(self, requests: list[Any]) -> list[tuple[list[int], Any]]:
        """Token ids of each request's first sample with the experts vLLM routed its tokens to
        (``CompletionOutput.routed_experts``, a numpy array; None where the engine returned
        none), in request order: the reference of router replay."""

        async def one(i: int, r: Any) -> tuple[list[int], Any]:
            from rollout.engine.convert import to_sampling_params

            final = None
            async for out in self.engine.generate({"prompt_token_ids": r.prompt_token_ids}, to_sampling_params(r.sampling, r.n), f"routed-{i}-{time.monotonic_ns()}"):
                final = out
            completion = final.outputs[0]
            return list(completion.token_ids), completion.routed_experts

        return [await one(i, r) for i, r in enumerate(requests)]

    async def timed(self, requests: list[Any]) -> tuple[int, float]:
        """(generated tokens, seconds) for one concurrent round."""
        t0 = time.perf_counter()
        outs = await self._run(requests)
        return sum(len(o) for o in outs), time.perf_counter() - t0

    async def reload(self, weights_path: str) -> float:
        """vLLM's own checkpoint reload: the reference for published weights."""
        t0 = time.perf_counter()
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        await self.engine.reset_prefix_cache()
        return time.perf_counter() - t0

    # ---- one RPC + one broadcast per tensor (vLLM's NCCL engine, unpacked) ------------

    async def begin_update(self, address: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.engine.pause_generation(mode="keep", clear_cache=True)
        info = dict(master_address=address, master_port=port, rank_offset=1, world_size=world_size, packed=False)
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        await self.engine.start_weight_update()

    async def update_one(self, name: str, dtype: str, shape: list[int]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = dict(names=[name], dtype_names=[dtype], shapes=[shape])
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def finish_update(self, version: str) -> None:
        await self.engine.finish_weight_update(weight_version=version)
        await self.engine.resume_generation()

    def shutdown(self) -> None:
        self.engine.shutdown()


@ray.remote(num_cpus=0, num_gpus=0)
class FloorReceiver:
    def join(self, address: str, port: int) -> None:
        import torch
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        torch.cuda.set_device(0)
        self.group = stateless_init_process_group(address, port, rank=1, world_size=2, device=0)

    def receive(self, nbytes: int, sizes: Optional[list[int]] = None) -> float:
        """One handshake element, then ``nbytes`` as one buffer, or one buffer per size."""
        import torch

        stream = torch.cuda.current_stream()
        self.group.broadcast(torch.empty(1, device="cuda"), src=0, stream=stream)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if sizes is None:
            self.group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), src=0, stream=stream)
        else:
            for n in sizes:
                self.group.broadcast(torch.empty(n, dtype=torch.uint8, device="cuda"), src=0, stream=stream)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


@ray.remote(num_cpus=0, num_gpus=1)
class GpuHolder:
    """Takes one GPU in Ray's accounting and does nothing on it: Serve places no replica
    there, so a trainer in the driver can use it as its own (NCCL takes one rank a GPU)."""

    def uuid(self) -> str:
        """The held GPU's UUID (Ray set ``CUDA_VISIBLE_DEVICES`` to it alone): the driver
        finds its own index for it, whatever order each process numbers GPUs in."""
        import torch

        return str(torch.cuda.get_device_properties(0).uuid)
