"""The HTTP ingress: our token-level API plus OpenAI-compatible endpoints (FastAPI in Serve)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from ray import serve

from rollout import wire_errors as wire
from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, EpisodeTurnBody, Trajectory, TurnResult, RolloutBatch, RolloutBatchResult, RolloutChunk, RolloutRequest
from rollout.client.handle import HandleTransport
from rollout.config import PlatformConfig
from rollout.contracts.load import ReplicaLoad
from rollout.contracts.sync_protocol import SyncError
from rollout.engine.deaths import EngineDeath, crash_loop
from rollout.engine.deaths import read as read_deaths
from rollout.errors import EngineUnavailableError, InvalidRequestError, RolloutError, loc_to_field
from rollout.logs import show_platform_logs
from rollout.http.front_door import check_serving_process
from rollout.engine.openai_app import ForwardedRequest, routing_hint
from rollout.sync.auth import SYNC_TOKEN_HEADER, AccessPolicy, Operation, SyncAuth
from rollout.sync.coordinator_client import CoordinatorHandle
from rollout.contracts.sync_protocol import SyncError
from rollout.sync.remote import OUTCOME, PLAN, STORAGE_PLAN, AdapterBody, AdapterRemovalBody, BeginRoundBody, FinishBody, StorageRoundBody

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"  # what agent frameworks send to keep a conversation on one replica

from rollout.http.routes_app import EPISODE_ERRORS, HEALTH_ERRORS, REQUEST_ERRORS, STATS_ERRORS, SYNC_ERRORS, admit, app  # noqa: E402  (the routes below and in rl_routes share it)
from rollout.http.rl_routes import VllmRlRoutes  # noqa: E402

# An unload also answers 404 for an adapter not published (naming `name`).
ADAPTER_SYNC_ERRORS = {**SYNC_ERRORS, **wire.responses(wire.ADAPTER_NOT_FOUND)}


class NdjsonResponse(StreamingResponse):
    """One JSON document per line (what the schema says the stream route answers)."""

    media_type = "application/x-ndjson"


def _error(status: int, message: str, field: Optional[str] = None) -> JSONResponse:
    """FastAPI's own refusals, in the body of an invalid request."""
    return JSONResponse(status_code=status, content=wire.body(wire.INVALID, message, field))


@app.exception_handler(RequestValidationError)
async def _on_schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidRequestError):
        # A model's own rule (a validator) that names the field it is about.
        return _error(wire.INVALID.status, str(raised), raised.field)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = loc_to_field(loc) or "body"
    return _error(wire.INVALID.status, f"{field}: {first.get('msg')}", field)


@app.exception_handler(HTTPException)
async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # FastAPI's own refusals (a body that is not JSON, an unknown route or method) in the
    # same error body as every other answer.
    field = "body" if exc.status_code == 400 else None
    response = _error(exc.status_code, f"{field}: {exc.detail}" if field else str(exc.detail), field)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _on_platform_error(request: Request, exc: RolloutError) -> JSONResponse:
    # Starlette picks the handler of the most specific class; the table picks the answer.
    answer = wire.encode(exc)
    return JSONResponse(status_code=answer.status, content=answer.body, headers=answer.headers or None)


for _error_type in wire.raised_types():
    app.add_exception_handler(_error_type, _on_platform_error)


async def require_key(request: Request) -> None:
    """The API key (rollout.sync.auth.Operation.SERVE). ``async``, so that FastAPI runs it
    on the event loop, not in its thread pool (``refuse_undocumented_query`` says why)."""
    admit(Operation.SERVE, request)


async def publish_credential(request: Request) -> Optional[str]:
    """The API key, then the sync credential to hand the coordinator (Operation.PUBLISH)."""
    return admit(Operation.PUBLISH, request)


SyncCredential = Annotated[Optional[str], Depends(publish_credential)]


async def _first_then_rest(agen: AsyncIterator[RolloutChunk]) -> tuple[RolloutChunk, AsyncIterator[RolloutChunk]]:
    # Pull the first chunk before answering, so validation errors become a 4xx rather
    # than a 200 stream that breaks off.
    first = await agen.__anext__()

    async def rest():
        yield first
        async for c in agen:
            yield c

    return first, rest()


