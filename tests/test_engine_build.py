"""The replica's engine as `vllm serve` builds it (issue 41), on CPU, through vLLM's own code:
the same ``VllmConfig`` from the same arguments (scheduler defaults included, on this
machine and as vLLM picks them on an H200), and the same compile-cache key, whatever the
platform sets in the engine's environment for any weight-sync backend.

`vllm serve`'s side is vLLM's: its argument parser over the replica's `vllm serve` command
line (rollout.engine.openai_app.serve_argv, the line its OpenAI app is built with), then
``AsyncEngineArgs.from_cli_args`` and ``create_engine_config`` with the usage context
``vllm serve`` passes (vllm/entrypoints/cli/serve.py).
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from tests.engines import TEST_MODEL

# An H200 as vLLM's platform reports it (EngineArgs.get_batch_defaults reads these two).
H200_MEMORY_BYTES = 150_754_820_096
H200_NAME = "NVIDIA H200"


def model_config(model_dir, **overrides):
    from rollout.local import cpu_config

    return cpu_config(model_dir, model={**TEST_MODEL, "enforce_eager": False, **overrides})


def vllm_serve_config(cfg, kwargs: dict[str, Any]):
    """What `vllm serve` builds from the replica's command line."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rollout.engine.openai_app import parse_serve_args, serve_argv

    args = parse_serve_args(serve_argv(cfg.model, cfg.openai, kwargs))
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def differing(a, b) -> list[str]:
    """The ``VllmConfig`` fields that differ (``instance_id`` is random per config)."""
    return [f.name for f in dataclasses.fields(a) if f.name != "instance_id" and getattr(a, f.name) != getattr(b, f.name)]


@contextmanager
def batch_defaults_as_on_an_h200() -> Iterator[None]:
    """vLLM's batch defaults picked as on an H200 (its table for >= 70 GB non-A100 GPUs),
    everything else as on this CPU: only get_batch_defaults sees the GPU."""
    from unittest import mock

    from vllm.engine import arg_utils

    platform = arg_utils.current_platform
    original = arg_utils.EngineArgs.get_batch_defaults.__func__

    def on_h200(cls, world_size):
        with mock.patch.object(platform, "is_cpu", lambda: False), mock.patch.object(platform, "is_tpu", lambda: False), mock.patch.object(
            platform, "get_device_total_memory", lambda *a, **k: H200_MEMORY_BYTES
        ), mock.patch.object(platform, "get_device_name", lambda *a, **k: H200_NAME):
            return original(cls, world_size)

    with mock.patch.object(arg_utils.EngineArgs, "get_batch_defaults", classmethod(on_h200)):
        yield


def test_the_replicas_engine_config_is_the_one_vllm_serve_builds_from_the_same_arguments(model_dir):
    from rollout.engine.args import engine_config, engine_kwargs

    cfg = model_config(model_dir)
    kwargs = engine_kwargs(cfg.model, "cpu")
    ours, serve = engine_config(dict(kwargs)), vllm_serve_config(cfg, kwargs)
    assert differing(ours, serve) == []
    assert ours.compute_hash() == serve.compute_hash()


