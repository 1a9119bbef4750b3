"""The trainer-facing data model: what goes in, what comes out.

Plain pydantic models with no vLLM or Serve types in them, so a trainer can build
requests and read results without importing either. Static limits live here; limits
that depend on the served model (vocabulary, context length, the configured cap on
``n``) are checked by :mod:`rollout.validation` against the live engine.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 32
MAX_ID_LENGTH = 256
# vLLM samples greedily below this temperature (its _SAMPLING_EPS) and then refuses n > 1:
# every sample would be the same.
GREEDY_BELOW = 1e-5



def _integral(value: object) -> object:
    # JSON Schema counts 3.0 as an integer (and JSON encoders may write one); strict
    # validation would refuse it, so an integral float becomes the int it equals.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer as JSON Schema defines it: 3 and 3.0, never "3", true or 3.5.
Int = Annotated[int, BeforeValidator(_integral)]
# The bound goes before the validator: after one, pydantic publishes it as "ge", which
# JSON Schema does not know (so the schema would call -1 valid).
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
# The largest count or id a request hands vLLM's engine. Its requests cross to the engine
# core as msgpack, which has no integer above 2**64 - 1: a larger one (a top_k of
# 133751737642897915904) failed there as vLLM's EngineGenerateError, a 500, after every
# check of ours had passed. Its worker holds token ids, top_k and lengths in int32 tensors,
# so the bound is int32's: every integer field that reaches the engine has it (or a
# tighter one), in the schema and in validation, and anything above is a 400 naming it.
ENGINE_INT_MAX = 2**31 - 1
# A policy version as requests name it: not the engine's, and exact as a JSON number (the
# bound of the sync routes' versions, rollout.sync.remote.MAX_COUNT).
MAX_VERSION = 2**53
# A token id as the engine takes it (the served vocabulary, smaller, is checked in the replica).
TokenId = Annotated[int, Field(ge=0, le=ENGINE_INT_MAX), BeforeValidator(_integral)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Input(_Model):
    """What callers send: strict, so a value is accepted exactly when the published JSON
    schema says it is valid (no "3" for an integer, no true for a count)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StructuredOutputs(_Input):
    """Exactly one constraint on the sampled text, enforced by vLLM while sampling."""

    json_schema: Optional[Dict[str, Any]] = Field(default=None, description="The text is a JSON value valid under this schema.")
    regex: Optional[Annotated[str, Field(min_length=1, max_length=10_000)]] = Field(default=None, description="The text matches this regular expression.")
    choice: Optional[List[Annotated[str, Field(min_length=1)]]] = Field(default=None, min_length=1, max_length=1024, description="The text is one of these strings.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json_schema, regex, choice (got {', '.join(given) or 'none'})")
        return self


class SamplingConfig(_Input):
    """How to sample. Defaults suit RL rollouts (temperature 1, logprobs on)."""

    max_tokens: Int = Field(default=128, ge=1, le=ENGINE_INT_MAX, description="Tokens to generate at most (>= 1; prompt + max_tokens must fit the context).")
    # vLLM refuses temperatures above 2 (SamplingParams); a wider range here would publish
    # values every engine answers with an error.
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description=f"0..2; below {GREEDY_BELOW:g} is greedy (then `n` must be 1).")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, (0, 1].")
    top_k: Int = Field(
        default=0, ge=0, le=ENGINE_INT_MAX, description="Sample from the k most likely tokens; 0 disables (so does a k at least the vocabulary's size)."
    )
    seed: Optional[Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(_integral)]] = Field(
        default=None, description="Per-request seed for reproducible sampling."
    )
    stop: List[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS, description="Strings that end a sample (not included in the output)."
    )
    stop_token_ids: List[TokenId] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description="Token ids that end a sample.")
    logprobs: bool = Field(default=True, description="Return the logprob of every sampled token.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")
    structured_outputs: Optional[StructuredOutputs] = Field(
        default=None, description="Constrain the text to a JSON schema, a regular expression or a list of choices (vLLM's structured outputs)."
    )


