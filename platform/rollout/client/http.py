"""Transport over the HTTP ingress (trainer outside the Ray cluster)."""

from __future__ import annotations

import os
from typing import Any, AsyncIterator, Optional, Sequence

import httpx

from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, RolloutBatch, RolloutBatchResult, RolloutChunk, RolloutRequest, RolloutResult, Trajectory, TurnResult
from rollout.contracts.load import ReplicaLoad
from rollout.contracts.sync_protocol import SYNC_TOKEN_ENV
from rollout.errors import EngineUnavailableError, ReplicaLostError
from rollout.sync.auth import SYNC_TOKEN_HEADER
from rollout.wire_errors import decode


def raise_for_error(resp: httpx.Response, body: Optional[bytes] = None) -> None:
    """Turn an error response of the ingress into the matching typed exception
    (:func:`rollout.wire_errors.decode`: the table the ingress answers from)."""
    error = decode(resp.status_code, body if body is not None else resp.content, resp.headers)
    if error is not None:
        raise error


class HttpTransport:
    def __init__(self, base_url: str, api_key: Optional[str], timeout_s: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    async def _request(self, method: str, path: str, body: Optional[dict] = None, params: Any = None, headers: Optional[dict] = None) -> httpx.Response:
        try:
            resp = await self._client.request(method, path, json=body, params=params, headers=headers)
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(f"{path}: no answer within the client's timeout_s ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise EngineUnavailableError(f"{path}: the connection to the ingress broke ({type(e).__name__}: {e})") from None
        raise_for_error(resp)
        return resp

    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        resp = await self._request("POST", "/v1/rollouts", RolloutBatch(requests=list(requests)).model_dump(mode="json", exclude_none=True))
        return RolloutBatchResult.model_validate_json(resp.content).results

    # ---- episodes, over their routes ---------------------------------------------------

    async def start_episode(self, start: EpisodeStart) -> EpisodeStarted:
        resp = await self._request("POST", "/v1/episodes", start.model_dump(mode="json", exclude_none=True))
        return EpisodeStarted.model_validate_json(resp.content)

    async def episode_turn(self, turn: EpisodeTurn) -> TurnResult:
        body = turn.model_dump(mode="json", exclude_none=True, exclude={"episode_id"})
        resp = await self._request("POST", f"/v1/episodes/{turn.episode_id}/turns", body)
        return TurnResult.model_validate_json(resp.content)

    async def episode_trajectory(self, ref: EpisodeRef, end: bool) -> Trajectory:
        resp = await self._request("DELETE" if end else "GET", f"/v1/episodes/{ref.episode_id}")
        return Trajectory.model_validate_json(resp.content)

    async def stats(self) -> ReplicaLoad:
        """``GET /v1/stats``: the load of the replica the ingress's router picks."""
        resp = await self._request("GET", "/v1/stats")
        return ReplicaLoad.model_validate_json(resp.content)

    # ---- sleep and wake: vLLM's routes, over every replica ---------------------------------

    @staticmethod
    def _sync_headers(token: Optional[str]) -> dict:
        token = token if token is not None else os.environ.get(SYNC_TOKEN_ENV)
        return {SYNC_TOKEN_HEADER: token} if token else {}

    async def sleep(self, level: int, mode: str, token: Optional[str]) -> None:
        await self._request("POST", "/sleep", params={"level": level, "mode": mode}, headers=self._sync_headers(token))

    async def wake_up(self, tags: Optional[tuple[str, ...]], token: Optional[str]) -> bool:
        resp = await self._request("POST", "/wake_up", params=[("tags", t) for t in tags or ()], headers=self._sync_headers(token))
        return resp.json()["status"] == "awake"

    async def is_sleeping(self, token: Optional[str]) -> bool:
        return bool((await self._request("GET", "/is_sleeping", headers=self._sync_headers(token))).json()["is_sleeping"])

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
