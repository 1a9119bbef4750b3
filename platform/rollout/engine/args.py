"""vLLM engine arguments and Serve placement from :class:`rollout.config.ModelConfig`."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from rollout.config import SLEEP_ON_CPU, ModelConfig
from rollout.engine.memory import EngineStartError, memory_kwargs

logger = logging.getLogger(__name__)


def resolve_device(model: ModelConfig) -> Literal["cpu", "cuda"]:
    """``auto`` means GPUs when the Ray cluster has any (decided where the app is built)."""
    if model.device != "auto":
        return model.device
    import ray

    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
        return "cuda"
    return "cpu"


# vLLM 0.32.0 on CPU compiles the model in its "trace once" mode, whose AOT artifact it
# saves but cannot load again ("'function' object has no attribute 'finalize_loading'",
# logged as "Compiling model again due to a load failure"): every engine start compiled
# afresh (~6 s of CPU on the 2-core CI machine, 30% of a replica's start). Without AOT,
# vLLM's own compile cache serves a restart of the same model and config (measured: the
# engine's init 5.9 s -> 2.9 s; the same compiled code). A value the operator set wins.
CPU_ENGINE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


# vLLM's CPU worker binds its OpenMP threads by default (VLLM_CPU_OMP_THREADS_BIND "auto":
# OMP_PLACES, OMP_PROC_BIND, one thread per core of the first NUMA node but one). Eager,
# with the KV cache sized explicitly (as the platform always sizes it on CPU), the worker
# skips its warm-up forward (cpu_worker._should_warm_up_model), so the first request runs
# the first forward; bound that way it died of SIGILL there (issue 40: exit code -4 on a
# single 3-token request, bare `vllm serve --enforce-eager` likewise; a batch of 128 first
# did not). Unbound ("nobind": vLLM leaves OpenMP as the process has it) is what every eager
# engine of the test suite runs (tests/conftest.py), and they serve.
EAGER_CPU_BIND = ("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def cpu_engine_env(model: ModelConfig) -> dict[str, str]:
    """The environment vLLM's engine processes need on CPU for ``model``."""
    env = dict(CPU_ENGINE_ENV)
    if model.enforce_eager:
        env[EAGER_CPU_BIND[0]] = EAGER_CPU_BIND[1]
    return env


def prepare_engine_environment(device: str, model: ModelConfig) -> None:
    """Set what vLLM's engine processes (which inherit this process's environment) need on
    ``device``, where the operator has not set it already. Raises
    :class:`rollout.engine.memory.EngineStartError` for a setting that kills the engine."""
    from rollout.engine.lifetime import fault_dir
    from rollout.engine.memory import EngineStartError

    fault_dir()  # where the engine's processes log a fatal signal (rollout.engine.lifetime)
    check_device_features(model, device)
    if device != "cpu":
        if model.return_routed_experts:
            _use_v2_model_runner()
        return
    key, unbound = EAGER_CPU_BIND
    if model.enforce_eager and os.environ.get(key) == "auto":
        raise EngineStartError(
            f"model.enforce_eager: true on CPU with {key}={os.environ[key]!r}: vLLM's CPU worker, its OpenMP threads bound so, died of SIGILL on its "
            f"first request (issue 40); unset {key} (the platform then runs the eager engine unbound) or set model.enforce_eager: false",
            "model.enforce_eager",
        )
    for key, value in cpu_engine_env(model).items():
        if key not in os.environ:
            os.environ[key] = value
            logger.info("%s=%s for vLLM's engine on CPU", key, value)


# vLLM returns routed experts only from its V2 model runner (config/vllm.py,
# _verify_aux_output_compatibility; 0.32 and 0.33 alike). V2 is its default where Triton is
# installed, but an operator's VLLM_USE_V2_MODEL_RUNNER=0 (or a Triton-less image) would choose V1.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _use_v2_model_runner() -> None:
    from rollout.engine.memory import EngineStartError

    value = os.environ.get(V2_RUNNER_ENV)
    if value is None:
        os.environ[V2_RUNNER_ENV] = "1"
        logger.info("%s=1 for vLLM's engine: model.return_routed_experts needs its V2 model runner", V2_RUNNER_ENV)
    elif value.strip().lower() in ("0", "false", "no", "off"):
        raise EngineStartError(
            f"model.return_routed_experts: vLLM returns routed experts only from its V2 model runner, and {V2_RUNNER_ENV}={value!r} turns it off; "
            f"unset it (the platform then sets 1) or set model.return_routed_experts: false",
            "model.return_routed_experts",
        )