@serve.ingress(app)
class HttpIngress(VllmRlRoutes):
    def __init__(self, engine_handle, config: dict[str, Any], coordinator_handle=None):
        show_platform_logs()
        self.config = PlatformConfig.model_validate(config)
        # Serve's front door is the cluster's (its processes' environment), not this app's.
        check_serving_process(self.config.http)
        self.engine = HandleTransport(engine_handle, self.config.deployment.client_batch_size)
        self.coordinator = CoordinatorHandle(coordinator_handle) if coordinator_handle is not None else None
        self.model_name = self.config.model.name
        key = self.config.http.resolve_api_key()
        if key is None:
            logger.warning("no API key configured (ROLLOUT_API_KEY or http.api_key_file): the HTTP API is open to anyone who can reach it")
        # Which credential each route takes: the sync part is the coordinator's own decision.
        app.state.auth = AccessPolicy(key, SyncAuth.of(self.config.sync))
        app.state.max_body_bytes = self.config.http.max_body_bytes

    @app.get("/healthz", responses=HEALTH_ERRORS)
    async def healthz(self) -> dict:
        """200 while an engine replica answers. Engines that died (rollout.engine.deaths)
        are reported either way: ``engine_deaths`` (how many, the last one's error) and
        ``crash_loop`` when they keep dying, which replicas restarted in between hide."""
        died = self._engine_deaths()
        loop = crash_loop(died)
        try:
            await self.engine.stats()
        except Exception as e:
            raise EngineUnavailableError(f"no healthy engine replica: {e}" + (f"; {loop}" if loop else "")) from None
        out: dict[str, Any] = {"status": "ok"}
        if died:
            out["engine_deaths"] = {"count": len(died), "last": died[-1].line()}
        if loop:
            out["crash_loop"] = loop
        return out

    def _engine_deaths(self) -> list[EngineDeath]:
        try:
            return read_deaths(self.config.app_name)
        except Exception:  # the record is a report: the probe answers without it
            logger.exception("could not read the engine deaths of app %s", self.config.app_name)
            return []

    @app.get("/v1/stats", dependencies=[Depends(require_key)], responses=STATS_ERRORS)
    async def engine_stats(self) -> ReplicaLoad:
        """One engine replica's load and weight version: the replica the ingress's router
        picks, as ``RolloutClient.stats()`` answers over a Serve handle (``replica_id``
        names it). Not a sum over replicas: loads of different replicas (a fraction of KV
        cache in use, a weight version) do not add up; the fleet is ``rollout status``
        and the metrics."""
        return await self.engine.stats()

    @app.post("/v1/rollouts", dependencies=[Depends(require_key)], responses=REQUEST_ERRORS)
    async def rollouts(self, batch: RolloutBatch) -> RolloutBatchResult:
        return RolloutBatchResult(results=await self.engine.generate(batch.requests))

    @app.post(
        "/v1/rollouts/stream",
        dependencies=[Depends(require_key)],
        response_class=NdjsonResponse,
        responses={200: {"model": RolloutChunk, "description": "One `RolloutChunk` per line."}, **REQUEST_ERRORS},
    )
    async def rollouts_stream(self, request: RolloutRequest) -> NdjsonResponse:
        try:
            _, chunks = await _first_then_rest(self.engine.stream(request))
        except InvalidRequestError as e:
            # The replica checks a stream as a batch of one; this body is the request itself.
            raise InvalidRequestError(e.field.removeprefix("requests[0]").removeprefix(".") or "body", e.message) from None

        async def ndjson():
            async for c in chunks:
                yield c.model_dump_json(exclude_none=True) + "\n"

        return NdjsonResponse(ndjson())

    # ---- episodes: each call goes to the replica holding the episode (its id names it) --

    @app.post("/v1/episodes", dependencies=[Depends(require_key)], responses=REQUEST_ERRORS)
    async def episode_start(self, start: EpisodeStart) -> EpisodeStarted:
        return await self.engine.start_episode(start)

    @app.post("/v1/episodes/{episode_id}/turns", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_turn(self, episode_id: str, body: EpisodeTurnBody) -> TurnResult:
        return await self.engine.episode_turn(EpisodeTurn(episode_id=episode_id, messages=body.messages, sampling=body.sampling, tool_choice=body.tool_choice))

    @app.get("/v1/episodes/{episode_id}", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_get(self, episode_id: str) -> Trajectory:
        return await self.engine.episode_trajectory(EpisodeRef(episode_id=episode_id), end=False)

    @app.delete("/v1/episodes/{episode_id}", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_end(self, episode_id: str) -> Trajectory:
        return await self.engine.episode_trajectory(EpisodeRef(episode_id=episode_id), end=True)

    # ---- the OpenAI routes: vLLM's own server on the replica the router picks ----------

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        root = request.scope.get("root_path", "")
        path = request.url.path[len(root):] if root and request.url.path.startswith(root) else request.url.path
        # Our credentials stay here: the replica's vLLM server runs without a key of its own.
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in ("authorization", "host", SYNC_TOKEN_HEADER.lower()))
        forwarded = ForwardedRequest(request.method, path, request.url.query, headers, body)
        hint, streams = routing_hint(path, body, request.headers.get(SESSION_HEADER))
        # Retried once on another replica when the first refused it before answering, as
        # the token routes are (HandleTransport).
        if not streams:
            # One Serve call for the whole answer: a stream costs a call's worth of work per item.
            start, content = await self.engine.openai_unary(hint, forwarded)
            return Response(content, status_code=start["status"], headers=dict(start["headers"]))
        start, rest = await self.engine.openai(hint, forwarded)
        return StreamingResponse(rest, status_code=start["status"], headers=dict(start["headers"]))

    # vLLM's OpenAI routes, answered by one replica's own OpenAI app: one handler, so
    # every route gets the same key check, routing and headers.
    @app.post("/v1/completions", dependencies=[Depends(require_key)], include_in_schema=False)
    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)], include_in_schema=False)
    @app.get("/v1/models", dependencies=[Depends(require_key)], include_in_schema=False)
    @app.post("/tokenize", dependencies=[Depends(require_key)], include_in_schema=False)
    @app.post("/detokenize", dependencies=[Depends(require_key)], include_in_schema=False)
    @app.post("/inference/v1/generate", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_route(self, request: Request):
        return await self._forward(request)

    # ---- weight sync control plane (tensors travel over the round's transfer group) ----

    def _coordinator(self) -> CoordinatorHandle:
        if self.coordinator is None:
            raise SyncError("weight sync is disabled on this platform (sync.enabled: false)")
        return self.coordinator

    @app.post("/v1/sync/rounds", responses=SYNC_ERRORS)
    async def sync_begin(self, body: BeginRoundBody, token: SyncCredential) -> dict:
        plan = await self._coordinator().begin_round(token, body.request())
        return PLAN.dump_python(plan, mode="json")

    @app.post("/v1/sync/storage-rounds", responses=SYNC_ERRORS)
    async def sync_begin_storage(self, body: StorageRoundBody, token: SyncCredential) -> dict:
        # Finished like any round: POST /v1/sync/rounds/{round_id}/finish.
        plan = await self._coordinator().begin_storage(token, body.request())
        return STORAGE_PLAN.dump_python(plan, mode="json")

    @app.post("/v1/sync/adapter-rounds", responses=SYNC_ERRORS)
    async def sync_publish_adapter(self, body: AdapterBody, token: SyncCredential) -> dict:
        # One call: nothing is sent besides the body, so the answer is the round's outcome.
        outcome = await self._coordinator().publish_adapter(token, body.request())
        return OUTCOME.dump_python(outcome, mode="json")

    @app.post("/v1/sync/adapter-removals", responses=ADAPTER_SYNC_ERRORS)
    async def sync_unload_adapter(self, body: AdapterRemovalBody, token: SyncCredential) -> dict:
        # One call, like a publish: every replica stops serving it, all or none; the answer
        # is the round's outcome (404 naming `name` for an adapter not published).
        outcome = await self._coordinator().unload_adapter(token, body.name)
        return OUTCOME.dump_python(outcome, mode="json")

    @app.post("/v1/sync/rounds/{round_id}/finish", responses=SYNC_ERRORS)
    async def sync_finish(self, round_id: str, body: FinishBody, token: SyncCredential) -> dict:
        # The sync token, as for opening the round: the round id is public in /v1/sync/status.
        outcome = await self._coordinator().finish(token, round_id, body.error, body.digests, body.wait)
        return OUTCOME.dump_python(outcome, mode="json")

    @app.get("/v1/sync/status", dependencies=[Depends(require_key)], responses=SYNC_ERRORS)
    async def sync_status(self) -> dict:
        return await self._coordinator().status()