class ChatMessage(_Input):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: Optional[Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]] = Field(default=None, description="A tool message's tool (for templates that render it).")
    tool_call_id: Optional[Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]] = Field(default=None, description="The call a tool message answers.")


class RewardSpec(_Input):
    """A reward to score every sample with when it finishes, next to the engine."""

    name: str = Field(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        description="`exact_match`, `math_equal`, `regex_format`, or a function the platform registered under `rewards.functions`.",
    )
    params: Dict[str, Any] = Field(
        default_factory=dict,
        description="The function's arguments besides the text: `answer` (exact_match, math_equal; exact_match also takes `ignore_case`), "
        "`pattern` (regex_format; also `full_match`).",
    )


PROMPT_FORMS = ("prompt_token_ids", "prompt", "messages")


def _one_prompt_form(schema: dict) -> None:
    # The rule _exactly_one_prompt enforces, in the published schema too: exactly one of
    # the three forms is present and not null.
    schema["oneOf"] = [{"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in PROMPT_FORMS]


# A LoRA adapter's name, as requests and episodes name it (checked against the published ones where served).
AdapterName = Annotated[str, Field(min_length=1, max_length=128)]


class RolloutRequest(_Input):
    """One prompt to sample ``n`` completions of. Exactly one prompt form is given."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_one_prompt_form)

    prompt_token_ids: Optional[List[TokenId]] = Field(default=None, min_length=1, description="Prompt as token ids (token-in/token-out).")
    prompt: Optional[str] = Field(default=None, min_length=1, description="Prompt as text, tokenized by the served tokenizer.")
    messages: Optional[List[ChatMessage]] = Field(default=None, min_length=1, description="Chat messages, rendered with the model's chat template.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    n: Int = Field(default=1, ge=1, le=ENGINE_INT_MAX, description="Samples of this prompt; they share one prefill. Capped by `limits.max_n`; 1 with greedy sampling (temperature 0).")
    request_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, description="Caller's id, echoed in the result; generated when absent.")
    session_id: Optional[str] = Field(default=None, min_length=1, max_length=MAX_ID_LENGTH, description="Groups requests of one episode (routing affinity).")
    reward: Optional[RewardSpec] = Field(
        default=None, description="Score each sample when it finishes (`Sample.reward`); replaces `rewards.default` for this request."
    )
    adapter: Optional[AdapterName] = Field(
        default=None,
        description="A published LoRA adapter (`WeightPublisher.publish_adapter`) to generate with, by name: its newest committed version when the request starts, "
        "to the request's end (each `weight_versions` span names it). None: the base model. An adapter not published is refused (400 naming `adapter`).",
    )
    min_weight_version: Optional[Annotated[int, Field(ge=0, le=MAX_VERSION), BeforeValidator(_integral)]] = Field(
        default=None,
        description="Generate only with policy version >= this; a replica still behind holds the request until it serves it (up to `sync.timeout_s`), then fails it as retryable. "
        "A version that no publish can bring without a new one beginning (above the committed version + 1 and the version of the round in progress) is refused at once (400).",
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Return the experts a mixture-of-experts model routed each token of every sample to (`Sample.routed_experts`, for router replay in training). "
        "Needs `model.return_routed_experts` on a MoE model on GPU; elsewhere refused (400 naming this field).",
    )

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> "RolloutRequest":
        given = [f for f in PROMPT_FORMS if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt_token_ids, prompt, messages must be given"
                + (f" (got {', '.join(given)})" if given else " (got none)")
            )
        return self

    def with_id(self) -> "RolloutRequest":
        """This request with a ``request_id``, generating one when absent."""
        if self.request_id:
            return self
        return self.model_copy(update={"request_id": uuid.uuid4().hex})


class WeightVersionSpan(_Model):
    """Tokens ``[start, end)`` of a sample were produced by policy ``version`` (the base
    weights' version), with LoRA adapter ``adapter`` at ``adapter_version`` when the
    request named one. Both versions are integers, as ``publish*()`` returns them."""

    version: int = Field(
        description="The committed version of the base weights that produced these tokens: what `WeightPublisher.publish*()` returned for them, "
        "0 for the checkpoint's own weights (vLLM's label `default`; vLLM's own routes keep its string labels)."
    )
    start: int
    end: int
    adapter: Optional[str] = None
    adapter_version: Optional[int] = Field(default=None, description="The adapter's committed version (what `publish_adapter` returned for it); null without an adapter.")


# How a MoE model's expert ids travel (vLLM's own choice: uint8 up to 256 experts, else uint16).
RoutedExpertsDtype = Literal["uint8", "uint16"]


class RoutedExperts(_Model):
    """The experts a mixture-of-experts model's router chose (router replay, "R3"): for each
    token, each MoE layer's ``top_k`` expert ids, as the engine ran the token through the model.

    ``data`` is base64 of a C-order little-endian ``dtype`` array of ``shape``
    ``[num_tokens, num_layers, top_k]``; row ``i`` belongs to token ``start + i`` of the
    sequence it covers (a sample's ``prompt_token_ids + token_ids``; an episode's
    trajectory). The sequence's last token has no row: it was sampled, never fed through the
    model (a trainer that forwards it may route it freely: no loss reads its output).
    :meth:`to_numpy` decodes it."""

    start: int = Field(ge=0, description="Position of the first row's token in the sequence it covers.")
    shape: List[int] = Field(min_length=3, max_length=3, description="`[num_tokens, num_layers, top_k]`.")
    dtype: RoutedExpertsDtype = Field(description="Element type: `uint8` (models of at most 256 experts) or `uint16`; little-endian.")
    data: str = Field(description="Base64 of the array's bytes (C order, little-endian).")

    @model_validator(mode="after")
    def _data_fits_shape(self) -> "RoutedExperts":
        import math

        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape}: negative dimension")
        want = math.prod(self.shape) * (1 if self.dtype == "uint8" else 2)
        # Checked by length (4 base64 characters per 3 bytes, padded), not decoded: every
        # hop validates the model, and to_numpy decodes (strictly) where it is read.
        if len(self.data) != 4 * ((want + 2) // 3):
            raise ValueError(f"data holds {len(self.data)} base64 characters; shape {self.shape} of {self.dtype} needs {4 * ((want + 2) // 3)}")
        return self

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    @classmethod
    def from_numpy(cls, array: Any, start: int = 0) -> "RoutedExperts":
        """``array``: ``[num_tokens, num_layers, top_k]`` of expert ids (any integer dtype whose
        values fit: uint8 when every id is below 256, else uint16)."""
        import base64

        import numpy as np

        a = np.asarray(array)
        if a.ndim != 3:
            raise ValueError(f"routed experts must be [num_tokens, num_layers, top_k]; got shape {a.shape}")
        if a.size and (a.min() < 0 or a.max() > 0xFFFF):
            raise ValueError(f"expert ids outside 0..65535 ({a.min()}..{a.max()})")
        if a.dtype == np.uint8 or a.dtype == np.uint16:
            dtype = a.dtype.name  # as the engine chose it (by the model's expert count)
        else:
            dtype = "uint8" if a.size == 0 or a.max() < 256 else "uint16"
        data = np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        return cls(start=start, shape=list(a.shape), dtype=dtype, data=base64.b64encode(data).decode("ascii"))

    def to_numpy(self) -> Any:
        """The array (numpy, native ``dtype``), ``[num_tokens, num_layers, top_k]``."""
        import base64

        import numpy as np

        raw = np.frombuffer(base64.b64decode(self.data, validate=True), dtype=np.dtype(self.dtype).newbyteorder("<"))
        return raw.astype(self.dtype).reshape(self.shape)


FinishReason = Literal["stop", "length", "abort", "error"]


class _Scored(_Model):
    """A finished sample's reward, when its request asked for one (on a stream: the sample's last chunk)."""

    reward: Optional[float] = Field(default=None, description="The sample's reward under the request's reward spec; null when none was asked for or it failed.")
    reward_details: Optional[Dict[str, Any]] = Field(default=None, description="What the reward function reported besides the number (math_equal: `extracted`, `method`).")
    reward_error: Optional[str] = Field(default=None, description="Why the reward is null although one was asked for (the function raised, timed out, returned no number).")


class Sample(_Scored):
    token_ids: List[int]
    logprobs: Optional[List[float]] = Field(default=None, description="Logprob of each sampled token (same length as token_ids).")
    finish_reason: Optional[FinishReason] = None
    stop_reason: Union[str, int, None] = Field(default=None, description="The stop string or token id that ended the sample, if any.")
    text: Optional[str] = None
    weight_versions: List[WeightVersionSpan] = Field(default_factory=list)
    routed_experts: Optional[RoutedExperts] = Field(
        default=None,
        description="When the request asked (`return_routed_experts`): the experts routed for `prompt_token_ids + token_ids` from `start` "
        "(0 for a rollout; in an episode's turn, the trajectory position where this turn's new rows begin), every token but the last; null otherwise.",
    )


class RolloutResult(_Model):
    request_id: str
    prompt_token_ids: List[int]
    samples: List[Sample]
    replica_id: Optional[str] = Field(default=None, description="The engine replica that served the request (for debugging routing).")
    committed_version: Optional[int] = Field(
        default=0,
        description="The newest committed policy version the replica knew of when the result was returned; null when it could not know "
        "(it had not reached the weight-sync coordinator for longer than the membership bound).",
    )
    staleness: Optional[int] = Field(
        default=0,
        description="`committed_version` minus the oldest version that produced any token of the result: how many policy updates behind it is; "
        "null when either is unknown.",
    )


class RolloutChunk(_Scored):
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
    routed_experts: Optional[RoutedExperts] = Field(
        default=None, description="On a sample's last chunk, when the request asked (`return_routed_experts`): the whole sample's, as `Sample.routed_experts`."
    )


class EpisodeStart(_Input):
    """Begin a token-exact episode: its first messages, rendered once with the chat template."""

    messages: List[ChatMessage] = Field(min_length=1, description="The episode's opening messages (system, user).")
    max_turns: Optional[Annotated[int, Field(ge=1, le=ENGINE_INT_MAX), BeforeValidator(_integral)]] = Field(default=None, description="Model turns at most; capped by `episodes.max_turns`.")
    max_tokens: Optional[Annotated[int, Field(ge=1, le=ENGINE_INT_MAX), BeforeValidator(_integral)]] = Field(default=None, description="Tokens in the whole episode at most; capped by the context length.")
    tools: List[Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]] = Field(
        default_factory=list, max_length=64, description="The tools the model may call: `python`, `calculator`, or ones the platform registered under `tools.functions`."
    )
    max_tool_calls: Optional[Annotated[int, Field(ge=0, le=ENGINE_INT_MAX), BeforeValidator(_integral)]] = Field(
        default=None, description="Tool calls the episode may run at most; capped by `tools.max_calls_per_episode`."
    )
    reward: Optional[RewardSpec] = Field(
        default=None, description="Score the episode when it ends (`Trajectory.reward`), on the model's last turn; replaces `rewards.default` for this episode."
    )
    adapter: Optional[AdapterName] = Field(
        default=None,
        description="A published LoRA adapter to generate every turn with, by name: each turn takes its newest committed version when the turn starts, as each turn "
        "takes the base weights' (each turn's `weight_versions` spans name it). None: the base model. An adapter not published is refused (400 naming `adapter`).",
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Every turn returns the experts routed for its new trajectory tokens (`TurnResult.sample.routed_experts`, rows from its `start`), "
        "and the trajectory all of them (`Trajectory.routed_experts`). Needs `model.return_routed_experts` (as `RolloutRequest.return_routed_experts`).",
    )


class NamedToolChoice(_Input):
    name: str = Field(min_length=1, max_length=MAX_ID_LENGTH, description="The tool the model must call.")


class EpisodeRef(_Input):
    """Names an episode (its id also names the replica holding it)."""

    episode_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)


class EpisodeTurnBody(_Input):
    """Body of ``POST /v1/episodes/{episode_id}/turns``: the messages since the model's last
    turn (none before the first), then a sample."""

    messages: List[ChatMessage] = Field(default_factory=list, description="New environment, tool or user messages, appended as rendered tokens.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice] = Field(
        default="auto",
        description="As in OpenAI's API: `auto` (the model may call the episode's tools), `none`, `required` (it must call one), "
        "or `{name}` (it must call that one). A turn's own `sampling.structured_outputs` replaces the constraint a call would add.",
    )


class EpisodeTurn(EpisodeTurnBody, EpisodeRef):
    """One model turn of an episode."""


class EpisodeStarted(_Model):
    episode_id: str
    prompt_token_ids: List[int] = Field(description="The opening messages as rendered, with the generation prompt.")
    replica_id: str


class ToolCallResult(_Model):
    id: str
    name: str
    arguments: str = Field(description="As the model wrote them (JSON).")
    output: str = Field(description="What the model reads back, as a tool message, at the start of its next turn.")
    error: Optional[str] = Field(default=None, description="Why the call failed (unknown tool, bad arguments, the tool raised, a limit); the output says it too.")


class TurnResult(_Model):
    episode_id: str
    turn: int = Field(description="1 for the first model turn.")
    appended_token_ids: List[int] = Field(description="The tokens put before this turn (not the model's): the last turn's tool output, then the new messages.")
    sample: Sample = Field(description="The model's turn: exactly the tokens it sampled, with their logprobs.")
    tool_calls: List[ToolCallResult] = Field(default_factory=list, description="The calls the model made in this turn, already run; their output opens its next turn.")
    replica_id: str


class ModelTurnSpan(_Model):
    start: int
    end: int
    finish_reason: Optional[FinishReason] = None
    weight_versions: List[WeightVersionSpan] = Field(default_factory=list, description="Positions in the whole trajectory.")


class Trajectory(_Scored):
    """The whole episode: every token, which of them the model sampled, and their logprobs;
    when it ended, its reward."""

    episode_id: str
    token_ids: List[int]
    loss_mask: List[int] = Field(description="1 for the model's tokens, 0 for everything rendered from messages.")
    logprobs: List[Optional[float]] = Field(description="The model's logprob of each of its tokens; null for the others.")
    turns: List[ModelTurnSpan]
    routed_experts: Optional[RoutedExperts] = Field(
        default=None,
        description="When the episode asked (`EpisodeStart.return_routed_experts`): the experts routed for every trajectory token from 0 but the last, "
        "each row as the turn that first ran the token through the model routed it; null otherwise.",
    )


class RolloutBatch(_Input):
    """Body of ``POST /v1/rollouts``."""

    requests: List[RolloutRequest] = Field(min_length=1)


class RolloutBatchResult(_Model):
    results: List[RolloutResult]


class ErrorDetail(_Model):
    message: str
    type: str = Field(
        description="invalid_request_error, authentication_error, forbidden, episode_lost, adapter_not_found, sync_error, delta_base_error, fleet_asleep, sleep_unavailable, internal_error (a fault of the platform's own, "
        "logged with its traceback), or the retryable stale_weights, overloaded and engine_unavailable (rollout.wire_errors.TABLE: a test keeps the two alike)."
    )
    field: Optional[str] = Field(default=None, description="The request field at fault, e.g. `requests[3].sampling.max_tokens`.")


class ErrorResponse(_Model):
    """The body of every error answer of the ingress's own routes."""

    error: ErrorDetail
