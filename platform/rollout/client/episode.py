"""A token-exact episode from the trainer's side (see :mod:`rollout.episodes`).

    episode = await client.start_episode([{"role": "user", "content": task}])
    turn = await episode.turn(sampling=SamplingConfig(max_tokens=256))        # the model's first turn
    turn = await episode.turn([{"role": "tool", "content": output}])          # tool output, then the model
    trajectory = await episode.end()   # token_ids, loss_mask, logprobs, the model's turns
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from rollout.api import ChatMessage, EpisodeRef, EpisodeTurn, SamplingConfig, Trajectory, TurnResult

if TYPE_CHECKING:
    from rollout.client.transport import Transport

MessageLike = Union[ChatMessage, dict]


class Episode:
    def __init__(self, transport: "Transport", episode_id: str, prompt_token_ids: list[int]):
        self._transport = transport
        self.episode_id = episode_id
        self.prompt_token_ids = prompt_token_ids

    async def turn(self, messages: Sequence[MessageLike] = (), sampling: Optional[SamplingConfig] = None) -> TurnResult:
        """Append ``messages`` (rendered on their own, after the model's exact tokens), then
        sample the model's turn."""
        turn = EpisodeTurn.model_validate({"episode_id": self.episode_id, "messages": list(messages), "sampling": sampling or SamplingConfig()})
        return await self._transport.call("episode_turn", turn)

    async def trajectory(self) -> Trajectory:
        return await self._transport.call("episode_trajectory", EpisodeRef(episode_id=self.episode_id), False)

    async def end(self) -> Trajectory:
        """The trajectory; the replica forgets the episode."""
        return await self._transport.call("episode_trajectory", EpisodeRef(episode_id=self.episode_id), True)
