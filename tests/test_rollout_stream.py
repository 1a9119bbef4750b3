"""``client.stream(requests, max_in_flight=N)`` on its own: a stand-in client whose calls
take a random time (the e2e test runs the real platform). In flight never above N, every
result exactly once, evals on their own stream, leaving early cancels what is in flight,
a failure ends the stream with its error, requests drawn only as slots free up."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollout.api import RolloutRequest, RolloutResult, Sample
from rollout.client import Eval, RolloutClient
from rollout.errors import EngineUnavailableError


class SlowEngine:
    """Stands in for the transport: answers each call after a random delay, counting calls in flight."""

    def __init__(self, fail_on: str | None = None):
        self.in_flight = 0
        self.most = 0
        self.cancelled = 0
        self.fail_on = fail_on
        self.rng = random.Random(0)

    async def generate(self, requests):
        (req,) = requests
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.rng.uniform(0.001, 0.02))
            if req.request_id == self.fail_on:
                raise EngineUnavailableError(f"{req.request_id} failed")
            return [RolloutResult(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, samples=[Sample(token_ids=[1])])]
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1

    async def close(self):
        pass


def requests(k: int, prefix: str = "r"):
    return [RolloutRequest(prompt_token_ids=[5, i], request_id=f"{prefix}{i}") for i in range(k)]


def client_over(engine: SlowEngine) -> RolloutClient:
    return RolloutClient(lambda: engine, "stand-in")


def test_never_more_than_max_in_flight_and_every_result_exactly_once():
    engine = SlowEngine()

    async def run():
        return [r.request_id async for r in client_over(engine).stream(requests(200), max_in_flight=8)]

    got = asyncio.run(run())
    assert sorted(got) == sorted(f"r{i}" for i in range(200)) and len(got) == 200
    assert engine.most == 8
    assert got != [f"r{i}" for i in range(200)], "results come in finishing order"


def test_a_slow_consumer_holds_the_slots_so_nothing_piles_up():
    engine = SlowEngine()

    async def run():
        stream = client_over(engine).stream(requests(40), max_in_flight=4)
        seen = []
        async for r in stream:
            seen.append(r.request_id)
            assert stream.in_flight <= 4 and engine.in_flight <= 4
            await asyncio.sleep(0.03)  # slower than the engine
        return seen, stream.sent

    seen, sent = asyncio.run(run())
    assert len(seen) == sent == 40


def test_eval_requests_come_on_their_own_stream():
    engine = SlowEngine()

    async def run():
        mixed = [Eval(r) if i % 5 == 0 else r for i, r in enumerate(requests(50))]
        stream = client_over(engine).stream(mixed, max_in_flight=6)
        train = [r.request_id async for r in stream]
        evals = [r.request_id async for r in stream.evals()]
        return train, evals

    train, evals = asyncio.run(run())
    assert sorted(evals) == sorted(f"r{i}" for i in range(0, 50, 5))
    assert sorted(train) == sorted(f"r{i}" for i in range(50) if i % 5)


def test_leaving_early_cancels_everything_in_flight_and_draws_no_more():
    engine = SlowEngine()
    drawn = 0

    def endless():
        nonlocal drawn
        while True:
            drawn += 1
            yield RolloutRequest(prompt_token_ids=[5], request_id=f"e{drawn}")

    async def run():
        stream = client_over(engine).stream(endless(), max_in_flight=8)
        async for k, _ in _enumerate(stream):
            if k == 20:
                break
        await asyncio.sleep(0.05)  # the generator's finalizer runs its aclose
        return drawn

    got_drawn = asyncio.run(run())
    assert engine.in_flight == 0 and engine.cancelled > 0
    assert got_drawn <= 21 + 8 + 1, "requests are drawn only as slots free up"


def test_cancelling_the_consumer_cancels_in_flight_work():
    engine = SlowEngine()

    async def run():
        async def consume():
            async for _ in client_over(engine).stream(requests(100), max_in_flight=8):
                await asyncio.sleep(0.01)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)

    asyncio.run(run())
    assert engine.in_flight == 0


def test_a_failed_request_ends_the_stream_with_its_typed_error():
    engine = SlowEngine(fail_on="r7")

    async def run():
        got = []
        with pytest.raises(EngineUnavailableError, match="r7 failed"):
            async for r in client_over(engine).stream(requests(30), max_in_flight=4):
                got.append(r)
        await asyncio.sleep(0)
        return got

    got = asyncio.run(run())
    assert len(got) < 30 and engine.in_flight == 0


def test_an_async_iterable_of_dicts_works_and_stream_of_one_request_still_streams_tokens():
    engine = SlowEngine()

    async def source():
        for i in range(10):
            yield {"prompt_token_ids": [5, i], "request_id": f"d{i}"}

    async def run():
        return sorted([r.request_id async for r in client_over(engine).stream(source(), max_in_flight=3)])

    assert asyncio.run(run()) == sorted(f"d{i}" for i in range(10))
    with pytest.raises(TypeError, match="needs max_in_flight"):
        client_over(engine).stream(requests(2))
    with pytest.raises(TypeError, match="one request's tokens"):
        client_over(engine).stream(requests(1)[0], max_in_flight=2)


async def _enumerate(aiter):
    k = 0
    async for x in aiter:
        k += 1
        yield k, x


def test_an_iterable_that_raises_ends_the_stream_with_its_error_after_what_was_sent():
    engine = SlowEngine()

    def broken():
        yield from requests(5)
        raise RuntimeError("the dataset ran dry")

    async def run():
        got = []
        with pytest.raises(RuntimeError, match="ran dry"):
            async for r in client_over(engine).stream(broken(), max_in_flight=8):
                got.append(r.request_id)
        await asyncio.sleep(0)
        return got

    asyncio.run(run())
    assert engine.in_flight == 0
