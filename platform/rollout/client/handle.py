"""Transport over a Ray Serve deployment handle (trainer inside the Ray cluster)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar

from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, RolloutChunk, RolloutRequest, RolloutResult, Trajectory, TurnResult
from rollout.batching import fan_out
from rollout.client.transport import DEFAULT_TIMEOUT_S
from rollout.contracts.load import ReplicaLoad
from rollout.contracts.sync_protocol import COORDINATOR_NAME, SYNC_TOKEN_ENV, FleetQuery, RouteCommand, SleepFleet, SyncError, WakeFleet
from rollout.engine.openai_app import ForwardedRequest
from rollout.errors import EngineUnavailableError, NotServingError, ReplicaLostError, as_overloaded, replica_lost, unwrap_remote
from rollout.sync.coordinator_client import CoordinatorHandle

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _ClientDeadline(EngineUnavailableError):
    """This client's own timeout. A class of its own: Ray re-raises a replica's errors as
    subclasses of their type, so catching EngineUnavailableError would also catch a
    replica's (still wrapped, never retried) errors."""


class HandleTransport:
    def __init__(self, handle, batch_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, coordinator: Optional[Callable[[], Any]] = None):
        self._handle = handle
        # The weight-sync coordinator's handle, made when sleep or wake first needs it (an
        # app without weight sync has none): those drive every replica through it.
        self._coordinator_of = coordinator
        self._coordinator: Optional[CoordinatorHandle] = None
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

    def _retrying(self, what: str, e: BaseException) -> Optional[str]:
        """Log the retry of a call ``e`` ended; the replica to avoid (the one that refused
        it: the router would rank it first again for the same affinity key). A dead one
        Serve's router has marked already."""
        self.retried_calls += 1
        logger.warning("%s: its engine replica died or refused it before returning a token (%s); retrying once on another replica", what, type(unwrap_remote(e)).__name__)
        cause = unwrap_remote(e)
        return cause.replica_id if isinstance(cause, NotServingError) else None

    @classmethod
    def from_app(cls, app_name: str, deployment: str, batch_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "HandleTransport":
        from ray import serve

        def coordinator() -> Any:
            return serve.get_deployment_handle(COORDINATOR_NAME, app_name=app_name)

        return cls(serve.get_deployment_handle(deployment, app_name=app_name), batch_size, timeout_s, coordinator)

    async def _call(self, chunk: Sequence[RolloutRequest], offset: int) -> list[RolloutResult]:
        avoid = None
        for attempt in (1, 2):
            try:
                return await self._within_deadline(self._handle.generate.remote(list(chunk), offset, avoid_replica=avoid), f"requests[{offset}:{offset + len(chunk)}]")
            except _ClientDeadline:
                raise
            except Exception as e:
                # Nothing of a unary call reached the caller: sampling it again elsewhere is safe.
                if attempt == 1 and replica_lost(e):
                    avoid = self._retrying(f"requests[{offset}:{offset + len(chunk)}]", e)
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
        avoid = None
        for attempt in (1, 2):
            gen = self._stream_handle.generate_stream.remote(request, avoid_replica=avoid)
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
                    avoid = self._retrying(f"stream {request.request_id}", e)
                    continue
                raise self._typed(e, sent) from None
            finally:
                # Leaving early (break, cancel) must abort the request in the engine.
                gen.cancel()

    async def openai(self, hint: dict, request: ForwardedRequest) -> tuple[dict, AsyncIterator[Any]]:
        """An OpenAI route on the replica the router picks (``hint``: what it keys on):
        the answer's ``{"status", "headers"}`` and an iterator of its body's chunks. Like
        :meth:`generate`, a call whose replica died or refused it before answering
        (:class:`NotServingError`: e.g. the adapter its ``model`` names is committed but
        not loaded there) is retried once on another replica: nothing reached the caller.
        No deadline of its own: vLLM's app answers the request's own limits."""
        avoid = None
        for attempt in (1, 2):
            parts = self._stream_handle.openai_http.remote(hint, request, avoid_replica=avoid)
            try:
                start = await parts.__anext__()
            except Exception as e:
                if attempt == 1 and replica_lost(e):
                    avoid = self._retrying(f"{request.method} {request.path}", e)
                    continue
                raise self._typed(e) from None

            async def rest() -> AsyncIterator[Any]:
                async for chunk in parts:
                    yield chunk

            return start, rest()
        raise AssertionError("unreachable")

    async def openai_unary(self, hint: dict, request: ForwardedRequest) -> tuple[dict, bytes]:
        """:meth:`openai` for a request that does not stream: the answer's start and its
        whole body in one Serve call (a stream costs a call's worth of work per item at
        both ends). Retried once elsewhere as :meth:`openai` is."""
        avoid = None
        for attempt in (1, 2):
            try:
                return await self._handle.openai_http_unary.remote(hint, request, avoid_replica=avoid)
            except Exception as e:
                if attempt == 1 and replica_lost(e):
                    avoid = self._retrying(f"{request.method} {request.path}", e)
                    continue
                raise self._typed(e) from None
        raise AssertionError("unreachable")

    # ---- sleep and wake: through the coordinator, over every replica -----------------------

    async def _drive(self, command: RouteCommand, token: Optional[str]) -> Any:
        if self._coordinator is None:
            if self._coordinator_of is None:
                raise SyncError("this client has no weight-sync coordinator to drive (built without one)")
            try:
                self._coordinator = CoordinatorHandle(self._coordinator_of())
            except Exception as e:
                raise SyncError(f"no weight-sync coordinator in this app (sync.enabled: false?): {type(e).__name__}: {e}") from None
        return await self._coordinator.drive(token if token is not None else os.environ.get(SYNC_TOKEN_ENV), command)

    async def sleep(self, level: int, mode: str, token: Optional[str]) -> None:
        await self._drive(SleepFleet(level, mode), token)

    async def wake_up(self, tags: Optional[tuple[str, ...]], token: Optional[str]) -> bool:
        return bool(await self._drive(WakeFleet(tuple(tags) if tags else None), token))

    async def is_sleeping(self, token: Optional[str]) -> bool:
        return bool(await self._drive(FleetQuery.IS_SLEEPING, token))

    async def stats(self) -> ReplicaLoad:
        """The load of the replica Serve's router picks for this call."""
        return await self._once(lambda: self._handle.stats.remote(), "stats")

    async def close(self) -> None:
        pass
