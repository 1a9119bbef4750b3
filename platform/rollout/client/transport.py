"""What a client transport must do; one implementation per way of reaching the platform."""

from __future__ import annotations

from typing import AsyncIterator, Protocol, Sequence

from rollout.api import RolloutChunk, RolloutRequest, RolloutResult


class Transport(Protocol):
    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]: ...

    def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]: ...

    async def close(self) -> None: ...
