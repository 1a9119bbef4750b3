"""Token-exact multi-turn episodes, kept on the replica that serves them.

Re-rendering a chat history every turn re-tokenizes what the model generated, and the ids
can differ from the ones it sampled (a decode/encode round trip is not the identity), so
the trainer's logprobs stop matching the tokens it trains on. An episode instead keeps
its token ids: each turn appends only the new messages (environment, tool, user),
rendered with the model's chat template on their own, after the exact tokens the model
sampled; the model's turn is sampled from all of them. The trajectory has a per-token
``loss_mask`` (1 for the model's tokens) and the model's logprobs.

State lives in the replica's memory (bounded: episodes per replica, turns and tokens per
episode, idle expiry). An episode's id names its replica, and the router sends its turns
there; when that replica is gone, a turn fails with :class:`EpisodeLostError` instead of
silently starting over.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# EpisodeLostError lives with the other errors that cross HTTP (rollout.wire_errors maps them).
from rollout.errors import EpisodeLostError, InvalidRequestError  # noqa: F401  (EpisodeLostError re-exported)

# Stands for the model's last turn when the template renders the new messages: whatever
# the template writes after it (closing the assistant turn, opening the next) is the delta.
_TURN_END_SENTINEL = "\u2063rollout-model-turn\u2063"
_BASE = [{"role": "user", "content": "\u2063"}]


def episode_id_for(replica_id: str) -> str:
    return f"{replica_id}.{uuid.uuid4().hex}"


def replica_of(episode_id: str) -> Optional[str]:
    """The replica an episode id names (the router's pin), None for a malformed id."""
    replica, sep, _ = episode_id.partition(".")
    return replica if sep and replica else None


def _apply_template(tokenizer: Any, messages: Sequence[dict], tokenize: bool, tools: Optional[list[dict]] = None) -> Any:
    try:
        return tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True, tokenize=tokenize, return_dict=False)
    except Exception as e:  # a template that rejects the roles, for example
        raise InvalidRequestError("messages", f"cannot apply the chat template: {e}") from None


def render_initial(tokenizer: Any, messages: Sequence[dict], tools: Optional[list[dict]] = None) -> list[int]:
    """The opening messages with the generation prompt; ``tools`` (OpenAI tool entries) go
    to the template, which may describe them to the model."""
    return list(_apply_template(tokenizer, messages, tokenize=True, tools=tools))


def render_after_model_turn(tokenizer: Any, messages: Sequence[dict], last_token: Optional[int], tools: Optional[list[dict]] = None) -> list[int]:
    """The token ids of ``messages`` as the chat template writes them after a model turn
    (closing that turn, then the messages, then the generation prompt), tokenized on their
    own. When the model's own last token already closed its turn, it is not repeated."""
    base = _BASE + [{"role": "assistant", "content": _TURN_END_SENTINEL}]
    text = _apply_template(tokenizer, base + list(messages), tokenize=False, tools=tools)
    at = text.find(_TURN_END_SENTINEL)
    if at < 0:
        raise InvalidRequestError("messages", "the chat template drops the model's turn; episodes need a template that keeps it")
    ids = list(tokenizer.encode(text[at + len(_TURN_END_SENTINEL):], add_special_tokens=False))
    if ids and last_token is not None and ids[0] == last_token:
        ids = ids[1:]
    return ids


@dataclass
class EpisodeState:
    episode_id: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[Optional[float]]
    max_turns: int
    max_tokens: int
    turns: list[Any] = field(default_factory=list)  # ModelTurnSpan of each model turn
    tools: list[Any] = field(default_factory=list)  # the rollout.tools.Tool the model may call
    max_tool_calls: int = 0
    tool_calls: int = 0  # run so far
    pending: list[dict] = field(default_factory=list)  # the last turn's tool output, rendered at the next
    reward: Any = None  # the RewardSpec it is scored with when it ends
    adapter: Optional[str] = None  # the LoRA adapter every turn generates with (None: the base model)
    last_text: str = ""  # the model's last turn, as text: what the reward reads
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a turn is running: a second one at once would interleave tokens
    # The turns' routed experts (rollout.api.RoutedExperts, in order) when the episode asked for them; None when not.
    routed_experts: Optional[list[Any]] = None

    def append(self, ids: Sequence[int], model: bool, logprobs: Optional[Sequence[float]] = None) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [None] * len(ids)

    @property
    def routed_rows(self) -> int:
        """Trajectory tokens whose routed experts the turns returned so far (from token 0)."""
        return sum(r.num_tokens for r in self.routed_experts or ())

    def add_routed_experts(self, rows: Any, length: int) -> None:
        """A turn's routed experts (before its tokens are appended; ``length``: the trajectory's
        length with them): they begin where the earlier turns' rows ended and cover every token
        but the last, which no turn ran yet. None (an aborted turn) adds none: the next turn's
        rows begin where these ended, so they fill the gap."""
        if rows is None:
            return
        if rows.start != self.routed_rows or rows.start + rows.num_tokens != length - 1:
            raise RuntimeError(
                f"episode {self.episode_id}: the turn's routed experts (rows {rows.start}..{rows.start + rows.num_tokens}) do not continue "
                f"the trajectory's rows 0..{self.routed_rows} up to its token {length - 1}"
            )
        self.routed_experts.append(rows)

    def routed_experts_so_far(self) -> Any:
        """Every turn's routed experts as one (rollout.api.RoutedExperts from 0); None when the episode did not ask or had no turn."""
        if not self.routed_experts:
            return None
        import numpy as np

        from rollout.api import RoutedExperts

        return RoutedExperts.from_numpy(np.concatenate([r.to_numpy() for r in self.routed_experts]), start=0)


class EpisodeStore:
    """The episodes of one replica."""

    def __init__(self, max_episodes: int, idle_expiry_s: float):
        self.max_episodes = max_episodes
        self.idle_expiry_s = idle_expiry_s
        self._episodes: dict[str, EpisodeState] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    def add(self, episode: EpisodeState) -> None:
        self._expire()
        if len(self._episodes) >= self.max_episodes:
            raise InvalidRequestError(
                "episode", f"this replica holds episodes.max_per_replica={self.max_episodes} episodes; end some (or let them expire) first"
            )
        self._episodes[episode.episode_id] = episode

    def get(self, episode_id: str) -> EpisodeState:
        self._expire()
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise EpisodeLostError(
                f"episode {episode_id} is not on this replica: it ended, was idle longer than episodes.idle_expiry_s="
                f"{self.idle_expiry_s:g} s, or the replica that held it restarted; start a new episode"
            )
        episode.last_used = time.monotonic()
        return episode

    def pop(self, episode_id: str) -> EpisodeState:
        episode = self.get(episode_id)
        del self._episodes[episode_id]
        return episode

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.idle_expiry_s
        for eid in [eid for eid, e in self._episodes.items() if e.last_used < cutoff]:
            del self._episodes[eid]
