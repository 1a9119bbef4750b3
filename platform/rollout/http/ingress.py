"""The HTTP ingress: our token-level API plus OpenAI-compatible endpoints (FastAPI in Serve)."""

from __future__ import annotations

import hmac
import logging
import math
from typing import Any, AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from ray import serve

from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, EpisodeTurnBody, Trajectory, TurnResult, RolloutBatch, RolloutBatchResult, RolloutChunk, RolloutRequest
from rollout.client.handle import HandleTransport
from rollout.config import PlatformConfig
from rollout.errors import (
    AuthenticationError,
    EngineUnavailableError,
    InvalidRequestError,
    OverloadedError,
    StaleWeightsError,
    as_overloaded,
    loc_to_field,
    unwrap_remote,
)
from rollout.logs import show_platform_logs
from rollout.engine.openai_app import ForwardedRequest, routing_hint
from rollout.episodes import EpisodeLostError
from rollout.sync.auth import SyncAuth
from rollout.sync.protocol import SyncError
from rollout.sync.remote import OUTCOME, PLAN, SYNC_TOKEN_HEADER, BeginRoundBody, FinishBody

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-ID"  # what agent frameworks send to keep a conversation on one replica

from rollout.http.routes_app import EPISODE_ERRORS, REQUEST_ERRORS, SYNC_ERRORS, app  # noqa: E402  (the routes below and in rl_routes share it)
from rollout.http.rl_routes import VllmRlRoutes  # noqa: E402



class NdjsonResponse(StreamingResponse):
    """One JSON document per line (what the schema says the stream route answers)."""

    media_type = "application/x-ndjson"


def _error(status: int, message: str, field: Optional[str] = None, kind: str = "invalid_request_error") -> JSONResponse:
    body: dict[str, Any] = {"message": message, "type": kind}
    if field is not None:
        body["field"] = field
    return JSONResponse(status_code=status, content={"error": body})


@app.exception_handler(RequestValidationError)
async def _on_schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, InvalidRequestError):
        # A model's own rule (a validator) that names the field it is about.
        return _error(400, str(raised), raised.field)
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = loc_to_field(loc) or "body"
    return _error(400, f"{field}: {first.get('msg')}", field)


@app.exception_handler(HTTPException)
async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    # FastAPI's own refusals (a body that is not JSON, an unknown route or method) in the
    # same error body as every other answer.
    field = "body" if exc.status_code == 400 else None
    response = _error(exc.status_code, f"{field}: {exc.detail}" if field else str(exc.detail), field)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


@app.exception_handler(InvalidRequestError)
async def _on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return _error(400, str(exc), exc.field)


@app.exception_handler(EpisodeLostError)
async def _on_episode_lost(request: Request, exc: EpisodeLostError) -> JSONResponse:
    return _error(404, str(exc), kind="episode_lost")


@app.exception_handler(AuthenticationError)
async def _on_auth(request: Request, exc: AuthenticationError) -> JSONResponse:
    return _error(401, str(exc), kind="authentication_error")


@app.exception_handler(SyncError)
async def _on_sync_error(request: Request, exc: SyncError) -> JSONResponse:
    return _error(409, str(exc), kind="sync_error")


@app.exception_handler(StaleWeightsError)
async def _on_stale(request: Request, exc: StaleWeightsError) -> JSONResponse:
    # The service is healthy; the policy version the request asked for is not served (yet):
    # a conflict with the current state, to retry once that version is committed.
    return _error(409, str(exc), kind="stale_weights")


@app.exception_handler(OverloadedError)
async def _on_overloaded(request: Request, exc: OverloadedError) -> JSONResponse:
    response = _error(429, str(exc), kind="overloaded")
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    return response


@app.exception_handler(EngineUnavailableError)
async def _on_unavailable(request: Request, exc: EngineUnavailableError) -> JSONResponse:
    return _error(503, str(exc), kind="engine_unavailable")


class _ApiKey:
    """Bearer-token check; a constant-time comparison so the key cannot be timed out of us."""

    def __init__(self, key: Optional[str]):
        self.key = key

    def __call__(self, request: Request) -> None:
        if self.key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), self.key.encode()):
            raise AuthenticationError("wrong API key")


