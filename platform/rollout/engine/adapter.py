"""The replica's vLLM engine (``AsyncLLM``), behind what the replica asks of it: start it,
turn a request into its prompt ids, generate one request's samples or stream them, label
the served version as the engine labels it, and say whether it is alive.

Only this module (with :mod:`rollout.engine.convert`, which translates the types) talks to
the ``AsyncLLM``: the replica composes it with admission, the sync gate and episodes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

from rollout.api import RolloutRequest, Sample
from rollout.config import PlatformConfig
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.validation import ModelLimits
from rollout.episodes import render_initial
from rollout.errors import EngineUnavailableError, InvalidRequestError
from rollout.sync.adapters import ServedAdapter
from rollout.sync.version import INITIAL_VERSION_LABEL
from rollout.tools.calling import TurnPlan


@dataclass(frozen=True)
class EpisodeTurnSampling:
    """What sampling an episode's turn adds to its request: the tool-call constraint (none
    when the turn may not call tools), and no reward per turn (the episode is scored when
    it ends)."""

    plan: Optional[TurnPlan]


@dataclass(frozen=True)
class Generated:
    """One request's samples as the engine returned them (in sample order, not scored),
    with what the request cost, for the replica's metrics."""

    samples: list[Sample]
    prompt_tokens: int
    generated_tokens: int
    started: float  # time.monotonic() when the request was handed to the engine


