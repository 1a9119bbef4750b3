"""The one place that knows how the vLLM versions the platform supports differ (0.32 and
0.33; the CPU build stops at 0.32). Every difference is found by what the installed
vLLM has (feature detection), never by its version string; :func:`vllm_version` is for
records only.

What differs, 0.32 → 0.33 (read from both wheels' sources; 0.33's also imported with every
platform module and the engine-free tests run against it, on CPU), and what is done here:

- ``make_arg_parser`` / ``validate_parsed_serve_args`` moved from
  ``vllm.entrypoints.launchers.cli_args`` to ``vllm.entrypoints.common.cli_args``:
  :func:`serve_arg_parsing`.
- ``WeightSource`` (trainer side): 0.32 has ``metadata()`` (a method) and iteration
  (``__iter__``); 0.33 has ``metadata`` (a ``functools.cached_property``, enforced at
  class creation) and ``iter_full()`` / ``iter_local()``, with per-parameter ``owners``.
  :func:`source_metadata` and :func:`source_tensors` read either; :func:`tensors_source`
  makes one over named tensors for either.
- ``AsyncLLM.pause_generation(mode="abort"|"wait")`` in 0.33 also rejects new requests
  with a retryable error (HTTP 503) until resume; 0.32 queued them. The platform's pauses
  (a sync round's, a trainer's hold) keep queuing them in both, as their requests' salts
  assume: :func:`pause_scheduler` pauses at the scheduler (``engine_core.pause_scheduler_async``,
  in both versions; only ``pause_generation`` sets 0.33's rejection). Its "keep" mode,
  which the agent calls directly, rejects nothing in either.
- ``ChatCompletionRequest.skip_special_tokens`` defaults to True in 0.32 and to None in
  0.33 (the server resolves None from the model's default sampling params): an episode
  turn's plan reads it after the tool parser, :func:`skip_special_tokens`.

The same in both (checked, nothing to do): ``AsyncLLM``'s calls the platform makes
(``generate``, weight-transfer and version calls, ``pause_generation`` /
``resume_generation``'s signatures, LoRA, sleep/wake, ``collective_rpc``, ``errored`` /
``dead_error``, ``from_vllm_config``), the weight-transfer factory and the worker-side
engines (``WeightTransferEngine``, ``IPCWeightTransferEngine.receive_weights``,
``IPCWeightTransferUpdateInfo``), the packed NCCL producer/consumer signatures,
``nccl_common.trainer_init`` / ``worker_init_payload`` / ``stateless_init_process_group``,
``WeightTransferConfig``, the layerwise reload (``model_loader/reload``, unchanged), the
checkpoint patches of the delta engines, the OpenAI app builder (``build_app``,
``init_app_state``), ``SamplingParams`` / ``CompletionOutput`` fields the platform reads
(flat logprobs, ``weight_versions``, ``routed_experts``, ``routed_experts_prompt_start``),
every ``EngineArgs`` field the platform sets, the usage context's scheduler defaults, the
stat logger interface and metric names, and the V2-model-runner rule for routed experts
(``VLLM_USE_V2_MODEL_RUNNER``: routed experts need V2 in both, V2 the default where Triton
is). Also new in 0.33 and handled where it lands: vLLM's NCCL trainer engine sends an
``/update_weights`` without names, dtypes and shapes when they did not change (its update
info defaults the three lists), and the RL routes' sessions reuse the last announced ones
(:mod:`rollout.sync.sessions`), so the platform's engines, whose direct path overrides
``receive_weights``, always get them. New in 0.33 with no platform change: the Ray executor
is ``RayExecutorV2`` only (0.32's default too; ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND`` is
gone), an engine-core stack-dump watchdog (off unless ``watchdog_config.dump_dir`` is set),
requests an engine core refuses (a paused ``pause_generation``, a structured-output
validation) end in ``GenerationError`` / ``VLLMValidationError`` from ``generate``, vLLM's
own HTTP error for a dead engine says "The server had an error while processing your
request." (the platform's own death reason still reads ``dead_error``), LoRA refuses a
model without ``SupportsLoRA`` at config time, and ``import vllm`` imports torch's
inductor (seconds on a loaded CPU).
"""

from __future__ import annotations

import importlib.util
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

if TYPE_CHECKING:
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


def vllm_version() -> str:
    """The installed vLLM's version, for records (never to decide behaviour)."""
    import vllm

    return vllm.__version__


