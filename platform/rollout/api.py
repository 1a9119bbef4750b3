"""The trainer-facing data model: what goes in, what comes out.

Plain pydantic models with no vLLM or Serve types in them, so a trainer can build
requests and read results without importing either. Static limits live here; limits
that depend on the served model (vocabulary, context length, the configured cap on
``n``) are checked by :mod:`rollout.validation` against the live engine.
"""

from __future__ import annotations

import uuid
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 32
MAX_ID_LENGTH = 256


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingConfig(_Model):
    """How to sample. Defaults suit RL rollouts (temperature 1, logprobs on)."""

    max_tokens: int = Field(default=128, ge=1, description="Tokens to generate at most (>= 1; prompt + max_tokens must fit the context).")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, description="0 is greedy, 0..100.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, (0, 1].")
    top_k: int = Field(default=0, ge=0, description="Sample from the k most likely tokens; 0 disables.")
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1, description="Per-request seed for reproducible sampling.")
    stop: List[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description="Strings that end a sample (not included in the output).")
    stop_token_ids: List[int] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description="Token ids that end a sample.")
    logprobs: bool = Field(default=True, description="Return the logprob of every sampled token.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        return self


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class RolloutRequest(_Model):
    """One prompt to sample ``n`` completions of. Exactly one prompt form is given."""

    prompt_token_ids: Optional[List[int]] = Field(default=None, min_length=1, description="Prompt as token ids (token-in/token-out).")
    prompt: Optional[str] = Field(default=None, min_length=1, description="Prompt as text, tokenized by the served tokenizer.")
    messages: Optional[List[ChatMessage]] = Field(default=None, min_length=1, description="Chat messages, rendered with the model's chat template.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    n: int = Field(default=1, ge=1, description="Samples of this prompt; they share one prefill. Capped by `limits.max_n`.")
    request_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, description="Caller's id, echoed in the result; generated when absent.")
    session_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, description="Groups requests of one episode (routing affinity).")
    min_weight_version: Optional[int] = Field(
        default=None,
        ge=0,
        description="Generate only with policy version >= this; a replica still behind holds the request until it serves it (up to `sync.timeout_s`), then fails it as retryable.",
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "RolloutRequest":
        given = [f for f in ("prompt_token_ids", "prompt", "messages") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt_token_ids, prompt, messages must be given"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        if self.prompt_token_ids is not None and any(t < 0 for t in self.prompt_token_ids):
            raise ValueError("prompt_token_ids must be >= 0")
        return self

    def with_id(self) -> "RolloutRequest":
        """This request with a ``request_id``, generating one when absent."""
        if self.request_id:
            return self
        return self.model_copy(update={"request_id": uuid.uuid4().hex})


class WeightVersionSpan(_Model):
    """Tokens ``[start, end)`` of a sample were produced by policy ``version``."""

    version: str
    start: int
    end: int


FinishReason = Literal["stop", "length", "abort", "error"]


class Sample(_Model):
    token_ids: List[int]
    logprobs: Optional[List[float]] = Field(default=None, description="Logprob of each sampled token (same length as token_ids).")
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[str, int, None] = Field(default=None, description="The stop string or token id that ended the sample, if any.")
    text: Optional[str] = None
    weight_versions: List[WeightVersionSpan] = Field(default_factory=list)


class RolloutResult(_Model):
    request_id: str
    prompt_token_ids: List[int]
    samples: List[Sample]
    replica_id: Optional[str] = Field(default=None, description="The engine replica that served the request (for debugging routing).")
    committed_version: int = Field(default=0, description="The newest committed policy version the replica knew of when the result was returned.")
    staleness: int = Field(
        default=0, description="`committed_version` minus the oldest version that produced any token of the result: how many policy updates behind it is."
    )


class RolloutChunk(_Model):
    """A streaming increment: new tokens of sample ``index`` of ``request_id``.

    ``finish_reason`` is set on the last chunk of a sample, which also carries that
    sample's complete ``weight_versions``.
    """

    request_id: str
    index: int
    token_ids: List[int]
    logprobs: Optional[List[float]] = None
    text: str = ""
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[str, int, None] = None
    weight_versions: List[WeightVersionSpan] = Field(default_factory=list)
    prompt_token_ids: Optional[List[int]] = Field(default=None, description="Set on the first chunk of the request only.")


class RolloutBatch(_Model):
    """Body of ``POST /v1/rollouts``."""

    requests: List[RolloutRequest] = Field(min_length=1)


class RolloutBatchResult(_Model):
    results: List[RolloutResult]