class EngineAdapter:
    """One ``AsyncLLM`` with the tokenizer and the limits of the model it serves."""

    def __init__(self, engine: Any, tokenizer: Any, limits: ModelLimits, snapshot: SchedulerSnapshot, serve_argv: Sequence[str] = ()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.snapshot = snapshot  # fed by the engine's stat logger (rollout.engine.stats)
        self.serve_argv = list(serve_argv)  # `vllm serve`'s arguments for this engine, for its OpenAI app

    @classmethod
    def start(cls, config: PlatformConfig, device: str, sync_backend: Optional[str], snapshot: SchedulerSnapshot, stat_loggers: list[Any]) -> EngineAdapter:
        """Build the engine for ``config.model`` on ``device``; with ``sync_backend`` (weight
        sync on), able to receive weights through that backend."""
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.engine.args import engine_kwargs, prepare_engine_environment
        from rollout.engine.openai_app import serve_argv
        from rollout.engine.stats import stat_logger_factory

        # Once: on CPU it sizes the KV cache from the memory free now (before the engine takes it).
        kwargs = engine_kwargs(config.model, device)
        prepare_engine_environment(device)
        argv = serve_argv(config.model, config.openai, kwargs)
        if sync_backend is not None:
            kwargs["weight_transfer_config"] = _prepare_weight_transfer(sync_backend)
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[stat_logger_factory(snapshot), *stat_loggers])
        mc = engine.model_config
        limits = ModelLimits(vocab_size=mc.get_vocab_size(), max_model_len=mc.max_model_len, max_n=config.limits.max_n)
        return cls(engine, AutoTokenizer.from_pretrained(config.model.tokenizer_path), limits, snapshot, argv)

    # ---- requests ---------------------------------------------------------------

    def prompt_ids(self, req: RolloutRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.prompt is not None:
            return list(self.tokenizer.encode(req.prompt))
        return render_initial(self.tokenizer, [m.model_dump() for m in req.messages])

    @staticmethod
    def _request_id(req: RolloutRequest) -> str:
        # Callers may reuse ids; vLLM needs them unique among live requests.
        return f"{req.request_id}:{uuid.uuid4().hex[:12]}"

    @staticmethod
    def _prompt(prompt_ids: list[int], cache_salt: Optional[str]) -> Any:
        """The prompt as vLLM's renderer would hand it on (a token prompt needs no
        rendering): vLLM adds it without a trip to its renderer's threads, so the request
        reaches the engine in the same step of the event loop that took its salt."""
        from vllm.inputs.engine import tokens_input

        return tokens_input(prompt_ids, cache_salt=cache_salt)

    async def generate(
        self, req: RolloutRequest, prompt_ids: list[int], turn: Optional[EpisodeTurnSampling] = None, cache_salt: Optional[str] = None, lora: Optional[ServedAdapter] = None
    ) -> Generated:
        """Run one request to its end; cancelling this aborts it in the engine.
        ``cache_salt``: its prefix-cache salt (:meth:`SyncGate.salted`); ``lora``: the
        published adapter version it runs with (None: the base model)."""
        from vllm.exceptions import VLLMClientError

        from rollout.engine.convert import to_sample, to_sampling_params

        started = time.monotonic()
        plan = turn.plan if turn is not None else None
        params = (
            to_sampling_params(req.sampling, req.n, constraint=plan.structured_outputs, skip_special_tokens=plan.skip_special_tokens)
            if plan is not None
            else to_sampling_params(req.sampling, req.n)
        )
        final = None
        try:
            async for out in self.engine.generate(self._prompt(prompt_ids, cache_salt), params, self._request_id(req), **_lora_kwargs(lora)):
                final = out
        except (ValueError, VLLMClientError) as e:
            # vLLM checks a structured-output constraint when the request is added.
            if final is None and req.sampling.structured_outputs is not None:
                raise InvalidRequestError("sampling.structured_outputs", str(e)) from None
            raise
        outputs = sorted(final.outputs, key=lambda c: c.index)
        return Generated([to_sample(c, lora) for c in outputs], len(prompt_ids), sum(len(c.token_ids) for c in outputs), started)

    def stream(self, req: RolloutRequest, prompt_ids: list[int], cache_salt: Optional[str] = None, lora: Optional[ServedAdapter] = None) -> AsyncIterator[Any]:
        """vLLM's outputs of one request as they come (each holds only the new tokens);
        the request reaches vLLM with the first."""
        from rollout.engine.convert import to_sampling_params

        params = to_sampling_params(req.sampling, req.n, stream=True)
        return self.engine.generate(self._prompt(prompt_ids, cache_salt), params, self._request_id(req), **_lora_kwargs(lora))

    # ---- state ------------------------------------------------------------------

    @staticmethod
    def version_label(version: int) -> str:
        """``version`` labelled as the engine labels it: ``default`` until the first
        update, then the version's number."""
        return str(version) if version else INITIAL_VERSION_LABEL

    async def reported_version(self) -> str:
        """The version label as the engine core itself reports it (a call into it)."""
        return await self.engine.get_weight_version()

    def unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def raise_if_dead(self, replica_id: str) -> None:
        if self.engine.errored:
            raise EngineUnavailableError(f"replica {replica_id}: engine is dead: {self.engine.dead_error}")

    async def check_health(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.engine.check_health(), timeout=timeout_s)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _lora_kwargs(lora: Optional[ServedAdapter]) -> dict[str, Any]:
    """``AsyncLLM.generate``'s keyword for the adapter, only where there is one."""
    return {"lora_request": lora.lora_request()} if lora is not None else {}


def _prepare_weight_transfer(sync_backend: str) -> Any:
    """vLLM's weight-transfer config for ``sync_backend``, after readying this process
    (whose environment vLLM's engine processes inherit) for it."""
    from vllm.config import WeightTransferConfig

    from rollout.sync import net
    from rollout.sync.backends import get_backend
    from rollout.sync.vllm_plugin import register

    register()  # this process resolves the backend name before vLLM loads plugins
    # vLLM's engine processes are not Ray workers: they learn the node's address
    # from the environment, to bind their transfer groups to it (rollout.sync.net).
    # First: a backend that pins an interface to that address (nccl) reads it.
    net.export_node_address()
    # What the backend's engine needs in the environment vLLM's engine processes inherit.
    backend = get_backend(sync_backend)
    backend.prepare_engine_process()
    # The backend's receiving engine as vLLM's factory knows it (nccl: ours, not vLLM's "nccl").
    return WeightTransferConfig(backend=backend.vllm_engine)
