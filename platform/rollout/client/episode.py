"""A token-exact episode from the trainer's side (see :mod:`rollout.episodes`).

    episode = await client.start_episode([{"role": "user", "content": task}])
    turn = await episode.turn(sampling=SamplingConfig(max_tokens=256))        # the model's first turn
    turn = await episode.turn([{"role": "tool", "content": output}])          # tool output, then the model
    trajectory = await episode.end()   # token_ids, loss_mask, logprobs, the model's turns

With tools (``client.start_episode(messages, tools=["python"])``), the platform runs the
calls the model makes in a turn (``turn.tool_calls``) and puts their output at the start of
the next turn; ``tool_choice`` ("auto", "none", "required" or {"name": ...}) steers a turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Union

from pydantic import ValidationError

from rollout.api import ChatMessage, EpisodeRef, EpisodeTurn, SamplingConfig, Trajectory, TurnResult
from rollout.errors import from_validation_error

if TYPE_CHECKING:
    from rollout.client.transport import Transport

MessageLike = Union[ChatMessage, dict]


class Episode:
    def __init__(self, transport: "Transport", episode_id: str, prompt_token_ids: list[int]):
        self._transport = transport
        self.episode_id = episode_id
        self.prompt_token_ids = prompt_token_ids

    async def turn(self, messages: Sequence[MessageLike] = (), sampling: Optional[SamplingConfig] = None, tool_choice: Union[str, dict] = "auto") -> TurnResult:
        """Append the last turn's tool output and ``messages`` (rendered on their own, after
        the model's exact tokens), then sample the model's turn and run the tools it calls."""
        try:
            turn = EpisodeTurn.model_validate(
                {"episode_id": self.episode_id, "messages": list(messages), "sampling": sampling or SamplingConfig(), "tool_choice": tool_choice}
            )
        except ValidationError as e:
            raise from_validation_error(e, "turn") from None
        return await self._transport.episode_turn(turn)

    async def trajectory(self) -> Trajectory:
        return await self._transport.episode_trajectory(EpisodeRef(episode_id=self.episode_id), end=False)

    async def end(self) -> Trajectory:
        """The trajectory; the replica forgets the episode."""
        return await self._transport.episode_trajectory(EpisodeRef(episode_id=self.episode_id), end=True)
