"""Transport over the HTTP ingress (trainer outside the Ray cluster)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional, Sequence

import httpx

from rollout.api import EpisodeStarted, RolloutBatch, RolloutBatchResult, RolloutChunk, RolloutRequest, RolloutResult, Trajectory, TurnResult
from rollout.episodes import EpisodeLostError
from rollout.errors import AuthenticationError, EngineUnavailableError, InvalidRequestError, OverloadedError, ReplicaLostError, RolloutError, StaleWeightsError


def raise_for_error(resp: httpx.Response, body: Optional[bytes] = None) -> None:
    """Turn an error response of the ingress into the matching typed exception."""
    if resp.status_code < 400:
        return
    raw = body if body is not None else resp.content
    try:
        err = json.loads(raw).get("error", {})
    except ValueError:
        err = {"message": raw.decode(errors="replace")}
    message = err.get("message", f"HTTP {resp.status_code}")
    if resp.status_code in (401, 403):
        raise AuthenticationError(message)
    if resp.status_code == 404 and err.get("type") == "episode_lost":
        raise EpisodeLostError(message)
    if resp.status_code in (400, 404, 413, 422):
        field = err.get("field", "request")
        # The body's message names the field already (it is the error's str()).
        raise InvalidRequestError(field, message.removeprefix(f"{field}: "))
    if resp.status_code == 409 and err.get("type") == "stale_weights":
        raise StaleWeightsError(message)
    if resp.status_code == 429:
        retry_after = resp.headers.get("retry-after")
        raise OverloadedError(message, float(retry_after) if retry_after else None)
    if resp.status_code == 503:
        raise EngineUnavailableError(message)
    if resp.status_code == 500 and err.get("type") == "internal_error":
        # The ingress answered, with a fault of its own (rollout.http.last_resort): the same
        # request would fail the same way, so it is not retryable.
        raise RolloutError(f"HTTP 500: {message}")
    if resp.status_code >= 500:
        # The ingress answers every failure it knows with a 4xx or 503; any other 5xx is the
        # serving path itself failing (Serve's proxy answers 500 when the ingress replica dies
        # mid-request): retryable.
        raise EngineUnavailableError(f"HTTP {resp.status_code} from the serving path: {message}")
    raise RolloutError(f"HTTP {resp.status_code}: {message}")


class HttpTransport:
    def __init__(self, base_url: str, api_key: Optional[str], timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def _request(self, method: str, path: str, body: Optional[dict] = None) -> httpx.Response:
        try:
            resp = await self._client.request(method, path, json=body)
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(f"{path}: no answer within the client's timeout_s ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise EngineUnavailableError(f"{path}: the connection to the ingress broke ({type(e).__name__}: {e})") from None
        raise_for_error(resp)
        return resp

    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        resp = await self._request("POST", "/v1/rollouts", RolloutBatch(requests=list(requests)).model_dump(mode="json", exclude_none=True))
        return RolloutBatchResult.model_validate_json(resp.content).results

    async def call(self, method: str, *args: Any) -> Any:
        """The episode calls, over their routes."""
        if method == "start_episode":
            (start,) = args
            resp = await self._request("POST", "/v1/episodes", start.model_dump(mode="json", exclude_none=True))
            return EpisodeStarted.model_validate_json(resp.content)
        if method == "episode_turn":
            (turn,) = args
            body = turn.model_dump(mode="json", exclude_none=True, exclude={"episode_id"})
            resp = await self._request("POST", f"/v1/episodes/{turn.episode_id}/turns", body)
            return TurnResult.model_validate_json(resp.content)
        if method == "episode_trajectory":
            ref, end = args
            resp = await self._request("DELETE" if end else "GET", f"/v1/episodes/{ref.episode_id}")
            return Trajectory.model_validate_json(resp.content)
        raise ValueError(f"no HTTP route for engine method {method!r}")

    async def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]:
        body = request.model_dump(mode="json", exclude_none=True)
        sent: dict[int, list[int]] = {}  # sample index -> token ids already yielded
        try:
            async with self._client.stream("POST", "/v1/rollouts/stream", json=body) as resp:
                if resp.status_code >= 400:
                    raise_for_error(resp, await resp.aread())
                async for line in resp.aiter_lines():
                    if line.strip():
                        chunk = RolloutChunk.model_validate_json(line)
                        sent.setdefault(chunk.index, []).extend(chunk.token_ids)
                        yield chunk
        except httpx.TransportError as e:
            # A stream cut mid-way (the ingress or its replica died): typed, with what arrived.
            raise ReplicaLostError(f"/v1/rollouts/stream broke off ({type(e).__name__}: {e})", sent) from None

    async def close(self) -> None:
        await self._client.aclose()
