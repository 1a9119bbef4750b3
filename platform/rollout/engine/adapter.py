"""The replica's vLLM engine (``AsyncLLM``), behind what the replica asks of it: start it,
turn a request into its prompt ids, generate one request's samples or stream them, label
the served version as the engine labels it, and say whether it is alive.

Only this module (with :mod:`rollout.engine.convert`, which translates the types) talks to
the ``AsyncLLM``: the replica composes it with admission, the sync gate and episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

from rollout.api import RolloutRequest, Sample
from rollout.config import PlatformConfig
from rollout.contracts.version import INITIAL_VERSION_LABEL
from rollout.engine.startup import StartPhases
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.validation import ModelLimits, routed_experts_refusal
from rollout.episodes import render_initial
from rollout.errors import EngineUnavailableError, InvalidRequestError
from rollout.sync.adapters import ServedAdapter
from rollout.tools.calling import TurnPlan


@dataclass(frozen=True)
class EpisodeTurnSampling:
    """What sampling an episode's turn adds to its request: the tool-call constraint (none
    when the turn may not call tools), no reward per turn (the episode is scored when
    it ends), and where its routed experts begin (after the rows earlier turns returned)."""

    plan: Optional[TurnPlan]
    routed_experts_start: int = 0


# How long an error from the engine may come before the engine reads as dead. A dying
# engine's requests get whatever error ended vLLM's output handler (it hands it to every
# request), while vLLM's monitor thread and that handler mark the engine dead in their own
# time (the monitor also closes the client's sockets): issue 40's first caller got a raw
# AttributeError, a 500, later callers the typed 503. An error followed within this by the
# engine's death is that death.
DEATH_GRACE_S = 2.0


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
        self.started = time.monotonic()  # when the engine was ready
        self.served = 0  # requests it finished (0 when it dies: it died on its first)
        self._death: Optional[str] = None  # why it died, once it has (death_reason)

    @staticmethod
    def imports() -> None:
        """Import what the engine, its stat loggers and the tokenizer need (vLLM, torch,
        transformers: most of a replica's start before its engine's, issue 41). The replica
        does it first, as its own phase; nothing at module level imports them, so the
        process that builds the app (rollout.app) never does."""
        import transformers  # noqa: F401
        import vllm.v1.engine.async_llm  # noqa: F401
        import vllm.v1.metrics.ray_wrappers  # noqa: F401

    @classmethod
    def start(
        cls, config: PlatformConfig, device: str, sync_backend: Optional[str], snapshot: SchedulerSnapshot, stat_loggers: list[Any], phases: StartPhases
    ) -> EngineAdapter:
        """Build the engine for ``config.model`` on ``device``; with ``sync_backend`` (weight
        sync on), able to receive weights through that backend. Each step is timed in ``phases``."""
        from transformers import AutoTokenizer
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.engine.args import USAGE_CONTEXT, engine_config, engine_kwargs, prepare_engine_environment
        from rollout.engine.openai_app import serve_argv
        from rollout.engine.stats import stat_logger_factory

        # Once: on CPU it sizes the KV cache from the memory free now (before the engine takes it).
        kwargs = engine_kwargs(config.model, device)
        prepare_engine_environment(device, config.model)
        argv = serve_argv(config.model, config.openai, kwargs)
        if sync_backend is not None:
            kwargs["weight_transfer_config"] = _prepare_weight_transfer(sync_backend)
        with phases.phase("config"):
            vllm_config = engine_config(kwargs)
        with phases.phase("engine"):
            # As vLLM's `vllm serve` makes its AsyncLLM (build_async_engine_client_from_engine_args):
            # the same config, usage context and logging switches; our stat loggers added.
            engine = AsyncLLM.from_vllm_config(
                vllm_config, usage_context=UsageContext[USAGE_CONTEXT], stat_loggers=[stat_logger_factory(snapshot), *stat_loggers], disable_log_stats=kwargs["disable_log_stats"]
            )
        with phases.phase("tokenizer"):
            mc = engine.model_config
            limits = ModelLimits(
                vocab_size=mc.get_vocab_size(), max_model_len=mc.max_model_len, max_n=config.limits.max_n, routed_experts_refusal=routed_experts_refusal(config.model, device)
            )
            tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)
        return cls(engine, tokenizer, limits, snapshot, argv)

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
        from rollout.vllm_compat import skip_special_tokens

        started = time.monotonic()
        plan = turn.plan if turn is not None else None
        routed_start = turn.routed_experts_start if turn is not None else 0
        params = (
            to_sampling_params(req.sampling, req.n, constraint=plan.structured_outputs, skip_special_tokens=skip_special_tokens(plan.skip_special_tokens), routed_experts_start=routed_start)
            if plan is not None
            else to_sampling_params(req.sampling, req.n, routed_experts_start=routed_start)
        )
        final = None
        try:
            async for out in self.engine.generate(self._prompt(prompt_ids, cache_salt), params, self._request_id(req), **_lora_kwargs(lora)):
                final = out
        except (ValueError, VLLMClientError) as e:
            # vLLM checks a structured-output constraint when the request is added.
            if final is None and req.sampling.structured_outputs is not None:
                raise InvalidRequestError("sampling.structured_outputs", str(e)) from None
            # The request's fault while the engine lives: no wait for a death.
            raise await self.typed(e, grace_s=0) from e
        except Exception as e:
            raise await self.typed(e) from e
        if final is None:
            # vLLM ended the request without an output: only an engine that went away does.
            raise await self.typed(RuntimeError(f"request {req.request_id}: the engine ended it without an output"))
        self.served += 1
        outputs = sorted(final.outputs, key=lambda c: c.index)
        # Routed experts only where asked: the engine captures them for every request once on.
        routed = (len(prompt_ids), routed_start) if req.return_routed_experts else None
        return Generated([to_sample(c, lora, routed) for c in outputs], len(prompt_ids), sum(len(c.token_ids) for c in outputs), started)

    def stream(self, req: RolloutRequest, prompt_ids: list[int], cache_salt: Optional[str] = None, lora: Optional[ServedAdapter] = None) -> AsyncIterator[Any]:
        """vLLM's outputs of one request as they come (each holds only the new tokens);
        the request reaches vLLM with the first."""
        from rollout.engine.convert import to_sampling_params

        params = to_sampling_params(req.sampling, req.n, stream=True)
        return self._typed_stream(self.engine.generate(self._prompt(prompt_ids, cache_salt), params, self._request_id(req), **_lora_kwargs(lora)))

    async def _typed_stream(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        from vllm.exceptions import VLLMClientError

        # Closing this closes vLLM's generator, which aborts the request in the engine.
        async with contextlib.aclosing(outputs) as outs:
            try:
                async for out in outs:
                    yield out
            except (ValueError, VLLMClientError) as e:
                raise await self.typed(e, grace_s=0) from e  # the request's fault while the engine lives
            except Exception as e:
                raise await self.typed(e) from e
        self.served += 1

    # ---- state ------------------------------------------------------------------

    @staticmethod
    def version_label(version: int) -> str:
        """``version`` labelled as the engine labels it: ``default`` until the first
        update, then the version's number."""
        return str(version) if version else INITIAL_VERSION_LABEL

    async def reported_version(self) -> str:
        """The version label as the engine core itself reports it (a call into it)."""
        try:
            return await self.engine.get_weight_version()
        except Exception as e:
            raise await self.typed(e) from e

    def unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    # ---- liveness ---------------------------------------------------------------

    def dead(self) -> bool:
        return bool(self.engine.errored)

    def death_reason(self) -> str:
        """Why the engine died, as far as this process can tell: vLLM's error names no
        cause ("See stack trace (above)"), so the engine core's exit code (a signal, such as
        SIGILL, when it was killed) goes with it, and the fatal signal a vLLM process of this
        engine logged (rollout.engine.lifetime's fault log)."""
        if self._death is None:
            from rollout.engine.lifetime import fatal_errors

            parts = [str(self.engine.dead_error)]
            parts += [f"engine core process {code}" for code in _exit_codes(self.engine)]
            parts += fatal_errors()
            self._death = "; ".join(parts)
        return self._death

    async def typed(self, e: BaseException, grace_s: Optional[float] = None) -> BaseException:
        """``e``, raised by the engine, as the platform answers it: when the engine is dead
        or dies within :data:`DEATH_GRACE_S` (vLLM marks it dead after the error reaches its
        requests), :class:`EngineUnavailableError` (retryable) with the engine's last error;
        any other error unchanged (a request's own fault, or the platform's)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(e, EngineUnavailableError):
            return e
        deadline = time.monotonic() + (DEATH_GRACE_S if grace_s is None else grace_s)
        while not self.dead():
            if isinstance(e, EngineDeadError) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        if self.dead() or isinstance(e, EngineDeadError):
            return EngineUnavailableError(f"engine is dead: {self.death_reason()} (it raised {type(e).__name__}: {e})")
        return e

    def raise_if_dead(self, replica_id: str) -> None:
        if self.dead():
            raise EngineUnavailableError(f"replica {replica_id}: engine is dead: {self.death_reason()}")

    async def check_health(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.engine.check_health(), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine did not answer its health check within {timeout_s:g}s (deployment.health_check_timeout_s)") from None
        except Exception as e:
            raise await self.typed(e) from e

    def shutdown(self) -> None:
        self.engine.shutdown()


def _exit_codes(engine: Any) -> list[str]:
    """How the engine's core processes ended (vLLM's process manager holds them; none where
    they run in this process or have not ended): ``exit code N`` or ``killed by SIGNAME``."""
    import signal

    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    out = []
    for proc in getattr(manager, "processes", None) or ():
        code = proc.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                out.append(f"{proc.pid} killed by {signal.Signals(-code).name} (exit code {code})")
            except ValueError:
                out.append(f"{proc.pid} exit code {code}")
        else:
            out.append(f"{proc.pid} exit code {code}")
    return out


def _lora_kwargs(lora: Optional[ServedAdapter]) -> dict[str, Any]:
    """``AsyncLLM.generate``'s keyword for the adapter, only where there is one."""
    return {"lora_request": lora.lora_request()} if lora is not None else {}


def _prepare_weight_transfer(sync_backend: str) -> Any:
    """vLLM's weight-transfer config for ``sync_backend``, after readying this process
    (whose environment vLLM's engine processes inherit) for it."""
    from vllm.config import WeightTransferConfig

    from rollout.contracts import net
    from rollout.contracts.backend_registry import get_backend
    from rollout.sync.vllm_plugin import register

    register()  # this process resolves the backend name before vLLM loads plugins
    # vLLM's engine processes are not Ray workers: they learn the node's address
    # from the environment, to bind their transfer groups to it (rollout.contracts.net).
    # First: a backend that pins an interface to that address (nccl) reads it.
    net.export_node_address()
    # What the backend's engine needs in the environment vLLM's engine processes inherit.
    backend = get_backend(sync_backend)
    backend.prepare_engine_process()
    # The backend's receiving engine as vLLM's factory knows it (nccl: ours, not vLLM's "nccl").
    return WeightTransferConfig(backend=backend.vllm_engine)