def check_device_features(model: ModelConfig, device: str) -> None:
    """Refuse, naming the field, what ``device`` cannot run: the config's own check sees
    only ``model.device: cpu``, this also ``auto`` resolved to CPU."""
    from rollout.config import CPU_NO_FP8, CPU_NO_ROUTED_EXPERTS
    from rollout.engine.memory import EngineStartError

    if device != "cpu":
        return
    if model.return_routed_experts:
        raise EngineStartError(f"model.return_routed_experts: {CPU_NO_ROUTED_EXPERTS}", "model.return_routed_experts")
    if model.quantization is not None:
        raise EngineStartError(f"model.quantization: {model.quantization!r} {CPU_NO_FP8}", "model.quantization")


def engine_kwargs(model: ModelConfig, device: str) -> dict[str, Any]:
    """Keyword arguments for ``vllm.AsyncEngineArgs``. Raises
    :class:`rollout.engine.memory.EngineStartError` for a memory size that cannot fit."""
    kw: dict[str, Any] = dict(
        model=model.path,
        tokenizer=model.tokenizer_path,
        served_model_name=model.name,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        tensor_parallel_size=model.tensor_parallel_size,
        max_num_seqs=model.max_num_seqs,
        enable_prefix_caching=model.enable_prefix_caching,
        seed=model.seed,
        enforce_eager=model.enforce_eager,
        # Scheduler stats feed health checks, stats() and metrics.
        disable_log_stats=False,
    )
    check_device_features(model, device)
    if model.return_routed_experts:
        # vLLM's AuxOutput connector captures each MoE layer's top-k ids (router replay).
        kw["enable_return_routed_experts"] = True
    if model.quantization is not None:
        # Online quantization: vLLM loads the full-precision weights and quantizes them; every
        # publish goes through its layerwise reload, which quantizes again (process_weights_after_loading).
        kw["quantization"] = model.vllm_quantization
    if model.lora.enabled:
        # Published adapters (rollout.sync.adapters) load into every engine through vLLM's LoRA support.
        kw.update(enable_lora=True, max_loras=model.lora.max_loras, max_lora_rank=model.lora.max_lora_rank, max_cpu_loras=model.lora.max_cpu_loras)
    if model.enable_sleep_mode:
        if device != "cuda":
            # device "auto" resolved to CPU (the model's own check sees only an explicit "cpu").
            raise EngineStartError(f"model.enable_sleep_mode: true, but the replicas run on {device}: {SLEEP_ON_CPU}", "model.enable_sleep_mode")
        # vLLM's sleep mode (/sleep, /wake_up): it allocates weights and KV cache through its cumem allocator.
        kw["enable_sleep_mode"] = True
    # On CPU this reads the node's free memory: call it where the engine runs.
    kw.update(memory_kwargs(model, device))
    if device == "cuda" and model.tensor_parallel_size > 1:
        # Workers go into the replica's placement group (see placement()).
        kw["distributed_executor_backend"] = "ray"
    return kw


# The usage context vLLM picks its scheduler defaults by (EngineArgs.get_batch_defaults):
# `vllm serve`'s. AsyncLLM's own default, ENGINE_CONTEXT, has no entry in vLLM's tables and
# falls back to SchedulerConfig's 2048 batched tokens, where `vllm serve` takes 8192 on an
# H100/H200 (16384 from 160 GB): issue 41 measured the replica's engine on an H200 with a
# quarter of `vllm serve`'s prefill budget, and, since max_num_batched_tokens is one of the
# factors of vLLM's compile-cache key, compiling afresh where `vllm serve` had compiled.
USAGE_CONTEXT = "OPENAI_API_SERVER"


def engine_config(kwargs: dict[str, Any]) -> Any:
    """The ``VllmConfig`` of an engine built from ``kwargs`` (:func:`engine_kwargs`, plus
    the weight-transfer config), as ``vllm serve`` builds its engine's config from the same
    arguments: vLLM's own defaults fill what the platform leaves unset."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    return AsyncEngineArgs(**kwargs).create_engine_config(usage_context=UsageContext[USAGE_CONTEXT])


def placement(model: ModelConfig, device: str, num_cpus: float) -> dict[str, Any]:
    """Serve deployment options reserving the replica's resources."""
    if device != "cuda":
        return {"ray_actor_options": {"num_cpus": num_cpus}}
    tp = model.tensor_parallel_size
    if tp == 1:
        return {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": 1}}
    # One bundle for the replica actor, one GPU bundle per tensor-parallel worker,
    # packed on one node so NCCL runs over NVLink.
    return {
        "ray_actor_options": {"num_cpus": num_cpus},
        "placement_group_bundles": [{"CPU": num_cpus}] + [{"GPU": 1, "CPU": 1}] * tp,
        "placement_group_strategy": "STRICT_PACK",
    }
