"""``client.stream(requests, max_in_flight=8)`` against the real platform (one replica here,
so its engine's own count of unfinished requests is everything in flight): never more than
8 at the engine, all 200 results exactly once; leaving midway leaves nothing running."""

from __future__ import annotations

import asyncio

import pytest

from rollout.api import RolloutRequest, SamplingConfig
from rollout.client import Eval
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

MAX_IN_FLIGHT = 8


def requests(k: int):
    return [RolloutRequest(prompt_token_ids=[7 + i % 50, 8, 9], request_id=f"s{i}", sampling=SamplingConfig(max_tokens=12, ignore_eos=True)) for i in range(k)]


async def engine_in_flight(client, seen: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.append((await client.stats()).unfinished_requests)
        await asyncio.sleep(0.01)


async def test_two_hundred_requests_never_more_than_eight_at_the_engine_each_result_once(handle_client):
    seen: list[int] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(engine_in_flight(handle_client, seen, stop))
    mixed = [Eval(r) if i % 10 == 0 else r for i, r in enumerate(requests(200))]
    stream = handle_client.stream(mixed, max_in_flight=MAX_IN_FLIGHT)
    train = [r async for r in stream]
    evals = [r async for r in stream.evals()]
    stop.set()
    await watcher
    assert sorted(r.request_id for r in train) == sorted(f"s{i}" for i in range(200) if i % 10)
    assert sorted(r.request_id for r in evals) == sorted(f"s{i}" for i in range(0, 200, 10))
    assert all(len(r.samples[0].token_ids) == 12 for r in train + evals)
    assert 0 < max(seen) <= MAX_IN_FLIGHT, max(seen)
    print(f"engine in flight: max {max(seen)} over {len(seen)} polls")


async def test_leaving_midway_leaves_nothing_running(handle_client):
    stream = handle_client.stream(requests(200), max_in_flight=MAX_IN_FLIGHT)
    got = 0
    async for _ in stream:
        got += 1
        if got == 50:
            break
    await stream.aclose()
    await wait_until(lambda: _idle(handle_client), timeout_s=10, interval_s=0.1)
    assert stream.sent <= 50 + MAX_IN_FLIGHT


async def _idle(client) -> bool:
    return (await client.stats()).unfinished_requests == 0
