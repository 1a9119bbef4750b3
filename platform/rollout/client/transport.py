"""What a client transport must do; one implementation per way of reaching the platform."""

from __future__ import annotations

from typing import AsyncIterator, Optional, Protocol, Sequence

from rollout.api import EpisodeRef, EpisodeStart, EpisodeStarted, EpisodeTurn, RolloutChunk, RolloutRequest, RolloutResult, Trajectory, TurnResult
from rollout.contracts.load import ReplicaLoad

# How long a client waits for a call's answer (a stream: for its next chunk) before it
# gives up with a retryable error; the same default over HTTP and over a Serve handle.
DEFAULT_TIMEOUT_S = 600.0


class Transport(Protocol):
    async def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]: ...

    def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]: ...

    # The episodes (rollout.episodes): each call goes to the replica holding the episode.
    async def start_episode(self, start: EpisodeStart) -> EpisodeStarted: ...

    async def episode_turn(self, turn: EpisodeTurn) -> TurnResult: ...

    async def episode_trajectory(self, ref: EpisodeRef, end: bool) -> Trajectory:
        """The episode's trajectory; with ``end`` the replica forgets the episode."""
        ...

    async def stats(self) -> ReplicaLoad:
        """One engine replica's load and weight version (the one the router picks)."""
        ...

    # vLLM's sleep mode over every replica (rollout.sync.sleep), with the sync credential
    # (``token``; None: the transport's default).
    async def sleep(self, level: int, mode: str, token: Optional[str]) -> None: ...

    async def wake_up(self, tags: Optional[tuple[str, ...]], token: Optional[str]) -> bool:
        """Whether the replicas are fully awake."""
        ...

    async def is_sleeping(self, token: Optional[str]) -> bool: ...

    async def close(self) -> None: ...
