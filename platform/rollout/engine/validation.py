"""Checks that depend on the served model: vocabulary, context length, the cap on ``n``.

Static checks (types, ranges, exactly one prompt form) are in the pydantic models of
:mod:`rollout.api`; these run in the engine replica, which knows the model, before a
request is handed to vLLM, so a bad request never costs engine work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from rollout.api import GREEDY_BELOW, RolloutRequest
from rollout.config import CPU_NO_ROUTED_EXPERTS, ModelConfig
from rollout.errors import InvalidRequestError


ROUTED_EXPERTS_OFF = "model.return_routed_experts is off on this deployment (it needs a mixture-of-experts model, on GPU)"


def routed_experts_refusal(model: ModelConfig, device: str) -> Optional[str]:
    """Why this replica cannot return routed experts; None when it can."""
    if model.return_routed_experts:
        return None
    return f"{ROUTED_EXPERTS_OFF}; it cannot be on here: {CPU_NO_ROUTED_EXPERTS}" if device == "cpu" else ROUTED_EXPERTS_OFF


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_n: int
    # Why a request may not ask for routed experts (None: it may).
    routed_experts_refusal: Optional[str] = ROUTED_EXPERTS_OFF


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")


def check_request(req: RolloutRequest, prompt_ids: Sequence[int], limits: ModelLimits) -> None:
    """Raise :class:`InvalidRequestError` naming the field when ``req`` cannot run."""
    if req.n > limits.max_n:
        raise InvalidRequestError("n", f"{req.n} samples requested; the limit is limits.max_n={limits.max_n}")
    if req.n > 1 and req.sampling.temperature < GREEDY_BELOW:
        # vLLM refuses it when the request is built; its samples would all be the same.
        raise InvalidRequestError(
            "n", f"{req.n} samples with greedy sampling (sampling.temperature {req.sampling.temperature:g}) would all be the same: ask for n=1, or a temperature of at least {GREEDY_BELOW:g}"
        )
    if req.return_routed_experts and limits.routed_experts_refusal is not None:
        raise InvalidRequestError("return_routed_experts", limits.routed_experts_refusal)
    if req.prompt_token_ids is not None:
        _check_ids("prompt_token_ids", req.prompt_token_ids, limits.vocab_size)
    _check_ids("sampling.stop_token_ids", req.sampling.stop_token_ids, limits.vocab_size)
    so = req.sampling.structured_outputs
    if so is not None and so.regex is not None:
        try:
            re.compile(so.regex)
        except re.error as e:
            raise InvalidRequestError("sampling.structured_outputs.regex", f"not a regular expression: {e}") from None
    prompt_field = "prompt_token_ids" if req.prompt_token_ids is not None else ("prompt" if req.prompt is not None else "messages")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequestError(
            prompt_field,
            f"prompt is {len(prompt_ids)} tokens; it must be shorter than max_model_len={limits.max_model_len}",
        )
    room = limits.max_model_len - len(prompt_ids)
    if req.sampling.max_tokens > room:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"{req.sampling.max_tokens} exceeds the context: prompt is {len(prompt_ids)} tokens, "
            f"max_model_len={limits.max_model_len}, so at most {room} can be generated",
        )
