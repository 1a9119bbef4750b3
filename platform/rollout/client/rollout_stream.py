"""``client.stream(requests, max_in_flight=N)``: finished rollouts as they finish, with at
most N requests in flight.

A trainer that wants a steady supply of groups (asynchronous GRPO, off-policy queues)
iterates it instead of waiting on one big ``generate``: each request (a prompt and its
``n`` samples, which stay together in one result) is sent when a slot is free, and its
result is yielded as soon as it is back, in finishing order.

- Backpressure: a slot is held from sending a request until the consumer has taken its
  result, so neither the engines nor this process ever hold more than N; requests are
  drawn from the iterable (sync or async, possibly endless) only as slots free up.
- Evaluation: wrap a request in :class:`Eval` and its result comes on ``stream.evals()``
  instead (an eval result frees its slot as soon as it is back, so a consumer that reads
  evals only at the end does not stall training).
- Failure and cancellation: a failed request ends the stream with its (typed) error; the
  consumer leaving the loop, being cancelled or ``aclose()`` cancels every request in
  flight, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Protocol, Sequence, Union

from rollout.api import RolloutRequest, RolloutResult

RequestLike = Union[RolloutRequest, dict]


class _Generates(Protocol):
    """What the stream needs of ``RolloutClient``."""

    async def generate(self, requests: Sequence[RequestLike]) -> list[RolloutResult]: ...


@dataclass(frozen=True)
class Eval:
    """Marks a request for the evaluation stream (``RolloutStream.evals()``)."""

    request: RequestLike


_END = object()


@dataclass(frozen=True)
class _SourceFailed:
    error: Exception  # raised by the caller's iterable of requests


class RolloutStream:
    def __init__(self, client: _Generates, requests: Union[Iterable[Any], AsyncIterable[Any]], max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._client = client
        self._requests = requests
        self.max_in_flight = max_in_flight
        self._slots = asyncio.Semaphore(max_in_flight)
        self._train: asyncio.Queue = asyncio.Queue()
        self._evals: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._pump: asyncio.Task | None = None
        self.in_flight = 0  # requests sent whose result the consumer has not taken yet
        self.sent = 0

    # ---- consuming --------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[RolloutResult]:
        return self._results(self._train, holds_slot=True)

    def evals(self) -> AsyncIterator[RolloutResult]:
        """Results of the requests wrapped in :class:`Eval`, as they finish."""
        return self._results(self._evals, holds_slot=False)

    async def _results(self, queue: asyncio.Queue, holds_slot: bool) -> AsyncIterator[RolloutResult]:
        self._start()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, _SourceFailed):  # no request of its own: no slot to free
                    raise item.error
                if holds_slot:
                    self._free_slot()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if holds_slot:  # the training consumer is gone: nothing is waiting for more
                await self.aclose()

    async def aclose(self) -> None:
        """Stop drawing requests and cancel every one in flight (aborting it in the engine)."""
        pending = [t for t in (self._pump, *self._tasks) if t is not None and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def __aenter__(self) -> "RolloutStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ---- sending ----------------------------------------------------------------------

    def _start(self) -> None:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._send_all())

    def _free_slot(self) -> None:
        self.in_flight -= 1
        self._slots.release()

    async def _send_all(self) -> None:
        try:
            async for item in _aiter(self._requests):
                await self._slots.acquire()
                self.in_flight += 1
                self.sent += 1
                task = asyncio.get_running_loop().create_task(self._run(item))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            while self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        except Exception as e:  # the caller's iterable raised: the stream ends with its error
            await self._train.put(_SourceFailed(e))
        finally:
            for q in (self._train, self._evals):
                q.put_nowait(_END)

    async def _run(self, item: Any) -> None:
        is_eval = isinstance(item, Eval)
        request: RequestLike = item.request if is_eval else item
        try:
            (result,) = await self._client.generate([request])
            outcome: Any = result
        except asyncio.CancelledError:
            raise
        except Exception as e:  # typed by the client; the consumer gets it
            outcome = e
        if is_eval and not isinstance(outcome, BaseException):
            self._free_slot()
            await self._evals.put(outcome)
        else:
            await self._train.put(outcome)  # (an eval's error ends the whole stream too)


async def _aiter(items: Union[Iterable[Any], AsyncIterable[Any]]) -> AsyncIterator[Any]:
    if hasattr(items, "__aiter__"):
        async for item in items:  # type: ignore[union-attr]
            yield item
    else:
        for item in items:  # type: ignore[union-attr]
            yield item
