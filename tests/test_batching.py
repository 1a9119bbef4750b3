from __future__ import annotations

import asyncio

import pytest

from rollout.batching import fan_out


async def test_fan_out_preserves_order_and_passes_offsets():
    calls = []

    async def call(chunk, offset):
        calls.append((offset, len(chunk)))
        await asyncio.sleep(0.01 * (5 - offset // 3))
        return [x * 10 for x in chunk]

    assert await fan_out(call, list(range(13)), 3) == [x * 10 for x in range(13)]
    assert sorted(calls) == [(0, 3), (3, 3), (6, 3), (9, 3), (12, 1)]


async def test_fan_out_cancels_the_other_chunks_when_one_fails():
    cancelled = []

    async def call(chunk, offset):
        if offset == 0:
            raise ValueError("bad chunk")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(offset)
            raise
        return chunk

    with pytest.raises(ValueError, match="bad chunk"):
        await fan_out(call, list(range(6)), 2)
    assert sorted(cancelled) == [2, 4]
