"""OpenAI-compatible request and response shapes, mapped onto our own API models.

Only what RL tooling and standard OpenAI clients send is honoured; fields OpenAI has
that make no sense here (``user``, ``logit_bias`` ...) are accepted and ignored, so a
stock client works unchanged.
"""

from __future__ import annotations

import time
import uuid
from typing import List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from rollout.api import ChatMessage, RolloutChunk, RolloutRequest, RolloutResult, SamplingConfig


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: int = Field(default=16, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    stream: bool = False

    def sampling(self, logprobs: bool) -> SamplingConfig:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingConfig(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            logprobs=logprobs,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, List[int]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=0, description="Only the sampled token's logprob (0) is supported.")

    def to_rollout(self) -> RolloutRequest:
        prompt = {"prompt": self.prompt} if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}
        return RolloutRequest(**prompt, sampling=self.sampling(self.logprobs is not None), n=self.n)


class ChatCompletionRequest(_OpenAIRequest):
    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: bool = False

    def to_rollout(self) -> RolloutRequest:
        return RolloutRequest(messages=self.messages, sampling=self.sampling(self.logprobs), n=self.n)


def _usage(result: RolloutResult) -> dict:
    completion = sum(len(s.token_ids) for s in result.samples)
    prompt = len(result.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(result: RolloutResult, model: str) -> dict:
    choices = []
    for i, s in enumerate(result.samples):
        logprobs = None
        if s.logprobs is not None:
            logprobs = {"tokens": [str(t) for t in s.token_ids], "token_logprobs": s.logprobs}
        choices.append({"index": i, "text": s.text or "", "finish_reason": s.finish_reason, "logprobs": logprobs})
    return {"id": _id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices, "usage": _usage(result)}


def chat_response(result: RolloutResult, model: str) -> dict:
    choices = []
    for i, s in enumerate(result.samples):
        logprobs = None
        if s.logprobs is not None:
            logprobs = {"content": [{"token": str(t), "logprob": lp} for t, lp in zip(s.token_ids, s.logprobs)]}
        choices.append(
            {"index": i, "message": {"role": "assistant", "content": s.text or ""}, "finish_reason": s.finish_reason, "logprobs": logprobs}
        )
    return {"id": _id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices, "usage": _usage(result)}


def stream_event(chunk: RolloutChunk, model: str, chat: bool, stream_id: str) -> dict:
    """One server-sent event of an OpenAI streaming response."""
    if chat:
        choice = {"index": chunk.index, "delta": {"content": chunk.text}, "finish_reason": chunk.finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": chunk.index, "text": chunk.text, "finish_reason": chunk.finish_reason}
        obj = "text_completion"
    return {"id": stream_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
