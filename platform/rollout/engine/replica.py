"""One engine replica: the Ray Serve deployment class in front of one vLLM ``AsyncLLM``.

It composes parts with one job each, and keeps only the Serve-facing methods and the
order in which a request meets those parts:

- :class:`~rollout.engine.adapter.EngineAdapter`: the ``AsyncLLM`` (start it, prompt ids,
  one request's samples or its stream, the version label, liveness);
- :class:`~rollout.engine.admission.Admission`: which requests get in, the in-flight count
  (one context manager) and how requests ended;
- :class:`~rollout.engine.sync_gate.SyncGate`: whether the replica serves now and when a
  batch may run, over the sync agent or :class:`~rollout.engine.sync_gate.NoSync`;
- :class:`~rollout.engine.episode_service.EpisodeService`: episodes and their tools;
- :func:`~rollout.engine.openai_app.forward`: the OpenAI routes through vLLM's own app.

Calls carry *batches* of requests: one handle call per request costs Serve CPU that
competes with the engine on small machines (measured 0.72x of bare vLLM at 64
concurrent single-request calls), while one call per batch costs almost nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

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
from rollout.contracts.load import ReplicaLoad
from rollout.contracts.version import version_of
from rollout.engine.adapter import EngineAdapter, EpisodeTurnSampling
from rollout.engine.admission import Admission, Prepared, coerce_as
from rollout.engine.startup import StartPhases
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import SyncGate
from rollout.errors import EngineUnavailableError, InvalidRequestError
from rollout.logs import show_platform_logs
from rollout.rewards import RewardScorer
from rollout.sync.adapters import ServedAdapter
from rollout.tools.calling import TurnPlan

logger = logging.getLogger(__name__)


class RolloutEngine:
    """Serve deployment class. Build it through :func:`rollout.app.build`."""

    async def __init__(self, config: dict[str, Any], device: str, coordinator: Any = None, sync_backend: Optional[str] = None):
        from rollout.engine.episode_service import EpisodeService
        from rollout.engine.openai_app import SaltedEngine, build_openai_app

        show_platform_logs()
        replica_id = self._serve_replica_id()
        phases = StartPhases(replica_id)  # the replica's start, phase by phase (issue 41)
        with phases.phase("import"):
            EngineAdapter.imports()
        with phases.phase("setup"):
            cfg = PlatformConfig.model_validate(config)
            rewards = RewardScorer.from_config(cfg.rewards)  # imports rewards.functions: a bad path fails here
            metrics = None
            stat_loggers = []
            if cfg.metrics.enabled:
                from rollout.metrics import EngineMetrics, vllm_ray_stat_logger

                metrics = EngineMetrics(replica_id, cfg.model.name, cfg.app_name)
                stat_loggers.append(vllm_ray_stat_logger())
        # The weight-transfer backend is set up only where a coordinator will drive it.
        adapter = EngineAdapter.start(cfg, device, sync_backend if coordinator is not None else None, SchedulerSnapshot(metrics), stat_loggers, phases)
        sync = None
        if coordinator is not None:
            from rollout.sync.agent import SyncAgent

            # With the platform's sync settings: its polls and the coordinator's agree on when it is lost.
            sync = SyncAgent(adapter.engine, coordinator, replica_id, cfg.model.tensor_parallel_size, cfg.model.path, sync=cfg.sync)
        self._assemble(cfg, replica_id, adapter, SyncGate.over(sync, cfg.sync, replica_id), rewards, metrics)
        # Imports tools.functions: a bad path fails the start.
        self.episodes = EpisodeService(
            cfg, adapter.tokenizer, replica_id, adapter.limits.max_model_len, self._sample_in_episode, rewards, metrics, check_adapter=self.gate.adapter,
            routed_experts_refusal=adapter.limits.routed_experts_refusal,
        )
        # Fail closed: a replica whose tool workers cannot build the python tool's sandbox
        # does not start (SandboxUnavailable names what is missing and the setting to change).
        with phases.phase("tools"):
            self.tool_isolation = await self.episodes.start_tools()
        if metrics is not None:
            metrics.tool_sandbox(self.tool_isolation.label if self.tool_isolation else "none")
        # After the tools: a replica registers with the coordinator only once it can serve.
        with phases.phase("sync"):
            await self.gate.start()
        # vLLM's own OpenAI server over this engine, with `vllm serve`'s arguments for it;
        # every request it adds carries its prefix-cache salt.
        with phases.phase("openai"):
            self.openai_app = await build_openai_app(SaltedEngine(adapter.engine, self.gate.salted), adapter.serve_argv)
        if self.gate.sync.adapters is not None:
            # OpenAI requests name a published adapter by `model`: vLLM's own map of names
            # to adapters follows every commit (the response's `model` is "<name>@<version>").
            models = self.openai_app.state.openai_serving_models
            def follow(name: str, served: Optional[ServedAdapter]) -> None:
                if served is None:
                    models.lora_requests.pop(name, None)  # unloaded: vLLM's own 404 naming it
                else:
                    models.lora_requests[name] = served.lora_request()

            self.gate.sync.adapters.listen(follow)
        self._gauges_task = asyncio.get_running_loop().create_task(self._report_gauges()) if metrics is not None else None
        self.start_phases = phases
        if metrics is not None:
            phases.observe(metrics)
        logger.info("replica %s ready: %s, limits %s; %s", replica_id, cfg.model.path, adapter.limits, phases.summary())

    def _assemble(self, config: PlatformConfig, replica_id: str, adapter: EngineAdapter, gate: SyncGate, rewards: RewardScorer, metrics: Optional[Any] = None) -> None:
        """Wire the parts (also how unit tests build a replica over a fake engine)."""
        self.config = config
        self.replica_id = replica_id
        self.adapter = adapter
        self.gate = gate
        self.rewards = rewards
        self.metrics = metrics  # rollout.metrics.EngineMetrics, when metrics are on
        self.admission = Admission(config.limits, adapter.limits, adapter.prompt_ids, rewards, metrics)
        self.admission.inflight.on_busy = adapter.snapshot.new_busy_period

    @staticmethod
    def _serve_replica_id() -> str:
        try:
            from ray import serve

            return serve.get_replica_context().replica_id.unique_id
        except Exception:  # not inside Serve (unit use): a process-local id is enough
            return f"local-{os.getpid()}"

    def _raise_if_dead(self) -> None:
        self._raise_if_engine_dead()
        self.gate.raise_if_broken()

    def _raise_if_engine_dead(self) -> None:
        if self.adapter.dead():
            self._report_death()
        self.adapter.raise_if_dead(self.replica_id)

    def _report_death(self) -> None:
        """Once: say why the engine died, in this replica's log and in the cluster's record
        of engine deaths (rollout.engine.deaths), which outlives this replica: Serve replaces
        it, and ``rollout serve``, ``/healthz`` and ``rollout status`` report the deaths (a
        crash loop among them) with this error."""
        if getattr(self, "_death_reported", False):
            return
        self._death_reported = True
        from rollout.engine import deaths

        death = deaths.EngineDeath(
            app=self.config.app_name,
            replica_id=self.replica_id,
            reason=self.adapter.death_reason(),
            at=time.time(),
            uptime_s=time.monotonic() - self.adapter.started,
            served=self.adapter.served,
        )
        logger.error("%s; Serve replaces the replica once its health check fails", death.line())
        try:
            deaths.record(death)
        except Exception:  # the record is for the operator: its failure must not hide the death itself
            logger.exception("replica %s: could not record its engine's death in the cluster", self.replica_id)

    async def _typed(self, e: BaseException, grace_s: Optional[float] = 0) -> BaseException:
        """An error of a serving path, typed as the engine's death when that is what it is.
        No wait by default: what the engine raised, the adapter waited for its death already
        (``grace_s=None``: the adapter's wait, for an error that did not come through it)."""
        typed = await self.adapter.typed(e, grace_s)
        if self.adapter.dead():
            self._report_death()
        return typed

    def _raise_if_not_serving(self) -> None:
        """Before any work: dead, broken, or alive but waiting for the next publish."""
        self._raise_if_dead()
        self.gate.raise_if_awaiting_publish()

    # ---- generation -------------------------------------------------------------

    async def generate(self, requests: Sequence[Any], offset: int = 0, avoid_replica: Optional[str] = None) -> list[RolloutResult]:
        """Run a batch of requests concurrently; results come back in request order.
        (``avoid_replica`` is for the router: a replica that refused the call before.)

        Raises :class:`InvalidRequestError` (naming ``requests[i].field``) before any
        engine work when a request is invalid; ``offset`` is the index of ``requests[0]``
        in the caller's whole batch, so errors name the caller's index. Cancelling the call aborts every request
        of the batch in the engine.
        """
        return await self._generate(requests, offset)

    async def _generate(self, requests: Sequence[Any], offset: int = 0, turn: Optional[EpisodeTurnSampling] = None) -> list[RolloutResult]:
        self._raise_if_not_serving()
        prepared = self.admission.prepare(requests, offset)
        self.gate.check_adapters(prepared, offset)
        # Before counting as in flight: a held request is not the engine being stuck.
        await self.gate.admit(prepared, offset)
        with self.admission.inflight.counted(len(prepared)):
            try:
                return await self._run_batch(prepared, turn, offset)
            except asyncio.CancelledError:
                self.admission.count("cancelled", len(prepared))
                raise

    async def _run_batch(self, prepared: Prepared, turn: Optional[EpisodeTurnSampling] = None, offset: int = 0) -> list[RolloutResult]:
        tasks: list[asyncio.Task] = []
        try:
            # TaskGroup cancels the rest of the batch if one request fails.
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._generate_one(r, ids, turn)) for r, ids in prepared]
            return [t.result() for t in tasks]
        except* Exception as eg:
            self.admission.count("error", sum(1 for t in tasks if t.cancelled() or t.exception() is not None))
            first = eg.exceptions[0]
            # Every error of a dead (or dying) engine is its death, whatever vLLM raised.
            first = await self._typed(first)
            if isinstance(first, EngineUnavailableError):
                raise first from None
            self._raise_if_dead()
            if isinstance(first, InvalidRequestError):  # found by vLLM when the request was added: name it
                at = next((i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception() is first), None)
                if at is not None:
                    raise first.at(f"requests[{offset + at}]") from None
            raise first from None

    async def _generate_one(self, req: RolloutRequest, prompt_ids: list[int], turn: Optional[EpisodeTurnSampling] = None) -> RolloutResult:
        # The salt is taken as the request is added to vLLM (no await between them).
        # The adapter's newest committed version as the request starts: it keeps it to its end.
        lora = self.gate.adapter(req.adapter) if req.adapter is not None else None
        with self.gate.salted() as salt:
            out = await self.adapter.generate(req, prompt_ids, turn, salt, lora)
        self.admission.served(out.prompt_tokens, out.generated_tokens, out.started)
        samples = out.samples
        if turn is None:  # (an episode is scored when it ends, not turn by turn)
            samples = await self._scored(req, samples)
        committed = self.gate.known_committed
        versions = [sp.version for sample in samples for sp in sample.weight_versions]
        return RolloutResult(
            request_id=req.request_id,
            prompt_token_ids=prompt_ids,
            samples=samples,
            replica_id=self.replica_id,
            committed_version=committed,
            # Unknown stays unknown: no spans, or a replica that lost the coordinator.
            staleness=max(0, committed - min(versions)) if committed is not None and versions else None,
        )

    async def _scored(self, req: RolloutRequest, samples: list[Sample]) -> list[Sample]:
        scorer = self.admission.scorer(req)
        if scorer is None:
            return samples
        outcomes = await asyncio.gather(*(self.rewards.score(scorer, s.text or "") for s in samples))
        return [s.model_copy(update=o.fields()) for s, o in zip(samples, outcomes)]

    async def generate_stream(self, request: Any, avoid_replica: Optional[str] = None) -> AsyncIterator[RolloutChunk]:
        """Stream one request's tokens as they are produced (``n`` samples interleaved).
        (``avoid_replica`` is for the router: a replica that refused the call before.)"""
        from rollout.engine.convert import to_chunk

        self._raise_if_not_serving()
        ((req, prompt_ids),) = self.admission.prepare([request])
        self.gate.check_adapters([(req, prompt_ids)])
        await self.gate.admit([(req, prompt_ids)])
        # Closed with this stream, however it ends: closing it aborts the request in the engine.
        lora = self.gate.adapter(req.adapter) if req.adapter is not None else None
        outputs = contextlib.aclosing(self._salted_stream(req, prompt_ids, lora))
        with self.admission.inflight.counted(1):
            first, generated, started = True, 0, time.monotonic()
            scorer = self.admission.scorer(req)
            texts: dict[int, str] = collections.defaultdict(str)  # each sample's text so far, for its reward
            sampled: dict[int, int] = collections.defaultdict(int)  # each sample's tokens so far, for its routed experts
            try:
                async with outputs as engine_outputs:
                    async for out in engine_outputs:
                        for c in out.outputs:
                            routed = (len(prompt_ids), sampled[c.index]) if req.return_routed_experts else None
                            sampled[c.index] += len(c.token_ids)
                            generated += len(c.token_ids)
                            chunk = to_chunk(req.request_id, c, prompt_ids if first else None, lora, routed)
                            if scorer is not None:
                                texts[c.index] += chunk.text
                                if chunk.finish_reason is not None:
                                    chunk = chunk.model_copy(update=(await self.rewards.score(scorer, texts.pop(c.index))).fields())
                            yield chunk
                            first = False
                self.admission.served(len(prompt_ids), generated, started)
            except (asyncio.CancelledError, GeneratorExit):
                self.admission.count("cancelled")
                raise
            except Exception as e:
                self.admission.count("error")
                typed = await self._typed(e)
                if typed is e:
                    raise
                raise typed from e

    async def _salted_stream(self, req: RolloutRequest, prompt_ids: list[int], lora: Optional[ServedAdapter] = None) -> AsyncIterator[Any]:
        """The engine's outputs of one request, its salt taken as its first is asked for
        (when vLLM adds the request), held until the stream ends."""
        with self.gate.salted() as salt:
            async with contextlib.aclosing(self.adapter.stream(req, prompt_ids, salt, lora)) as outputs:
                async for out in outputs:
                    yield out

    async def openai_http(self, route_hint: dict, request: Any, avoid_replica: Optional[str] = None) -> AsyncIterator[Any]:
        """An OpenAI route through vLLM's own server: ``{"status", "headers"}``, then the
        body's chunks. ``route_hint`` and ``avoid_replica`` are for the router (session,
        prompt prefix; a replica that refused the call before) only.

        The ``X-Rollout-Weight-Version`` header names the version this replica served when
        the response started; a non-streaming response that spans a weight update says
        ``<first>-<last>``. ``X-Rollout-Replica`` names the replica.
        """
        from rollout.engine.openai_app import forward, requested_model

        self._raise_if_not_serving()
        # vLLM would answer its 404 (not retryable) for an adapter committed but not loaded
        # here: refused as the token API refuses it, retryably, before any work. The body is
        # parsed for it only while such an adapter exists (vLLM parses it again).
        model = requested_model(request.body) if self.gate.adapters_unavailable else None
        if model is not None:
            self.gate.raise_if_adapter_unavailable(model)
        with self.admission.inflight.counted(1):
            async with contextlib.aclosing(forward(self.openai_app, request, self._weight_version_label, self.replica_id)) as parts:
                first = True
                async for part in parts:
                    if first and part["status"] >= 500:
                        # vLLM's app answers its engine's death with its own 500: ours is the
                        # typed retryable error, as on every other route.
                        typed = await self._typed(RuntimeError(f"vLLM's OpenAI app answered {part['status']}"), grace_s=None)
                        if isinstance(typed, EngineUnavailableError):
                            raise typed
                    first = False
                    yield part

    async def openai_http_unary(self, route_hint: dict, request: Any, avoid_replica: Optional[str] = None) -> tuple[dict, bytes]:
        """:meth:`openai_http` as one answer, ``({"status", "headers"}, body)``: for a request
        that does not stream, one Serve call rather than a stream of them (each of its items
        a call's worth of work at both ends: issue 41)."""
        start: Optional[dict] = None
        body: list[bytes] = []
        async with contextlib.aclosing(self.openai_http(route_hint, request)) as parts:
            async for part in parts:
                if start is None:
                    start = part
                else:
                    body.append(part)
        assert start is not None, "openai_http ended without a response start"
        return start, b"".join(body)

    # ---- episodes ---------------------------------------------------------------

    async def start_episode(self, start: Any) -> EpisodeStarted:
        start = coerce_as(EpisodeStart, start, "episode")
        self._raise_if_not_serving()
        return self.episodes.start(start)

    async def episode_turn(self, turn: Any) -> TurnResult:
        return await self.episodes.turn(coerce_as(EpisodeTurn, turn, "turn"))

    async def episode_trajectory(self, ref: Any, end: bool = False) -> Trajectory:
        return await self.episodes.trajectory(coerce_as(EpisodeRef, ref, "episode"), end)

    async def _sample_in_episode(self, request: RolloutRequest, plan: Optional[TurnPlan], routed_experts_start: int = 0) -> Sample:
        """How episodes sample a turn: through the replica's whole path (serving, admission,
        in-flight accounting), as a batch of one. ``routed_experts_start``: the trajectory
        rows earlier turns returned (this turn's routed experts begin there)."""
        try:
            (result,) = await self._generate([request], turn=EpisodeTurnSampling(plan, routed_experts_start))
        except InvalidRequestError as e:
            # The turn is the caller's request, not a batch: name its own field.
            raise InvalidRequestError(e.field.removeprefix("requests[0]."), e.message) from None
        return result.samples[0]

    # ---- state ------------------------------------------------------------------

    def _load(self) -> ReplicaLoad:
        """This replica's load, from what the replica itself holds: routers, the
        autoscaler and the gauges poll it often, so it never waits on the engine core."""
        s = self.adapter.snapshot
        # An idle engine's last scheduler report may show sequences long since finished.
        idle = self.admission.inflight.idle(s)
        return ReplicaLoad(
            replica_id=self.replica_id,
            running=0 if idle else s.running,
            waiting=0 if idle else s.waiting,
            kv_cache_usage=0.0 if idle else s.kv_cache_usage,
            kv_cache_usage_peak=s.kv_cache_usage_peak,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            inflight_requests=self.admission.inflight.count,
            unfinished_requests=self.adapter.unfinished_requests(),
            weight_version=self._weight_version_label(),
            max_num_seqs=self.config.model.max_num_seqs,
            updated_at=s.last_step_wall,
            sleep_level=self.gate.sleep_level,
        )

    def _weight_version_label(self) -> str:
        """The served policy version as the sync agent last recorded it, as the engine labels it."""
        return self.adapter.version_label(self.gate.version)

    async def stats(self) -> ReplicaLoad:
        # Asked rarely, so it can wait for the version as the engine core itself reports it.
        self._raise_if_engine_dead()
        try:
            version = await self.adapter.reported_version()
        except EngineUnavailableError:
            self._raise_if_engine_dead()  # with the death reported
            raise
        return self._load().model_copy(update={"weight_version": version})

    async def _report_gauges(self, period_s: float = 1.0) -> None:
        while True:
            self.metrics.gauges(self._load())
            await asyncio.sleep(period_s)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for request routers (``deployment.routing.stats_period_s``)."""
        return self._load().to_routing_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Engine load for :func:`rollout.scaling.engine_load_policy`."""
        return self._load().to_autoscaling_metrics()

    async def model_info(self) -> dict[str, Any]:
        limits = self.adapter.limits
        return {"name": self.config.model.name, "max_model_len": limits.max_model_len, "vocab_size": limits.vocab_size, "max_n": limits.max_n}

    async def check_health(self) -> None:
        """Serve's health probe: fails when the engine is dead or stuck.

        Stuck means requests are in flight yet the engine has not completed a step for
        ``deployment.stuck_timeout_s``: an engine core that hangs keeps its process alive,
        so liveness alone would pass.
        """
        self._raise_if_dead()
        try:
            await self.adapter.check_health(self.config.deployment.health_check_timeout_s)
        except EngineUnavailableError:
            self._raise_if_engine_dead()  # with the death reported, when it is one
            raise
        inflight = self.admission.inflight
        if self.gate.held or self.gate.asleep:
            # A trainer's /pause (or /sleep) holds the requests on purpose; its /resume
            # (/wake_up) starts the clock again. Asleep, the engine is alive: passing.
            inflight.restart_clock()
            return
        idle_for = inflight.stalled_for(self.adapter.snapshot)
        if inflight.count > 0 and idle_for > self.config.deployment.stuck_timeout_s:
            raise EngineUnavailableError(f"replica {self.replica_id}: {inflight.count} requests in flight but no engine step for {idle_for:.0f}s")

    # The parts __del__ ends, in this order, and how each ends.
    _TEARDOWN: tuple[tuple[str, Callable[[Any], None]], ...] = (
        ("_gauges_task", lambda task: task.cancel()),
        ("rewards", lambda rewards: rewards.close()),
        ("episodes", lambda episodes: episodes.close()),
        ("gate", lambda gate: gate.stop()),
        ("adapter", lambda adapter: adapter.shutdown()),
    )

    def __del__(self):
        # Each part as far as the constructor got to build it.
        for name, end in self._TEARDOWN:
            part = getattr(self, name, None)
            if part is not None:
                end(part)
