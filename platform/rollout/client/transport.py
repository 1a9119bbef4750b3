"""What a client transport must do; one implementation per way of reaching the platform."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Sequence

from rollout.api import RolloutChunk, RolloutRequest, RolloutResult

# How long a client waits for a call's answer (a stream: for its next chunk) before it
# gives up with a retryable error; the same default over HTTP and over a Serve handle.
DEFAULT_TIMEOUT_S = 600.0


class Transport(Protocol):
    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]: ...

    def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]: ...

    async def call(self, method: str, *args: Any) -> Any:
        """An engine method other than generation: the episodes' (start_episode,
        episode_turn, episode_trajectory)."""

    async def close(self) -> None: ...