def require_key(request: Request) -> None:
    # The ingress replica installs its checker on app.state at start-up.
    check = getattr(request.app.state, "api_key", None)
    if check is None:
        raise AuthenticationError("the ingress is not initialised")
    check(request)


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
        self.engine_handle = engine_handle
        self.engine = HandleTransport(engine_handle, self.config.deployment.client_batch_size)
        self.coordinator = coordinator_handle
        self.model_name = self.config.model.name
        key = self.config.http.resolve_api_key()
        if key is None:
            logger.warning("no API key configured (ROLLOUT_API_KEY or http.api_key_file): the HTTP API is open to anyone who can reach it")
        app.state.api_key = _ApiKey(key)
        self.sync_auth = SyncAuth.of(self.config.sync)  # whether the sync routes need the sync token (as the coordinator decides)
        app.state.max_body_bytes = self.config.http.max_body_bytes

    @app.get("/healthz", responses={503: REQUEST_ERRORS[503]})
    async def healthz(self) -> dict:
        try:
            await self.engine.stats()
        except Exception as e:
            raise EngineUnavailableError(f"no healthy engine replica: {e}") from None
        return {"status": "ok"}

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
        return await self.engine.call("start_episode", start)

    @app.post("/v1/episodes/{episode_id}/turns", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_turn(self, episode_id: str, body: EpisodeTurnBody) -> TurnResult:
        return await self.engine.call("episode_turn", EpisodeTurn(episode_id=episode_id, messages=body.messages, sampling=body.sampling, tool_choice=body.tool_choice))

    @app.get("/v1/episodes/{episode_id}", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_get(self, episode_id: str) -> Trajectory:
        return await self.engine.call("episode_trajectory", EpisodeRef(episode_id=episode_id), False)

    @app.delete("/v1/episodes/{episode_id}", dependencies=[Depends(require_key)], responses=EPISODE_ERRORS)
    async def episode_end(self, episode_id: str) -> Trajectory:
        return await self.engine.call("episode_trajectory", EpisodeRef(episode_id=episode_id), True)

    # ---- the OpenAI routes: vLLM's own server on the replica the router picks ----------

    async def _forward(self, request: Request) -> StreamingResponse:
        body = await request.body()
        root = request.scope.get("root_path", "")
        path = request.url.path[len(root):] if root and request.url.path.startswith(root) else request.url.path
        # Our credentials stay here: the replica's vLLM server runs without a key of its own.
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in ("authorization", "host", SYNC_TOKEN_HEADER.lower()))
        forwarded = ForwardedRequest(request.method, path, request.url.query, headers, body)
        hint = routing_hint(path, body, request.headers.get(SESSION_HEADER))
        parts = self.engine_handle.options(stream=True).openai_http.remote(hint, forwarded)
        try:
            start = await parts.__anext__()
        except Exception as e:
            raise as_overloaded(unwrap_remote(e)) from None

        async def rest():
            async for chunk in parts:
                yield chunk

        return StreamingResponse(rest(), status_code=start["status"], headers=dict(start["headers"]))

    @app.post("/v1/completions", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_completions(self, request: Request):
        return await self._forward(request)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_chat_completions(self, request: Request):
        return await self._forward(request)

    @app.get("/v1/models", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_models(self, request: Request):
        return await self._forward(request)

    @app.post("/tokenize", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_tokenize(self, request: Request):
        return await self._forward(request)

    @app.post("/detokenize", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_detokenize(self, request: Request):
        return await self._forward(request)

    @app.post("/inference/v1/generate", dependencies=[Depends(require_key)], include_in_schema=False)
    async def openai_generate(self, request: Request):
        return await self._forward(request)

    # ---- weight sync control plane (tensors travel over the round's transfer group) ----

    def _coordinator(self):
        if self.coordinator is None:
            raise SyncError("weight sync is disabled on this platform (sync.enabled: false)")
        return self.coordinator

    async def _call_coordinator(self, method: str, *args):
        try:
            return await getattr(self._coordinator(), method).remote(*args)
        except Exception as e:
            raise unwrap_remote(e) from None

    @app.post("/v1/sync/rounds", dependencies=[Depends(require_key)], responses=SYNC_ERRORS)
    async def sync_begin(self, body: BeginRoundBody, request: Request) -> dict:
        plan = await self._call_coordinator("begin_round", request.headers.get(SYNC_TOKEN_HEADER), body.request())
        return PLAN.dump_python(plan, mode="json")

    @app.post("/v1/sync/rounds/{round_id}/finish", dependencies=[Depends(require_key)], responses=SYNC_ERRORS)
    async def sync_finish(self, round_id: str, body: FinishBody, request: Request) -> dict:
        # The sync token, as for opening the round: the round id is public in /v1/sync/status.
        outcome = await self._call_coordinator("finish", request.headers.get(SYNC_TOKEN_HEADER), round_id, body.error)
        return OUTCOME.dump_python(outcome, mode="json")

    @app.get("/v1/sync/status", dependencies=[Depends(require_key)], responses=SYNC_ERRORS)
    async def sync_status(self) -> dict:
        return await self._call_coordinator("status")
