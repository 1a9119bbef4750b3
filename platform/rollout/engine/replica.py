"""One engine replica: a Ray Serve deployment class owning one vLLM ``AsyncLLM``.

Calls carry *batches* of requests: one handle call per request costs Serve CPU that
competes with the engine on small machines (measured 0.72x of bare vLLM at 64
concurrent single-request calls), while one call per batch costs almost nothing.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence, TypeVar

from pydantic import ValidationError

from rollout.api import (
    EpisodeRef,
    EpisodeStart,
    EpisodeStarted,
    EpisodeTurn,
    RolloutChunk,
    RolloutRequest,
    RolloutResult,
    Sample,
    Trajectory,
    TurnResult,
)
from rollout.config import PlatformConfig
from rollout.engine.load import ReplicaLoad
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.validation import ModelLimits, check_request
from rollout.episodes import render_initial
from rollout.errors import EngineUnavailableError, InvalidRequestError, NotServingError, StaleWeightsError, from_validation_error
from rollout.logs import show_platform_logs
from rollout.rewards import RewardScorer, Scorer
from rollout.sync.version import INITIAL_VERSION_LABEL, version_of
from rollout.tools.calling import TurnPlan

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeTurnSampling:
    """What sampling an episode's turn adds to its request: the tool-call constraint (none
    when the turn may not call tools), and no reward per turn (the episode is scored when
    it ends)."""

    plan: Optional[TurnPlan]


def _coerce_as(model: type[T], value: Any, where: str) -> T:
    """``value`` as ``model`` (a dict from a caller that does not import our types)."""
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise from_validation_error(e, where) from None


def _coerce(req: Any, where: str) -> RolloutRequest:
    return _coerce_as(RolloutRequest, req, where)


class RolloutEngine:
    """Serve deployment class. Build it through :func:`rollout.app.build`."""

    async def __init__(self, config: dict[str, Any], device: str, coordinator: Any = None, sync_backend: Optional[str] = None):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from rollout.engine.args import engine_kwargs
        from rollout.engine.openai_app import build_openai_app, serve_argv
        from rollout.engine.stats import stat_logger_factory

        show_platform_logs()
        self.config = PlatformConfig.model_validate(config)
        self.replica_id = self._replica_id()
        self.rewards = RewardScorer.from_config(self.config.rewards)  # imports rewards.functions: a bad path fails here
        self.metrics = None
        stat_loggers = []
        if self.config.metrics.enabled:
            from rollout.metrics import EngineMetrics, vllm_ray_stat_logger

            self.metrics = EngineMetrics(self.replica_id, self.config.model.name, self.config.app_name)
            stat_loggers.append(vllm_ray_stat_logger())
        self.snapshot = SchedulerSnapshot(self.metrics)
        # Once: on CPU it sizes the KV cache from the memory free now (before the engine takes it).
        kwargs = engine_kwargs(self.config.model, device)
        argv = serve_argv(self.config.model, self.config.openai, kwargs)
        if coordinator is not None:
            from vllm.config import WeightTransferConfig

            from rollout.sync.backends import get_backend
            from rollout.sync.vllm_plugin import register

            register()  # this process resolves the backend name before vLLM loads plugins
            # What the backend's engine needs (e.g. ipc: pickled handles); vLLM's engine
            # processes inherit this process's environment.
            os.environ.update(get_backend(sync_backend).engine_env)
            # vLLM's engine processes are not Ray workers: they learn the node's address
            # from the environment, to bind their transfer groups to it (rollout.sync.net).
            from rollout.sync import net

            net.export_node_address()
            if sync_backend == "nccl":
                # vLLM's NCCL engine would otherwise announce whichever interface NCCL
                # picks, not the node's address the trainer reaches this host by.
                net.pin_nccl_interface(net.choose())
            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=sync_backend)
        args = AsyncEngineArgs(**kwargs)
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self.snapshot), *stat_loggers])
        mc = self.engine.model_config
        self.limits = ModelLimits(
            vocab_size=mc.get_vocab_size(),
            max_model_len=mc.max_model_len,
            max_n=self.config.limits.max_n,
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.tokenizer_path)
        from rollout.engine.episode_service import EpisodeService

        # Imports tools.functions: a bad path fails the start.
        self.episodes = EpisodeService(self.config, self.tokenizer, self.replica_id, self.limits.max_model_len, self._sample_in_episode, self.rewards, self.metrics)
        # Fail closed: a replica whose tool workers cannot build the python tool's sandbox
        # does not start (SandboxUnavailable names what is missing and the setting to change).
        self.tool_isolation = await self.episodes.start_tools()
        if self.metrics is not None:
            self.metrics.tool_sandbox(self.tool_isolation.label if self.tool_isolation else "none")
        self.inflight = 0
        # When the current run of in-flight requests began: the stuck check counts from
        # here, not from the engine's last step (which, for the first requests after a
        # slow start, is the engine's start).
        self._busy_since = time.monotonic()
        self.sync = None
        if coordinator is not None:
            from rollout.sync.agent import SyncAgent

            ranks = self.config.model.tensor_parallel_size
            self.sync = SyncAgent(self.engine, coordinator, self.replica_id, ranks, self.config.model.path)
            # Registration (and catch-up) happen before __init__ returns, so Serve
            # routes no request here until this replica holds the committed version.
            await self.sync.start()
        # vLLM's own OpenAI server over this engine, with `vllm serve`'s arguments for it.
        self.openai_app = await build_openai_app(self.engine, argv)
        self._gauges_task = asyncio.get_running_loop().create_task(self._report_gauges()) if self.metrics is not None else None
        logger.info("replica %s ready: %s, limits %s", self.replica_id, self.config.model.path, self.limits)

    @staticmethod
    def _replica_id() -> str:
        try:
            from ray import serve

            return serve.get_replica_context().replica_id.unique_id
        except Exception:  # not inside Serve (unit use): a process-local id is enough
            return f"local-{os.getpid()}"

    # ---- request preparation -------------------------------------------------------

    def _prompt_ids(self, req: RolloutRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if req.prompt is not None:
            return list(self.tokenizer.encode(req.prompt))
        return render_initial(self.tokenizer, [m.model_dump() for m in req.messages])

    def _prepare(self, requests: Sequence[Any], offset: int = 0) -> list[tuple[RolloutRequest, list[int]]]:
        if len(requests) > self.config.limits.max_requests_per_call:
            raise InvalidRequestError(
                "requests", f"{len(requests)} requests in one call; the limit is limits.max_requests_per_call={self.config.limits.max_requests_per_call}"
            )
        prepared = []
        # Validate the whole batch before starting any of it: a bad request rejects the
        # call without engine work, and the caller learns which request was at fault.
        for i, raw in enumerate(requests, start=offset):
            req = _coerce(raw, f"requests[{i}]").with_id()
            ids = self._prompt_ids(req)
            try:
                check_request(req, ids, self.limits)
                self._reward_scorer(req)
            except InvalidRequestError as e:
                raise e.at(f"requests[{i}]") from None
            prepared.append((req, ids))
        return prepared

    def _reward_scorer(self, req: RolloutRequest) -> Optional[Scorer]:
        return self.rewards.resolve(req.reward or self.rewards.default)

    async def _scored(self, req: RolloutRequest, samples: list[Sample]) -> list[Sample]:
        scorer = self._reward_scorer(req)  # (checked when the request was prepared)
        if scorer is None:
            return samples
        outcomes = await asyncio.gather(*(self.rewards.score(scorer, s.text or "") for s in samples))
        return [s.model_copy(update=o.fields()) for s, o in zip(samples, outcomes)]

    def _engine_request_id(self, req: RolloutRequest) -> str:
        # Callers may reuse ids; vLLM needs them unique among live requests.
        return f"{req.request_id}:{uuid.uuid4().hex[:12]}"

    def _raise_if_dead(self) -> None:
        if self.engine.errored:
            raise EngineUnavailableError(f"replica {self.replica_id}: engine is dead: {self.engine.dead_error}")
        if self.sync is not None and self.sync.broken:
            raise EngineUnavailableError(f"replica {self.replica_id}: {self.sync.broken}")

    def _raise_if_not_serving(self) -> None:
        """Before any work: dead, broken, or alive but waiting for the next publish (its
        health check passes; its requests are refused at once, retryably)."""
        self._raise_if_dead()
        if self.sync is not None and self.sync.awaiting_publish:
            raise NotServingError(f"replica {self.replica_id}: {self.sync.awaiting_publish}")

    # ---- generation -------------------------------------------------------------

    def _count(self, outcome: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.request(outcome, n)

    def _served(self, prompt_tokens: int, generated: int, started: float) -> None:
        if self.metrics is not None:
            self.metrics.served(prompt_tokens, generated, time.monotonic() - started)
            self.metrics.request("ok")

    async def _generate_one(self, req: RolloutRequest, prompt_ids: list[int], turn: Optional[EpisodeTurnSampling] = None) -> RolloutResult:
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
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, self._engine_request_id(req)):
                final = out
        except (ValueError, VLLMClientError) as e:
            # vLLM checks a structured-output constraint when the request is added.
            if final is None and req.sampling.structured_outputs is not None:
                raise InvalidRequestError("sampling.structured_outputs", str(e)) from None
            raise
        outputs = sorted(final.outputs, key=lambda c: c.index)
        self._served(len(prompt_ids), sum(len(c.token_ids) for c in outputs), started)
        samples = [to_sample(c) for c in outputs]
        if turn is None:  # (an episode is scored when it ends, not turn by turn)
            samples = await self._scored(req, samples)
        committed = self.sync.known_committed if self.sync is not None else 0
        versions = [version_of(sp.version) for sample in samples for sp in sample.weight_versions]
        return RolloutResult(
            request_id=req.request_id,
            prompt_token_ids=prompt_ids,
            samples=samples,
            replica_id=self.replica_id,
            committed_version=committed,
            # Unknown stays unknown: no spans, or a replica that lost the coordinator.
            staleness=max(0, committed - min(versions)) if committed is not None and versions else None,
        )

    async def _admit(self, prepared: list[tuple[RolloutRequest, list[int]]], offset: int = 0) -> None:
        """Hold a batch until this replica serves the policy version it needs: the
        requests' ``min_weight_version`` and, with ``sync.max_staleness``, no more than
        that many versions behind the committed one."""
        wanted = 0
        for i, (req, _) in enumerate(prepared, start=offset):
            if req.min_weight_version and self.sync is None:
                raise InvalidRequestError(f"requests[{i}].min_weight_version", f"{req.min_weight_version}: weight sync is disabled; version 0 is all this platform serves")
            if req.min_weight_version and self.sync is not None and not self.sync.may_arrive(req.min_weight_version):
                # Held, it would pin a connection for sync.timeout_s and then fail anyway.
                raise InvalidRequestError(
                    f"requests[{i}].min_weight_version",
                    f"{req.min_weight_version} is ahead of the committed version {self.sync.committed} and of any publish in progress; "
                    "send it once the publish of that version has begun",
                )
            wanted = max(wanted, req.min_weight_version or 0)
        if self.sync is None:
            return
        lost = self.sync.coordinator_lost_s()
        if lost is not None and (self.config.sync.max_staleness is not None or wanted > self.sync.version):
            # Its staleness rule cannot be checked: a round may have committed without it.
            raise StaleWeightsError(
                f"replica {self.replica_id} has not reached the weight-sync coordinator for {lost:.0f}s and cannot vouch that "
                f"version {self.sync.version} is recent enough ({self._version_rule(wanted)}); retry (another replica may serve it)"
            )
        if self.config.sync.max_staleness is not None:
            wanted = max(wanted, self.sync.committed - self.config.sync.max_staleness)
        if wanted > self.sync.version:
            await self.sync.wait_for_version(wanted, self.config.sync.timeout_s)

    def _version_rule(self, wanted: int) -> str:
        if self.config.sync.max_staleness is not None:
            return f"sync.max_staleness {self.config.sync.max_staleness}"
        return f"min_weight_version {wanted}"

    async def generate(self, requests: Sequence[Any], offset: int = 0) -> list[RolloutResult]:
        """Run a batch of requests concurrently; results come back in request order.

        Raises :class:`InvalidRequestError` (naming ``requests[i].field``) before any
        engine work when a request is invalid; ``offset`` is the index of ``requests[0]``
        in the caller's whole batch, so errors name the caller's index. Cancelling the call aborts every request
        of the batch in the engine.
        """
        return await self._generate(requests, offset)

    async def _generate(self, requests: Sequence[Any], offset: int = 0, turn: Optional[EpisodeTurnSampling] = None) -> list[RolloutResult]:
        self._raise_if_not_serving()
        try:
            prepared = self._prepare(requests, offset)
        except InvalidRequestError:
            self._count("invalid", len(requests))
            raise
        # Before counting as in flight: a held request is not the engine being stuck.
        await self._admit(prepared, offset)
        self._enter(len(prepared))
        try:
            return await self._run_batch(prepared, turn, offset)
        except asyncio.CancelledError:
            self._count("cancelled", len(prepared))
            raise
        finally:
            self.inflight -= len(prepared)

    async def _run_batch(self, prepared: list[tuple[RolloutRequest, list[int]]], turn: Optional[EpisodeTurnSampling] = None, offset: int = 0) -> list[RolloutResult]:
        tasks: list[asyncio.Task] = []
        try:
            # TaskGroup cancels the rest of the batch if one request fails.
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._generate_one(r, ids, turn)) for r, ids in prepared]
            return [t.result() for t in tasks]
        except* Exception as eg:
            self._count("error", sum(1 for t in tasks if t.cancelled() or t.exception() is not None))
            self._raise_if_dead()
            first = eg.exceptions[0]
            if isinstance(first, InvalidRequestError):  # found by vLLM when the request was added: name it
                at = next((i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception() is first), None)
                if at is not None:
                    raise first.at(f"requests[{offset + at}]") from None
            raise first from None

    async def generate_stream(self, request: Any) -> AsyncIterator[RolloutChunk]:
        """Stream one request's tokens as they are produced (``n`` samples interleaved)."""
        from rollout.engine.convert import to_chunk, to_sampling_params

        self._raise_if_not_serving()
        try:
            ((req, prompt_ids),) = self._prepare([request])
        except InvalidRequestError:
            self._count("invalid")
            raise
        await self._admit([(req, prompt_ids)])
        params = to_sampling_params(req.sampling, req.n, stream=True)
        self._enter(1)
        first, generated, started = True, 0, time.monotonic()
        scorer = self._reward_scorer(req)
        texts: dict[int, str] = collections.defaultdict(str)  # each sample's text so far, for its reward
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, self._engine_request_id(req)):
                for c in out.outputs:
                    generated += len(c.token_ids)
                    chunk = to_chunk(req.request_id, c, prompt_ids if first else None)
                    if scorer is not None:
                        texts[c.index] += chunk.text
                        if chunk.finish_reason is not None:
                            chunk = chunk.model_copy(update=(await self.rewards.score(scorer, texts.pop(c.index))).fields())
                    yield chunk
                    first = False
            self._served(len(prompt_ids), generated, started)
        except (asyncio.CancelledError, GeneratorExit):
            self._count("cancelled")
            raise
        except Exception:
            self._count("error")
            raise
        finally:
            self.inflight -= 1

    async def openai_http(self, route_hint: dict, request: Any) -> AsyncIterator[Any]:
        """An OpenAI route through vLLM's own server: ``{"status", "headers"}``, then the
        body's chunks. ``route_hint`` is for the router (session, prompt prefix) only.

        The ``X-Rollout-Weight-Version`` header names the version this replica served when
        the response started; a non-streaming response that spans a weight update says
        ``<first>-<last>``. ``X-Rollout-Replica`` names the replica.
        """
        from rollout.engine.openai_app import call_asgi

        self._raise_if_not_serving()
        self._enter(1)
        first = self._weight_version_label()
        try:
            parts = call_asgi(self.openai_app, request)
            start = await parts.__anext__()
            body = []
            streaming = any(k.lower() == "content-type" and "event-stream" in v for k, v in start["headers"])
            if streaming:
                yield self._with_version(start, first)
                async for chunk in parts:
                    yield chunk
                return
            async for chunk in parts:
                body.append(chunk)
            last = self._weight_version_label()
            yield self._with_version(start, first if first == last else f"{first}-{last}")
            yield b"".join(body)
        finally:
            self.inflight -= 1

    # ---- episodes ---------------------------------------------------------------

    async def start_episode(self, start: Any) -> EpisodeStarted:
        start = _coerce_as(EpisodeStart, start, "episode")
        self._raise_if_not_serving()
        return self.episodes.start(start)

    async def episode_turn(self, turn: Any) -> TurnResult:
        return await self.episodes.turn(_coerce_as(EpisodeTurn, turn, "turn"))

    async def episode_trajectory(self, ref: Any, end: bool = False) -> Trajectory:
        return await self.episodes.trajectory(_coerce_as(EpisodeRef, ref, "episode"), end)

    async def _sample_in_episode(self, request: RolloutRequest, plan: Optional[TurnPlan]) -> Sample:
        try:
            (result,) = await self._generate([request], turn=EpisodeTurnSampling(plan))
        except InvalidRequestError as e:
            # The turn is the caller's request, not a batch: name its own field.
            raise InvalidRequestError(e.field.removeprefix("requests[0]."), e.message) from None
        return result.samples[0]

    def _with_version(self, start: dict, version: str) -> dict:
        headers = [(k, v) for k, v in start["headers"] if k.lower() != "content-length"]
        return {"status": start["status"], "headers": headers + [("x-rollout-weight-version", version), ("x-rollout-replica", self.replica_id)]}

    def _enter(self, n: int) -> None:
        if self.inflight == 0:
            self._busy_since = time.monotonic()
        self.inflight += n

    # ---- state ------------------------------------------------------------------

    def _load(self) -> ReplicaLoad:
        """This replica's load, from what the replica itself holds: routers, the
        autoscaler and the gauges poll it often, so it never waits on the engine core."""
        s = self.snapshot
        running, waiting = self._queue()
        return ReplicaLoad(
            replica_id=self.replica_id,
            running=running,
            waiting=waiting,
            kv_cache_usage=self._kv_usage(),
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            inflight_requests=self.inflight,
            unfinished_requests=self.engine.get_num_unfinished_requests(),
            weight_version=self._weight_version_label(),
            max_num_seqs=self.config.model.max_num_seqs,
            updated_at=s.last_step_wall,
        )

    def _weight_version_label(self) -> str:
        """The served policy version as the sync agent last recorded it, labelled as the
        engine labels it: ``default`` until the first update, then the version's number."""
        version = self.sync.version if self.sync is not None else 0
        return str(version) if version else INITIAL_VERSION_LABEL

    async def stats(self) -> ReplicaLoad:
        # Asked rarely, so it can wait for the version as the engine core itself reports it.
        return self._load().model_copy(update={"weight_version": await self.engine.get_weight_version()})

    async def _report_gauges(self, period_s: float = 1.0) -> None:
        while True:
            self.metrics.gauges(self._load())
            await asyncio.sleep(period_s)

    def _idle(self) -> bool:
        # An idle engine stops stepping, so its last scheduler report may predate the
        # final step and show sequences (and their KV blocks) long since finished.
        return self.inflight == 0 and self.snapshot.seconds_since_step() > 2.0

    def _queue(self) -> tuple[int, int]:
        """(running, waiting) sequences in the engine."""
        return (0, 0) if self._idle() else (self.snapshot.running, self.snapshot.waiting)

    def _kv_usage(self) -> float:
        return 0.0 if self._idle() else self.snapshot.kv_cache_usage

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for request routers (``deployment.routing.stats_period_s``)."""
        return self._load().to_routing_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Engine load for :func:`rollout.scaling.engine_load_policy`."""
        return self._load().to_autoscaling_metrics()

    async def model_info(self) -> dict[str, Any]:
        return {
            "name": self.config.model.name,
            "max_model_len": self.limits.max_model_len,
            "vocab_size": self.limits.vocab_size,
            "max_n": self.limits.max_n,
        }

    async def check_health(self) -> None:
        """Serve's health probe: fails when the engine is dead or stuck.

        Stuck means requests are in flight yet the engine has not completed a step for
        ``deployment.stuck_timeout_s``: an engine core that hangs keeps its process alive,
        so liveness alone would pass.
        """
        self._raise_if_dead()
        await asyncio.wait_for(self.engine.check_health(), timeout=self.config.deployment.health_check_timeout_s)
        if self.sync is not None and self.sync.held:
            # A trainer's /pause holds the requests on purpose; its /resume starts the clock again.
            self._busy_since = time.monotonic()
            return
        idle_for = min(self.snapshot.seconds_since_step(), time.monotonic() - self._busy_since)
        if self.inflight > 0 and idle_for > self.config.deployment.stuck_timeout_s:
            raise EngineUnavailableError(
                f"replica {self.replica_id}: {self.inflight} requests in flight but no engine step for {idle_for:.0f}s"
            )

    def __del__(self):
        task = getattr(self, "_gauges_task", None)
        if task is not None:
            task.cancel()
        rewards = getattr(self, "rewards", None)
        if rewards is not None:
            rewards.close()
        episodes = getattr(self, "episodes", None)
        if episodes is not None:
            episodes.close()
        sync = getattr(self, "sync", None)
        if sync is not None:
            sync.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
