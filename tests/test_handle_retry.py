"""HandleTransport when a replica dies: a call that returned no token is sent again once
(Serve's router has dropped the dead replica by then); a stream that already yielded
tokens ends with ReplicaLostError carrying them. Serve's handle is stood in for."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from rollout.api import RolloutChunk, RolloutRequest, RolloutResult
from rollout.client.handle import HandleTransport
from rollout.errors import ReplicaLostError


class Calls:
    """``handle.<method>.remote(...)`` answering from a script: an exception is raised, a
    list is returned (unary) or yielded from (stream)."""

    def __init__(self, script):
        self.script = list(script)
        self.count = 0
        self.kwargs: list[dict] = []

    def remote(self, *args, **kwargs):
        self.count += 1
        self.kwargs.append(kwargs)
        step = self.script.pop(0)
        return Answer(step)


class Answer:
    def __init__(self, step):
        self.step = step

    def __await__(self):
        async def run():
            if isinstance(self.step, BaseException):
                raise self.step
            return self.step

        return run().__await__()

    def __aiter__(self):
        # One iteration, as Serve's response generator: __anext__ and async for share it.
        async def run():
            for item in self.step:
                if isinstance(item, BaseException):
                    raise item
                yield item

        if not hasattr(self, "_items"):
            self._items = run()
        return self._items

    def __anext__(self):
        return self.__aiter__().__anext__()

    def cancel(self):
        pass


class FakeHandle:
    def __init__(self, generate=(), stream=(), openai=()):
        self.generate = Calls(generate)
        self.generate_stream = Calls(stream)
        self.openai_http = Calls(openai)

    def options(self, stream=False):
        return self


def result(i: int) -> RolloutResult:
    return RolloutResult(request_id=f"r{i}", prompt_token_ids=[1], samples=[])


REQ = RolloutRequest(request_id="q", prompt_token_ids=[1, 2])


async def test_a_call_whose_replica_died_is_sent_once_more_and_answered():
    handle = FakeHandle(generate=[ActorDiedError(), [result(0)]])
    transport = HandleTransport(handle, batch_size=8)
    assert await transport.generate([REQ]) == [result(0)]
    assert handle.generate.count == 2 and transport.retried_calls == 1


async def test_a_second_death_ends_the_call_with_a_typed_retryable_error():
    transport = HandleTransport(FakeHandle(generate=[ActorDiedError(), ActorDiedError()]), batch_size=8)
    with pytest.raises(ReplicaLostError, match="replica serving the request died"):
        await transport.generate([REQ])


async def test_a_stream_restarts_only_before_its_first_token_and_otherwise_carries_its_tokens():
    chunk = RolloutChunk(request_id="q", index=0, token_ids=[7, 8])
    fresh = HandleTransport(FakeHandle(stream=[[ActorDiedError()], [chunk]]), batch_size=8)
    assert [c async for c in fresh.stream(REQ)] == [chunk]
    broken = HandleTransport(FakeHandle(stream=[[chunk, ActorDiedError()]]), batch_size=8)
    got = []
    with pytest.raises(ReplicaLostError) as exc:
        async for c in broken.stream(REQ):
            got.append(c)
    assert got == [chunk] and exc.value.tokens_so_far == {0: [7, 8]} and broken.retried_calls == 0


async def test_a_call_with_no_answer_ends_at_the_clients_deadline_with_a_retryable_error():
    import asyncio

    from rollout.errors import EngineUnavailableError

    class Never(Answer):
        def __await__(self):
            return asyncio.Event().wait().__await__()

    handle = FakeHandle()
    handle.generate.remote = lambda *args, **kwargs: Never(None)
    transport = HandleTransport(handle, batch_size=8, timeout_s=0.2)
    with pytest.raises(EngineUnavailableError, match="no answer within 0.2s"):
        await transport.generate([REQ])


async def test_a_call_a_replica_refused_is_sent_once_more_avoiding_that_replica():
    from rollout.errors import NotServingError

    refused = NotServingError("replica r1: LoRA adapter 'math' version 2 is committed but not loaded here", "r1")
    handle = FakeHandle(generate=[refused, [result(0)]], stream=[[refused], [RolloutChunk(request_id="q", index=0, token_ids=[7])]])
    transport = HandleTransport(handle, batch_size=8)
    assert await transport.generate([REQ]) == [result(0)]
    assert [k.get("avoid_replica") for k in handle.generate.kwargs] == [None, "r1"], "the router ranks r1 last for the retry"
    assert len([c async for c in transport.stream(REQ)]) == 1
    assert [k.get("avoid_replica") for k in handle.generate_stream.kwargs] == [None, "r1"]


async def test_an_openai_call_a_replica_refused_before_answering_is_sent_once_more_and_a_second_refusal_is_typed():
    import pickle

    from rollout import wire_errors as wire
    from rollout.engine.openai_app import ForwardedRequest
    from rollout.errors import NotServingError

    request = ForwardedRequest("POST", "/v1/completions", "", (), b'{"model": "math", "prompt": "x"}')
    refused = NotServingError("replica r1: LoRA adapter 'math' version 2 is committed but not loaded here", "r1")
    start = {"status": 200, "headers": [("content-type", "application/json")]}
    handle = FakeHandle(openai=[[refused], [start, b"{", b"}"]])
    transport = HandleTransport(handle, batch_size=8)
    got, rest = await transport.openai({"prompt": "x"}, request)
    assert got == start and b"".join([c async for c in rest]) == b"{}"
    assert [k.get("avoid_replica") for k in handle.openai_http.kwargs] == [None, "r1"] and transport.retried_calls == 1

    again = pickle.loads(pickle.dumps(refused))  # as Ray carries it back from the replica
    transport = HandleTransport(FakeHandle(openai=[[refused], [again]]), batch_size=8)
    with pytest.raises(NotServingError, match="committed but not loaded here") as e:
        await transport.openai({}, request)
    assert e.value.replica_id == "r1"
    # What the ingress answers: the platform's retryable 503, in the OpenAI-shaped error body.
    answer = wire.encode(e.value)
    assert answer.status == 503 and answer.body["error"]["type"] == "engine_unavailable" and "'math'" in answer.body["error"]["message"]
    assert wire.retryable(wire.decode(answer.status, json_bytes(answer.body), {}))


def json_bytes(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()
