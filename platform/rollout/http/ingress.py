"""The HTTP ingress: our token-level API plus OpenAI-compatible endpoints (FastAPI in Serve)."""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve

from rollout.api import RolloutBatch, RolloutBatchResult, RolloutChunk, RolloutRequest
from rollout.client.handle import HandleTransport
from rollout.config import PlatformConfig
from rollout.errors import (
    AuthenticationError,
    EngineUnavailableError,
    InvalidRequestError,
    from_validation_error,
    loc_to_field,
    unwrap_remote,
)
from rollout.http import openai_compat as oai
from rollout.sync.protocol import SyncError
from rollout.sync.remote import OUTCOME, PLAN, SYNC_TOKEN_HEADER, BeginRoundBody, FinishBody

logger = logging.getLogger(__name__)

from rollout.http.routes_app import app  # noqa: E402  (the routes below and in rl_routes share it)
from rollout.http.rl_routes import VllmRlRoutes  # noqa: E402


def _error(status: int, message: str, field: Optional[str] = None, kind: str = "invalid_request_error") -> JSONResponse:
    body: dict[str, Any] = {"message": message, "type": kind}
    if field is not None:
        body["field"] = field
    return JSONResponse(status_code=status, content={"error": body})


@app.exception_handler(RequestValidationError)
async def _on_schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = loc_to_field(loc) or "body"
    return _error(400, f"{field}: {first.get('msg')}", field)


@app.exception_handler(InvalidRequestError)
async def _on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return _error(400, str(exc), exc.field)


@app.exception_handler(AuthenticationError)
async def _on_auth(request: Request, exc: AuthenticationError) -> JSONResponse:
    return _error(401, str(exc), kind="authentication_error")


@app.exception_handler(SyncError)
async def _on_sync_error(request: Request, exc: SyncError) -> JSONResponse:
    return _error(409, str(exc), kind="sync_error")


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


def _to_rollout(req: Any) -> RolloutRequest:
    try:
        return req.to_rollout()
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_model(name: Optional[str], served: str) -> None:
    if name is not None and name != served:
        raise InvalidRequestError("model", f"unknown model {name!r}; this service serves {served!r}")


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
        self.config = PlatformConfig.model_validate(config)
        self.engine = HandleTransport(engine_handle, self.config.deployment.client_batch_size)
        self.coordinator = coordinator_handle
        self.model_name = self.config.model.name
        key = self.config.http.resolve_api_key()
        if key is None:
            logger.warning("no API key configured (ROLLOUT_API_KEY or http.api_key_file): the HTTP API is open to anyone who can reach it")
        app.state.api_key = _ApiKey(key)

    @app.get("/healthz")
    async def healthz(self) -> dict:
        try:
            await self.engine.stats()
        except Exception as e:
            raise EngineUnavailableError(f"no healthy engine replica: {e}") from None
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rollout"}]}

    @app.post("/v1/rollouts", dependencies=[Depends(require_key)])
    async def rollouts(self, batch: RolloutBatch) -> RolloutBatchResult:
        return RolloutBatchResult(results=await self.engine.generate(batch.requests))

    @app.post("/v1/rollouts/stream", dependencies=[Depends(require_key)])
    async def rollouts_stream(self, request: RolloutRequest) -> StreamingResponse:
        _, chunks = await _first_then_rest(self.engine.stream(request))

        async def ndjson():
            async for c in chunks:
                yield c.model_dump_json(exclude_none=True) + "\n"

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    async def _openai(self, req: Any, chat: bool):
        _check_model(req.model, self.model_name)
        rollout = _to_rollout(req)
        if not req.stream:
            (result,) = await self.engine.generate([rollout])
            return (oai.chat_response if chat else oai.completion_response)(result, self.model_name)
        stream_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        _, chunks = await _first_then_rest(self.engine.stream(rollout))

        async def sse():
            async for c in chunks:
                yield f"data: {json.dumps(oai.stream_event(c, self.model_name, chat, stream_id))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(self, req: oai.CompletionRequest):
        return await self._openai(req, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(self, req: oai.ChatCompletionRequest):
        return await self._openai(req, chat=True)

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

    @app.post("/v1/sync/rounds", dependencies=[Depends(require_key)])
    async def sync_begin(self, body: BeginRoundBody, request: Request) -> dict:
        plan = await self._call_coordinator("begin_round", request.headers.get(SYNC_TOKEN_HEADER), body.request())
        return PLAN.dump_python(plan, mode="json")

    @app.post("/v1/sync/rounds/{round_id}/finish", dependencies=[Depends(require_key)])
    async def sync_finish(self, round_id: str, body: FinishBody) -> dict:
        return OUTCOME.dump_python(await self._call_coordinator("finish", round_id, body.error), mode="json")

    @app.get("/v1/sync/status", dependencies=[Depends(require_key)])
    async def sync_status(self) -> dict:
        return await self._call_coordinator("status")
