"""The HTTP transport's typed calls (rollout.client.http.HttpTransport) against a fake
ingress (httpx's MockTransport): paths, bodies and answers, without a platform. The e2e
modules drive the same calls against the real ingress."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollout.api import EpisodeRef, EpisodeStart, EpisodeTurn
from rollout.client.http import HttpTransport
from rollout.contracts.load import ReplicaLoad
from rollout.errors import EngineUnavailableError, EpisodeLostError


def transport(answer) -> tuple[HttpTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer(request)

    t = HttpTransport("http://ingress", "key", 5.0)
    t._client = httpx.AsyncClient(base_url="http://ingress", headers=t._client.headers, transport=httpx.MockTransport(handler))
    return t, seen


def test_stats_gets_one_replicas_load_typed():
    load = ReplicaLoad(replica_id="r1", running=2, waiting=0, kv_cache_usage=0.25, weight_version="3", max_num_seqs=8)
    t, seen = transport(lambda r: httpx.Response(200, content=load.model_dump_json()))
    got = asyncio.run(t.stats())
    assert got == load and isinstance(got, ReplicaLoad)
    assert (seen[0].method, seen[0].url.path, seen[0].headers["authorization"]) == ("GET", "/v1/stats", "Bearer key")


def test_stats_raises_the_typed_error_of_the_answer():
    body = {"error": {"type": "engine_unavailable", "message": "no healthy engine replica"}}
    t, _ = transport(lambda r: httpx.Response(503, json=body))
    with pytest.raises(EngineUnavailableError, match="no healthy engine replica"):
        asyncio.run(t.stats())


def test_the_episode_calls_go_to_their_routes():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/episodes":
            return httpx.Response(200, json={"episode_id": "r1.e", "replica_id": "r1", "prompt_token_ids": [1, 2]})
        if request.url.path.endswith("/turns"):
            return httpx.Response(404, json={"error": {"type": "episode_lost", "message": "gone"}})
        raise AssertionError(request.url.path)

    t, seen = transport(answer)
    started = asyncio.run(t.start_episode(EpisodeStart(messages=[{"role": "user", "content": "hi"}])))
    assert started.episode_id == "r1.e" and json.loads(seen[0].content)["messages"][0]["content"] == "hi"
    with pytest.raises(EpisodeLostError, match="gone"):
        asyncio.run(t.episode_turn(EpisodeTurn(episode_id="r1.e", messages=[])))
    assert "episode_id" not in json.loads(seen[1].content), "the id travels in the path"


@pytest.mark.parametrize("end,verb", [(False, "GET"), (True, "DELETE")])
def test_a_trajectory_is_read_or_ended_by_its_verb(end, verb):
    t, seen = transport(lambda r: httpx.Response(503, json={"error": {"message": "x"}}))
    with pytest.raises(EngineUnavailableError):
        asyncio.run(t.episode_trajectory(EpisodeRef(episode_id="r1.e"), end))
    assert (seen[0].method, seen[0].url.path) == (verb, "/v1/episodes/r1.e")
