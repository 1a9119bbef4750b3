"""Transport over a Ray Serve deployment handle (trainer inside the Ray cluster)."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, RolloutChunk, RolloutRequest, RolloutResult, Trajectory, TurnResult
from rollout.batching import fan_out
from rollout.client.transport import DEFAULT_TIMEOUT_S
from rollout.engine.load import ReplicaLoad
from rollout.errors import EngineUnavailableError, ReplicaLostError, as_overloaded, replica_lost, unwrap_remote

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _ClientDeadline(EngineUnavailableError):
    """This client's own timeout. A class of its own: Ray re-raises a replica's errors as
    subclasses of their type, so catching EngineUnavailableError would also catch a
    replica's (still wrapped, never retried) errors."""


class HandleTransport:
    def __init__(self, handle, batch_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._handle = handle
        self._stream_handle = self._handle.options(stream=True)
        self._batch_size = batch_size
        self._timeout_s = timeout_s
        self.retried_calls = 0  # calls re-sent after their replica died

    async def _within_deadline(self, awaitable, what: str):
        # Cancelling a Serve call (which the timeout does) aborts its requests in the engine.
        try:
            return await asyncio.wait_for(awaitable, self._timeout_s)
        except asyncio.TimeoutError:
            raise _ClientDeadline(f"{what}: no answer within {self._timeout_s:g}s (the client's timeout_s)") from None

    @staticmethod
    def _typed(e: BaseException, tokens_so_far: dict[int, list[int]] | None = None) -> BaseException:
        cause = unwrap_remote(e)
        if isinstance(cause, EngineUnavailableError):
            return cause  # ours already (NotServingError included)
        if replica_lost(cause):
            return ReplicaLostError(f"the engine replica serving the request died: {cause}", tokens_so_far)
        return as_overloaded(cause)

    def _retrying(self, what: str, e: BaseException) -> None:
        # Serve's router has marked the dead replica; the retry goes to another one.
        self.retried_calls += 1
        logger.warning("%s: its engine replica died or refused it before returning a token (%s); retrying once on another replica", what, type(unwrap_remote(e)).__name__)

    @classmethod
    def from_app(cls, app_name: str, deployment: str, batch_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "HandleTransport":
        from ray import serve

        return cls(serve.get_deployment_handle(deployment, app_name=app_name), batch_size, timeout_s)

    async def _call(self, chunk: Sequence[RolloutRequest], offset: int) -> list[RolloutResult]:
        for attempt in (1, 2):
            try:
                return await self._within_deadline(self._handle.generate.remote(list(chunk), offset), f"requests[{offset}:{offset + len(chunk)}]")
            except _ClientDeadline:
                raise
            except Exception as e:
                # Nothing of a unary call reached the caller: sampling it again elsewhere is safe.
                if attempt == 1 and replica_lost(e):
                    self._retrying(f"requests[{offset}:{offset + len(chunk)}]", e)
                    continue
                raise self._typed(e) from None
        raise AssertionError("unreachable")

    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        return await fan_out(self._call, requests, self._batch_size)

    async def _once(self, send: Callable[[], Awaitable[T]], what: str) -> T:
        """One call of another engine method: within the deadline, errors typed, never
        retried elsewhere (an episode's tokens live on one replica)."""
        try:
            return await self._within_deadline(send(), what)
        except _ClientDeadline:
            raise
        except Exception as e:
            raise self._typed(e) from None

    async def start_episode(self, start: EpisodeStart) -> EpisodeStarted:
        return await self._once(lambda: self._handle.start_episode.remote(start), "start_episode")

    async def episode_turn(self, turn: EpisodeTurn) -> TurnResult:
        return await self._once(lambda: self._handle.episode_turn.remote(turn), "episode_turn")

    async def episode_trajectory(self, ref: EpisodeRef, end: bool) -> Trajectory:
        return await self._once(lambda: self._handle.episode_trajectory.remote(ref, end), "episode_trajectory")

    async def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]:
        sent: dict[int, list[int]] = {}  # sample index -> token ids already yielded
        for attempt in (1, 2):
            gen = self._stream_handle.generate_stream.remote(request)
            chunks = gen.__aiter__()
            try:
                while True:
                    try:
                        chunk = await self._within_deadline(chunks.__anext__(), f"stream {request.request_id}")
                    except StopAsyncIteration:
                        return
                    sent.setdefault(chunk.index, []).extend(chunk.token_ids)
                    yield chunk
            except _ClientDeadline:
                raise
            except Exception as e:
                # Only a stream that yielded nothing may start over: tokens already out can't be unsent.
                if attempt == 1 and not sent and replica_lost(e):
                    self._retrying(f"stream {request.request_id}", e)
                    continue
                raise self._typed(e, sent) from None
            finally:
                # Leaving early (break, cancel) must abort the request in the engine.
                gen.cancel()

    async def stats(self) -> ReplicaLoad:
        """The load of the replica Serve's router picks for this call."""
        return await self._once(lambda: self._handle.stats.remote(), "stats")

    async def close(self) -> None:
        pass
