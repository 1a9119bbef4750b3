"""The built-in reward functions. Each takes the sample's text and its spec's params (checked
by its params model before any engine work) and returns the reward and its details."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.rewards.math_equal import math_equal as _math_equal


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ExactMatchParams(_Params):
    answer: str = Field(description="The reference answer.")
    ignore_case: bool = False


class MathEqualParams(_Params):
    answer: str = Field(description="The reference answer (LaTeX or plain).")


class RegexFormatParams(_Params):
    pattern: str = Field(min_length=1, description="A Python regular expression.")
    full_match: bool = Field(default=False, description="The whole text must match (else: found anywhere).")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return pattern


def exact_match(text: str, params: ExactMatchParams) -> tuple[float, dict[str, Any]]:
    got, want = text.strip(), params.answer.strip()
    if params.ignore_case:
        got, want = got.lower(), want.lower()
    return float(got == want), {}


def math_equal(text: str, params: MathEqualParams) -> tuple[float, dict[str, Any]]:
    verdict = _math_equal(text, params.answer)
    return float(verdict.equal), {"extracted": verdict.extracted, "method": verdict.method}


def regex_format(text: str, params: RegexFormatParams) -> tuple[float, dict[str, Any]]:
    match = (re.fullmatch if params.full_match else re.search)(params.pattern, text, flags=re.DOTALL)
    return float(match is not None), {}


# name -> (function, its params model)
BUILTINS = {
    "exact_match": (exact_match, ExactMatchParams),
    "math_equal": (math_equal, MathEqualParams),
    "regex_format": (regex_format, RegexFormatParams),
}
