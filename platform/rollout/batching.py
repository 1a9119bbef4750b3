"""Splitting a batch of requests into per-call chunks and putting the answers back in order."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def fan_out(
    call: Callable[[Sequence[T], int], Awaitable[list[R]]],
    items: Sequence[T],
    chunk_size: int,
) -> list[R]:
    """Run ``call(chunk, offset)`` for every chunk concurrently; concatenate in order.

    ``offset`` is the chunk's first index in ``items`` (for error messages).

    Chunks let Serve's router spread a large batch over replicas while keeping the
    number of calls (and their per-call CPU cost) small.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    try:
        # A failing chunk cancels the others: no engine work for a batch already lost.
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(call(items[o : o + chunk_size], o)) for o in range(0, len(items), chunk_size)]
    except* BaseException as eg:
        raise eg.exceptions[0] from None
    return [r for t in tasks for r in t.result()]