def test_on_an_h200_the_replica_takes_vllm_serves_scheduler_defaults_not_the_engine_contexts(model_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rollout.engine.args import engine_config, engine_kwargs

    cfg = model_config(model_dir)
    kwargs = engine_kwargs(cfg.model, "cpu")
    with batch_defaults_as_on_an_h200():
        ours, serve = engine_config(dict(kwargs)), vllm_serve_config(cfg, kwargs)
        # What AsyncLLM.from_engine_args builds (its default usage context): issue 41's replica.
        engine_context = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
    assert differing(ours, serve) == []
    assert ours.compute_hash() == serve.compute_hash()
    # The check can tell: the engine context's budget is another, and so is its compile key.
    assert engine_context.scheduler_config.max_num_batched_tokens != serve.scheduler_config.max_num_batched_tokens
    assert engine_context.compute_hash() != serve.compute_hash()
    print(f"max_num_batched_tokens as on an H200: vllm serve and the replica {serve.scheduler_config.max_num_batched_tokens}, engine context {engine_context.scheduler_config.max_num_batched_tokens}")


# ---- the compile-cache key -------------------------------------------------------------


def compile_cache_key(vllm_config) -> tuple[str, str]:
    """The two factors of vLLM's compile-cache key that the platform could change
    (vllm/compilation/backends.py, VllmBackend.__call__): the environment's
    (``envs.compile_factors``) and the config's (``VllmConfig.compute_hash``). The other two,
    the traced code's and the compiler's, follow from the same code and config."""
    from vllm import envs
    from vllm.config.utils import hash_factors

    envs.disable_envs_cache()  # an engine run in this process may have frozen them
    return hash_factors(envs.compile_factors()), vllm_config.compute_hash()


@contextmanager
def restored_environment() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def backends() -> list:
    from rollout.contracts.backend_registry import backend_names

    return [None, *backend_names()]


@pytest.mark.parametrize("backend", backends())
def test_a_gpu_replica_compiles_under_the_key_of_a_bare_engine_with_the_same_arguments(model_dir, backend):
    """Everything the platform sets where a replica's engine starts on a GPU (the engine's
    environment and the weight-transfer backend's) leaves vLLM's compile-cache key as a bare
    engine has it: a replica finds what `vllm serve` compiled, and the other way round."""
    from rollout.engine.adapter import _prepare_weight_transfer
    from rollout.engine.args import engine_config, engine_kwargs, prepare_engine_environment

    cfg = model_config(model_dir)
    kwargs = engine_kwargs(cfg.model, "cpu")  # the arguments are the same on both sides; the device is not a factor here
    with restored_environment():
        for key in [k for k in os.environ if k.startswith("VLLM_")]:
            del os.environ[key]  # a bare engine: vLLM's defaults
        bare = compile_cache_key(vllm_serve_config(cfg, kwargs))
        prepare_engine_environment("cuda", cfg.model)
        ours_kwargs = dict(kwargs)
        if backend is not None:
            ours_kwargs["weight_transfer_config"] = _prepare_weight_transfer(backend)
        set_by_us = sorted(k for k in os.environ if k.startswith("VLLM_"))
        replica = compile_cache_key(engine_config(ours_kwargs))
    assert replica == bare, f"backend {backend}: the replica's engine compiles under another key than a bare one; vLLM variables it set: {set_by_us}"


def test_on_cpu_the_only_compile_key_difference_is_the_documented_aot_switch(model_dir):
    """On CPU the platform turns vLLM's AOT compile off (rollout.engine.args.CPU_ENGINE_ENV:
    vLLM 0.32 cannot load the artifact it saves), which is a factor of the key: that switch
    (and what vLLM derives from it) and nothing else differs from a bare CPU engine
    (docs/configuration.md says so)."""
    from vllm import envs

    from rollout.engine.args import CPU_ENGINE_ENV, prepare_engine_environment

    cfg = model_config(model_dir)
    with restored_environment():
        for key in [k for k in os.environ if k.startswith("VLLM_")]:
            del os.environ[key]
        envs.disable_envs_cache()
        bare = envs.compile_factors()
        prepare_engine_environment("cpu", cfg.model)
        ours = envs.compile_factors()
        for key in [k for k in os.environ if k.startswith("VLLM_")]:
            del os.environ[key]
        os.environ.update(CPU_ENGINE_ENV)
        bare_without_aot = envs.compile_factors()
    assert ours != bare and ours == bare_without_aot


# ---- the replica's start, phase by phase ------------------------------------------------


def test_a_replicas_start_is_timed_phase_by_phase_logged_and_observed(caplog):
    import logging
    import time

    from rollout.engine.startup import PHASES, StartPhases, process_age_s

    age = process_age_s()
    assert age is not None and 0 < age < time.monotonic() + 1  # this process's age, from /proc
    now = [100.0]
    phases = StartPhases("r1", clock=lambda: now[0])
    assert 0 < phases.durations["process"] <= age + 5
    with caplog.at_level(logging.INFO, logger="rollout.engine.startup"):
        with phases.phase("setup"):
            now[0] += 0.5
        with phases.phase("engine"):
            now[0] += 42.0
        with pytest.raises(RuntimeError):
            with phases.phase("tools"):
                now[0] += 1.0
                raise RuntimeError("a start that fails says so in its error, not with a duration")
    assert list(phases.durations) == ["process", "setup", "engine"]
    assert phases.durations["setup"] == 0.5 and phases.durations["engine"] == 42.0
    assert "replica r1 start: engine took 42.00s" in caplog.text
    assert phases.summary().startswith(f"started in {phases.durations['process'] + 43.5:.1f}s (process ")
    assert "setup 0.5s, engine 42.0s)" in phases.summary()
    with pytest.raises(ValueError, match="not one of"):
        phases.record("nap", 1.0)
    observed = []
    phases.observe(type("Metrics", (), {"start_phase": lambda self, name, s: observed.append((name, s))})())
    assert [name for name, _ in observed] == [p for p in PHASES if p in phases.durations]
