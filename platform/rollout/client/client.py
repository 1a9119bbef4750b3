"""``RolloutClient``: the one object a trainer uses to get rollouts.

The trainer never touches vLLM or Serve types: requests and results are the pydantic
models of :mod:`rollout.api`, errors are the typed exceptions of :mod:`rollout.errors`.

    client = RolloutClient.connect(app_name="rollout")         # inside the Ray cluster
    client = RolloutClient.http("http://host:8000", api_key=k)  # from anywhere
    results = client.generate_sync([RolloutRequest(prompt="2+2=", n=8)])
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Iterator, Optional, Sequence, Union

from pydantic import ValidationError

from rollout.api import EpisodeStart, RolloutChunk, RolloutRequest, RolloutResult
from rollout.client.episode import Episode
from rollout.client.rollout_stream import RequestLike, RolloutStream
from rollout.client.transport import DEFAULT_TIMEOUT_S, Transport
from rollout.contracts.load import ReplicaLoad
from rollout.errors import from_validation_error

logger = logging.getLogger(__name__)



def _as_requests(requests: Sequence[RequestLike]) -> list[RolloutRequest]:
    out = []
    for i, r in enumerate(requests):
        try:
            out.append(r if isinstance(r, RolloutRequest) else RolloutRequest.model_validate(r))
        except ValidationError as e:
            raise from_validation_error(e, f"requests[{i}]") from None
    return out


class _LoopThread:
    """A private event loop for the blocking API, so it works in scripts and notebooks alike."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class RolloutClient:
    def __init__(self, transport_factory, description: str):
        # Transports hold loop-bound resources (HTTP connection pools, handle routers),
        # so one is made per event loop that uses the client.
        self._factory = transport_factory
        self._transports: dict[int, Transport] = {}
        self._sync: Optional[_LoopThread] = None
        self.description = description

    @classmethod
    def connect(
        cls, app_name: str = "rollout", deployment: str = "RolloutEngine", batch_size: int = 64, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> "RolloutClient":
        """A client over a Serve handle; call from a process attached to the Ray cluster.
        ``timeout_s`` bounds each call (a stream: each chunk); past it, the call is
        aborted in the engine and raises the retryable ``EngineUnavailableError``."""
        from rollout.client.handle import HandleTransport

        return cls(lambda: HandleTransport.from_app(app_name, deployment, batch_size, timeout_s), f"serve://{app_name}/{deployment}")

    @classmethod
    def http(cls, base_url: str, api_key: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "RolloutClient":
        """A client over the HTTP ingress, from outside the Ray cluster."""
        from rollout.client.http import HttpTransport

        return cls(lambda: HttpTransport(base_url, api_key, timeout_s), base_url)

    @property
    def retried_calls(self) -> int:
        """Calls re-sent to another replica after theirs died before returning a token."""
        return sum(getattr(t, "retried_calls", 0) for t in self._transports.values())

    def _transport(self) -> Transport:
        key = id(asyncio.get_running_loop())
        if key not in self._transports:
            self._transports[key] = self._factory()
        return self._transports[key]

    async def generate(self, requests: Sequence[RequestLike]) -> list[RolloutResult]:
        """Sample every request; results are in request order."""
        reqs = _as_requests(requests)
        if not reqs:
            return []
        return await self._transport().generate(reqs)

    def stream(self, requests: Union[RequestLike, Iterable[Any], AsyncIterable[Any]], max_in_flight: Optional[int] = None):
        """Two streams, told apart by what is passed:

        - ``stream(request)``: one request's tokens as they are generated
          (:class:`RolloutChunk`; ``n`` samples interleaved). Leaving the loop aborts it.
        - ``stream(requests, max_in_flight=N)``: the finished :class:`RolloutResult` of
          every request of an iterable (sync or async, possibly endless), in finishing
          order, never more than N in flight; wrap a request in ``Eval`` for
          ``.evals()`` (see :mod:`rollout.client.rollout_stream`).
        """
        if isinstance(requests, (RolloutRequest, dict)):
            if max_in_flight is not None:
                raise TypeError("max_in_flight is for a stream of many requests; stream(request) streams one request's tokens")
            return self._token_stream(requests)
        if max_in_flight is None:
            raise TypeError("stream(requests) needs max_in_flight: how many requests may be in flight at once")
        return RolloutStream(self, requests, max_in_flight)

    async def _token_stream(self, request: RequestLike) -> AsyncIterator[RolloutChunk]:
        (req,) = _as_requests([request])
        async for chunk in self._transport().stream(req):
            yield chunk

    async def start_episode(
        self,
        messages: Sequence[Any],
        max_turns: Optional[int] = None,
        max_tokens: Optional[int] = None,
        tools: Sequence[str] = (),
        max_tool_calls: Optional[int] = None,
        reward: Optional[Any] = None,
        adapter: Optional[str] = None,
        return_routed_experts: bool = False,
    ) -> Episode:
        """Begin a token-exact multi-turn episode on one replica (see :mod:`rollout.client.episode`);
        ``tools`` names the tools its model may call; ``reward`` (a RewardSpec or its dict)
        scores it when it ends; ``adapter`` names a published LoRA adapter every turn
        generates with (its newest committed version as each turn starts); ``return_routed_experts``:
        every turn and the trajectory carry the MoE experts routed for their tokens (needs
        ``model.return_routed_experts``)."""
        try:
            start = EpisodeStart.model_validate(
                {"messages": list(messages), "max_turns": max_turns, "max_tokens": max_tokens, "tools": list(tools), "max_tool_calls": max_tool_calls, "reward": reward, "adapter": adapter,
                 "return_routed_experts": return_routed_experts}
            )
        except ValidationError as e:
            raise from_validation_error(e, "episode") from None
        transport = self._transport()
        started = await transport.start_episode(start)
        return Episode(transport, started.episode_id, started.prompt_token_ids)

    async def stats(self) -> ReplicaLoad:
        """Load and weight version of one engine replica: the one the router picks (over
        HTTP, the ingress's router: ``GET /v1/stats``). ``replica_id`` says which; the whole
        fleet's is ``rollout status`` and the metrics."""
        return await self._transport().stats()

    # ---- sleep and wake: a trainer that shares the replicas' GPUs -----------------------

    async def sleep(self, level: int = 1, mode: str = "abort", token: Optional[str] = None) -> None:
        """Every replica's engine sleeps (vLLM's sleep mode; ``model.enable_sleep_mode``),
        freeing its GPU memory: ``level`` 1 offloads the weights to host memory and drops
        the KV cache, 2 discards both. ``mode``: what requests in flight meet (``abort``,
        ``wait``, or at level 1 ``keep``). Returns once every replica sleeps; until the wake,
        requests raise the retryable ``NotServingError`` and publishes ``FleetAsleepError``.
        ``token``: the sync token (default: ``ROLLOUT_SYNC_TOKEN``). ``SleepUnavailableError``
        where sleep mode is off or the platform has none (CPU)."""
        await self._transport().sleep(level, mode, token)

    async def wake_up(self, tags: Optional[Sequence[str]] = None, token: Optional[str] = None) -> bool:
        """Every replica wakes ``tags`` (``"weights"``, ``"kv_cache"``; None: both); after a
        level-2 sleep each replica reloads the committed version as its weights wake, before
        it serves. Returns whether the replicas are fully awake, once every one applied it."""
        return await self._transport().wake_up(tuple(tags) if tags is not None else None, token)

    async def is_sleeping(self, token: Optional[str] = None) -> bool:
        """Whether the replicas sleep (any tag asleep)."""
        return await self._transport().is_sleeping(token)

    # ---- blocking API ---------------------------------------------------------------

    def _loop(self) -> _LoopThread:
        if self._sync is None:
            self._sync = _LoopThread()
        return self._sync

    def generate_sync(self, requests: Sequence[RequestLike]) -> list[RolloutResult]:
        return self._loop().run(self.generate(requests))

    def stats_sync(self) -> ReplicaLoad:
        return self._loop().run(self.stats())

    def sleep_sync(self, level: int = 1, mode: str = "abort", token: Optional[str] = None) -> None:
        self._loop().run(self.sleep(level, mode, token))

    def wake_up_sync(self, tags: Optional[Sequence[str]] = None, token: Optional[str] = None) -> bool:
        return self._loop().run(self.wake_up(tags, token))

    def is_sleeping_sync(self, token: Optional[str] = None) -> bool:
        return self._loop().run(self.is_sleeping(token))

    def stream_sync(self, request: RequestLike) -> Iterator[RolloutChunk]:
        loop = self._loop()
        agen = self._token_stream(request).__aiter__()
        try:
            while True:
                try:
                    yield loop.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run(agen.aclose())

    def close(self) -> None:
        if self._sync is not None:
            for t in list(self._transports.values()):
                try:
                    self._sync.run(t.close())
                except Exception as e:  # closing the rest matters more; the cause is logged
                    logger.warning("closing %s: %s failed to close: %s: %s", self.description, type(t).__name__, type(e).__name__, e)
            self._sync.stop()
            self._sync = None
        self._transports.clear()
