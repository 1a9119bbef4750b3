"""The one place that knows how the vLLM versions the platform supports differ (0.32 and
0.33; the CPU build stops at 0.32). Every difference is found by what the installed
vLLM has (feature detection), never by its version string; :func:`vllm_version` is for
records only.

What differs, 0.32 → 0.33 (read from both wheels' sources), and what is done here:

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
  in both versions; only ``pause_generation`` sets 0.33's rejection).

The same in both (checked, nothing to do): ``AsyncLLM``'s calls the platform makes
(``generate``, weight-transfer and version calls, ``pause_generation`` /
``resume_generation``'s signatures, LoRA, sleep/wake, ``collective_rpc``), the
weight-transfer factory and the engines' worker interface, ``IPCWeightTransferUpdateInfo``,
the packed NCCL producer/consumer signatures, ``nccl_common.trainer_init`` /
``worker_init_payload``, ``WeightTransferConfig``, the OpenAI app builder
(``build_app``, ``init_app_state``). Also new in 0.33 and handled where it lands: vLLM's
NCCL trainer engine sends an ``/update_weights`` without names, dtypes and shapes when they
did not change (the RL routes' sessions reuse the last announced ones,
:mod:`rollout.sync.sessions`).
"""

from __future__ import annotations

import importlib.util
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

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