# ---- the OpenAI server's argument parsing ---------------------------------------------

_CLI_ARGS = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")  # 0.33, 0.32


def serve_arg_parsing() -> tuple[Callable, Callable]:
    """``(make_arg_parser, validate_parsed_serve_args)`` of ``vllm serve``, wherever the
    installed vLLM keeps them."""
    for name in _CLI_ARGS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package that does not exist
            found = False
        if found:
            module = importlib.import_module(name)
            return module.make_arg_parser, module.validate_parsed_serve_args
    raise ImportError(f"vLLM's serve argument parser is in none of {', '.join(_CLI_ARGS)}: an unsupported vLLM version")


# ---- the trainer's WeightSource -----------------------------------------------------


def source_metadata(source: "WeightSource") -> list["ParamMeta"]:
    """Every parameter ``source`` declares: 0.33's ``metadata`` property or 0.32's method."""
    meta = source.metadata
    return meta() if callable(meta) else meta


def source_tensors(source: "WeightSource") -> Iterator[tuple[str, "torch.Tensor"]]:
    """``source``'s full tensors by name: 0.33's ``iter_full()`` or 0.32's iteration."""
    from vllm.distributed.weight_transfer.base import WeightSource

    if hasattr(WeightSource, "iter_full"):
        return source.iter_full()
    return iter(source)


def tensors_source(tensors: Mapping[str, "torch.Tensor"]) -> "WeightSource":
    """A vLLM ``WeightSource`` over named tensors (what ``ModuleSource`` gives for a
    module), in the installed vLLM's shape."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    def declared(self: Any) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    if hasattr(WeightSource, "iter_full"):  # 0.33: a cached property and iter_full
        members = {"metadata": cached_property(declared), "iter_full": lambda self: iter(self.tensors.items())}
    else:  # 0.32: a method and iteration
        members = {"metadata": declared, "__iter__": lambda self: iter(self.tensors.items())}
    members["__init__"] = lambda self, named: setattr(self, "tensors", dict(named))
    return type("TensorsSource", (WeightSource,), members)(tensors)


# ---- pausing ------------------------------------------------------------------------

_PAUSE_FALLBACK_LOGGED = False


async def pause_scheduler(engine: Any, mode: str, clear_cache: bool = True) -> None:
    """Pause ``engine`` (an ``AsyncLLM``) as ``pause_generation(mode, clear_cache)`` does,
    queuing requests that arrive meanwhile, and without its closing 20 ms sleep.

    That sleep only lets the last outputs of requests the pause ended reach their callers
    before the method returns, which vLLM notes is not needed for correctness; nothing
    here waits on that ordering (vLLM labels tokens with the version they were computed
    under). Queuing: 0.33's ``pause_generation`` rejects new requests in "abort" and
    "wait" modes; the scheduler's pause does not, in either version. An engine without
    those calls gets ``pause_generation`` itself (logged once).
    """
    import logging

    core, renderer = getattr(engine, "engine_core", None), getattr(engine, "renderer", None)
    if not hasattr(core, "pause_scheduler_async") or not hasattr(renderer, "clear_mm_cache_async"):
        global _PAUSE_FALLBACK_LOGGED
        if not _PAUSE_FALLBACK_LOGGED:
            logging.getLogger(__name__).info(
                "the engine has no engine_core.pause_scheduler_async: pausing through pause_generation (20 ms more each; vLLM 0.33 then rejects requests sent meanwhile)"
            )
            _PAUSE_FALLBACK_LOGGED = True
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:  # as pause_generation does
        await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


# ---- a chat request's defaults ------------------------------------------------------


def skip_special_tokens(value: Optional[bool]) -> bool:
    """Whether a turn skips special tokens in its text, given ``ChatCompletionRequest``'s
    ``skip_special_tokens`` as a tool parser's ``adjust_request`` left it (``hermes`` sets
    False where tools may be called). 0.32's request defaults it to True; 0.33's leaves it
    None unless the request or the parser set it, and its chat server then takes the
    model's default sampling params' value, True where they name none
    (``to_sampling_params``). The platform's turns take no sampling defaults from the
    model's generation config, so None is True here, as 0.32's default was; a None handed
    on to ``SamplingParams`` would read as False (special tokens kept in the text)."""
    return True if value is None else bool(value)
