"""A replica's episodes: starting them, their turns (with tool calls), their trajectories.

The replica owns the engine and lends this a way to sample (``sample``); everything else
about episodes is here. A turn renders what came since the model's last turn (the output
of the tools it called, then the caller's new messages) as tokens after the model's exact
tokens, samples the model's turn, and when the episode offers tools, parses the calls out
of the model's text with vLLM's parser for its format and runs them on the tool pool. Their
output becomes tool messages that open the next turn, so the model reads them as tool-role
tokens and the loss mask leaves them out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional

from rollout.api import (
    EpisodeRef,
    EpisodeStart,
    EpisodeStarted,
    EpisodeTurn,
    ModelTurnSpan,
    NamedToolChoice,
    RolloutRequest,
    Sample,
    ToolCallResult,
    Trajectory,
    TurnResult,
)
from rollout.config import API_KEY_ENV, PlatformConfig
from rollout.episodes import EpisodeState, EpisodeStore, episode_id_for, render_after_model_turn, render_initial
from rollout.engine.validation import ROUTED_EXPERTS_OFF
from rollout.errors import InvalidRequestError
from rollout.rewards import RewardScorer
from rollout.tools import Tool, ToolRegistry
from rollout.tools.calling import ParsedCall, ToolCalling, TurnPlan
from rollout.tools.pool import ToolPool
from rollout.tools.sandbox import Isolation

# (request, plan) -> the turn's sample; with routed experts also `routed_experts_start=` (the rows earlier turns returned).
Sampler = Callable[..., Awaitable[Sample]]
# The replica's check that a LoRA adapter is served (SyncGate.adapter): raises naming the field.
AdapterCheck = Callable[[str, str], object]


class EpisodeService:
    def __init__(
        self,
        config: PlatformConfig,
        tokenizer: Any,
        replica_id: str,
        max_model_len: int,
        sample: Sampler,
        rewards: RewardScorer,
        metrics: Optional[Any] = None,
        *,
        check_adapter: AdapterCheck,
        routed_experts_refusal: Optional[str] = None,
    ):
        self.config = config
        self.rewards = rewards
        self.metrics = metrics  # rollout.metrics.EngineMetrics, when metrics are on
        self.tokenizer = tokenizer
        self.replica_id = replica_id
        self.max_model_len = max_model_len
        self._sample = sample
        self._check_adapter = check_adapter
        # Why an episode may not ask for routed experts (the replica passes its ModelLimits'; None: it may).
        if routed_experts_refusal is None and not config.model.return_routed_experts:
            routed_experts_refusal = ROUTED_EXPERTS_OFF
        self.routed_experts_refusal = routed_experts_refusal
        self.store = EpisodeStore(config.episodes.max_per_replica, config.episodes.idle_expiry_s)
        self.tools = ToolRegistry(config.tools.functions, python=config.tools.python.enabled)  # imports tools.functions: a bad path fails the start
        self.pool = ToolPool.from_config(config.tools, secret_env=(API_KEY_ENV, config.sync.token_env))
        parser = config.openai.tool_call_parser
        self.calling = ToolCalling(tokenizer, parser, config.openai.reasoning_parser) if parser else None

    async def start_tools(self) -> Optional[Isolation]:
        """Start the tool workers and check the python tool's sandbox on each: a replica
        whose workers cannot build it refuses to start (SandboxUnavailable says why)."""
        return await self.pool.start()

    def start(self, start: EpisodeStart) -> EpisodeStarted:
        cap = self.config.episodes.max_turns
        if start.max_turns is not None and start.max_turns > cap:
            raise InvalidRequestError("max_turns", f"{start.max_turns} exceeds episodes.max_turns={cap}")
        if start.max_tokens is not None and start.max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"{start.max_tokens} exceeds the context length max_model_len={self.max_model_len}")
        tools = self.tools.offered(start.tools)
        if tools and self.calling is None:
            raise InvalidRequestError("tools", "reading tool calls needs the model's format: set openai.tool_call_parser (e.g. hermes)")
        call_cap = self.config.tools.max_calls_per_episode
        if start.max_tool_calls is not None and start.max_tool_calls > call_cap:
            raise InvalidRequestError("max_tool_calls", f"{start.max_tool_calls} exceeds tools.max_calls_per_episode={call_cap}")
        if start.adapter is not None:
            # Refused now, naming `adapter`, not at the first turn. Each turn takes the
            # adapter's newest committed version as it starts (as it takes the base
            # weights'), not one pinned for the episode: a replica keeps only the served
            # version and the one before it, so an episode could outlive a pinned one.
            self._check_adapter(start.adapter, "adapter")
        if start.return_routed_experts and self.routed_experts_refusal is not None:
            raise InvalidRequestError("return_routed_experts", self.routed_experts_refusal)
        reward = start.reward or self.rewards.default
        self.rewards.resolve(reward)  # a spec that cannot run is refused now, naming reward.*, not when the episode ends
        schemas = [t.openai() for t in tools] or None
        ids = render_initial(self.tokenizer, [m.model_dump(exclude_none=True) for m in start.messages], schemas)
        episode = EpisodeState(
            episode_id_for(self.replica_id),
            [],
            [],
            [],
            start.max_turns or cap,
            start.max_tokens or self.max_model_len,
            tools=tools,
            max_tool_calls=call_cap if start.max_tool_calls is None else start.max_tool_calls,
            reward=reward,
            adapter=start.adapter,
            routed_experts=[] if start.return_routed_experts else None,
        )
        if len(ids) >= episode.max_tokens:
            raise InvalidRequestError("messages", f"the opening messages are {len(ids)} tokens; the episode may hold {episode.max_tokens} (max_tokens, at most the context)")
        episode.append(ids, model=False)
        self.store.add(episode)
        return EpisodeStarted(episode_id=episode.episode_id, prompt_token_ids=ids, replica_id=self.replica_id)

    async def turn(self, turn: EpisodeTurn) -> TurnResult:
        episode = self.store.get(turn.episode_id)
        if episode.busy:
            raise InvalidRequestError("episode_id", f"a turn of episode {turn.episode_id} is already running; wait for it")
        if len(episode.turns) >= episode.max_turns:
            raise InvalidRequestError("episode_id", f"episode {turn.episode_id} has had its {episode.max_turns} turns (max_turns)")
        if turn.messages and not episode.turns:
            raise InvalidRequestError("messages", "the first turn takes none: the opening messages were rendered when the episode started")
        if episode.adapter is not None:
            try:
                self._check_adapter(episode.adapter, "adapter")
            except InvalidRequestError as e:
                # The turn names no adapter: its episode does (EpisodeStart.adapter), and an
                # unload removed it since. Said as the episode's, on the field the turn sent.
                raise InvalidRequestError(
                    "episode_id", f"episode {turn.episode_id} generates with LoRA adapter {episode.adapter!r}, which is no longer served: {e.message}; start a new episode"
                ) from e
        plan = self._plan(episode, turn)
        messages = episode.pending + [m.model_dump(exclude_none=True) for m in turn.messages]
        schemas = [t.openai() for t in episode.tools] or None
        appended = render_after_model_turn(self.tokenizer, messages, episode.token_ids[-1], schemas) if messages else []
        total = len(episode.token_ids) + len(appended) + turn.sampling.max_tokens
        if total > episode.max_tokens:
            raise InvalidRequestError(
                "sampling.max_tokens", f"the episode would reach {total} tokens ({len(episode.token_ids)} so far, {len(appended)} new); its max_tokens is {episode.max_tokens}"
            )
        routed = episode.routed_experts is not None
        request = RolloutRequest(
            prompt_token_ids=episode.token_ids + appended, sampling=turn.sampling, session_id=turn.episode_id, adapter=episode.adapter, return_routed_experts=routed
        )
        episode.busy = True
        try:
            # With routed experts: only the rows after those the earlier turns returned.
            sample = await (self._sample(request, plan, routed_experts_start=episode.routed_rows) if routed else self._sample(request, plan))
            calls = self.calling.parse(plan, sample.text or "", sample.token_ids) if plan is not None else []
            results = await asyncio.gather(*(self._run(episode, call) for call in calls))
        finally:
            episode.busy = False
        if routed:
            # Checked before the episode changes: rows that do not continue it are the engine's fault (500), the episode as it was.
            episode.add_routed_experts(sample.routed_experts, len(episode.token_ids) + len(appended) + len(sample.token_ids))
        episode.pending = [{"role": "tool", "content": r.output, "name": r.name, "tool_call_id": r.id} for r in results]
        episode.append(appended, model=False)
        start = len(episode.token_ids)
        episode.append(sample.token_ids, model=True, logprobs=sample.logprobs)
        episode.last_text = sample.text or ""
        episode.turns.append(
            ModelTurnSpan(
                start=start,
                end=len(episode.token_ids),
                finish_reason=sample.finish_reason,
                weight_versions=[sp.model_copy(update={"start": sp.start + start, "end": sp.end + start}) for sp in sample.weight_versions],
            )
        )
        return TurnResult(
            episode_id=turn.episode_id, turn=len(episode.turns), appended_token_ids=appended, sample=sample, tool_calls=list(results), replica_id=self.replica_id
        )

    async def trajectory(self, ref: EpisodeRef, end: bool) -> Trajectory:
        """The episode so far; ``end`` also forgets it and scores it: its reward (the
        episode's spec, else ``rewards.default``) is of the model's last turn's text."""
        episode = self.store.pop(ref.episode_id) if end else self.store.get(ref.episode_id)
        scored = {}
        if end and episode.turns:
            scorer = self.rewards.resolve(episode.reward)
            if scorer is not None:
                scored = (await self.rewards.score(scorer, episode.last_text)).fields()
        return Trajectory(
            episode_id=episode.episode_id,
            token_ids=episode.token_ids,
            loss_mask=episode.loss_mask,
            logprobs=episode.logprobs,
            turns=episode.turns,
            routed_experts=episode.routed_experts_so_far(),
            **scored,
        )

    def close(self) -> None:
        self.pool.close()

    # ---- tools ------------------------------------------------------------------

    def _plan(self, episode: EpisodeState, turn: EpisodeTurn) -> Optional[TurnPlan]:
        """How this turn may call tools: None when it may not (no tools offered, ``none``,
        or, with ``auto``, the episode's calls used up)."""
        choice = turn.tool_choice
        if not episode.tools:
            if choice != "auto" and choice != "none":
                raise InvalidRequestError("tool_choice", "the episode offers no tools (EpisodeStart.tools)")
            return None
        names = [t.name for t in episode.tools]
        if isinstance(choice, NamedToolChoice) and choice.name not in names:
            raise InvalidRequestError("tool_choice.name", f"{choice.name!r} is not one of the episode's tools ({', '.join(names)})")
        if choice == "none":
            return None
        if episode.tool_calls >= episode.max_tool_calls:
            if choice != "auto":
                raise InvalidRequestError("tool_choice", f"the episode has made its max_tool_calls={episode.max_tool_calls} calls; it cannot be made to call another")
            return None  # auto: the model may still write a call, but none is read or run
        return self.calling.plan(episode.tools, choice.model_dump() if isinstance(choice, NamedToolChoice) else choice)

    async def _run(self, episode: EpisodeState, call: ParsedCall) -> ToolCallResult:
        tool: Optional[Tool] = next((t for t in episode.tools if t.name == call.name), None)
        if tool is None:
            return _refused(call, f"unknown tool {call.name!r}; the episode offers {', '.join(t.name for t in episode.tools)}")
        if episode.tool_calls >= episode.max_tool_calls:
            return _refused(call, f"not run: the episode has made its max_tool_calls={episode.max_tool_calls} calls")
        episode.tool_calls += 1
        started = time.monotonic()
        outcome = await self.pool.run(tool.path, call.arguments)
        if self.metrics is not None:
            self.metrics.tool_call(tool.name, outcome.error is None, time.monotonic() - started)
        return ToolCallResult(id=call.id, name=call.name, arguments=call.arguments, output=outcome.output, error=outcome.error)


def _refused(call: ParsedCall, error: str) -> ToolCallResult:
    return ToolCallResult(id=call.id, name=call.name, arguments=call.arguments, output=f"error: {error}", error=error)
