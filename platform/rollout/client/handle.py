"""Transport over a Ray Serve deployment handle (trainer inside the Ray cluster)."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from rollout.api import RolloutChunk, RolloutRequest, RolloutResult
from rollout.batching import fan_out
from rollout.errors import as_overloaded, unwrap_remote


class HandleTransport:
    def __init__(self, handle, batch_size: int):
        self._handle = handle
        self._stream_handle = self._handle.options(stream=True)
        self._batch_size = batch_size

    @staticmethod
    def _typed(e: BaseException) -> BaseException:
        return as_overloaded(unwrap_remote(e))

    @classmethod
    def from_app(cls, app_name: str, deployment: str, batch_size: int) -> "HandleTransport":
        from ray import serve

        return cls(serve.get_deployment_handle(deployment, app_name=app_name), batch_size)

    async def _call(self, chunk: Sequence[RolloutRequest], offset: int) -> list[RolloutResult]:
        try:
            return await self._handle.generate.remote(list(chunk), offset)
        except Exception as e:
            raise self._typed(e) from None

    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        return await fan_out(self._call, requests, self._batch_size)

    async def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]:
        gen = self._stream_handle.generate_stream.remote(request)
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:
            raise self._typed(e) from None
        finally:
            # Leaving early (break, cancel) must abort the request in the engine.
            gen.cancel()

    async def stats(self):
        return await self._handle.stats.remote()

    async def close(self) -> None:
        pass
