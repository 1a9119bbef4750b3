"""The request models reject what cannot run, naming the field."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from rollout.api import RolloutRequest, SamplingConfig
from rollout.engine.validation import ModelLimits, check_request
from rollout.errors import InvalidRequestError, from_validation_error

LIMITS = ModelLimits(vocab_size=100, max_model_len=64, max_n=4)


def test_exactly_one_prompt_form():
    with pytest.raises(ValidationError, match="exactly one of"):
        RolloutRequest(prompt="a", prompt_token_ids=[1])
    with pytest.raises(ValidationError, match="got none"):
        RolloutRequest()
    assert RolloutRequest(messages=[{"role": "user", "content": "hi"}]).messages[0].role == "user"


def test_validation_error_names_the_nested_field():
    with pytest.raises(ValidationError) as exc:
        RolloutRequest.model_validate({"prompt": "a", "sampling": {"max_tokens": 0}})
    err = from_validation_error(exc.value, "requests[3]")
    assert err.field == "requests[3].sampling.max_tokens"


@pytest.mark.parametrize(
    "req,ids,field",
    [
        (RolloutRequest(prompt_token_ids=[1, 100]), [1, 100], "prompt_token_ids[1]"),
        (RolloutRequest(prompt_token_ids=[1] * 64), [1] * 64, "prompt_token_ids"),
        (RolloutRequest(prompt_token_ids=[1] * 10, sampling=SamplingConfig(max_tokens=55)), [1] * 10, "sampling.max_tokens"),
        (RolloutRequest(prompt="x", n=5), [1], "n"),
        (RolloutRequest(prompt="x", sampling=SamplingConfig(stop_token_ids=[500])), [1], "sampling.stop_token_ids[0]"),
    ],
)
def test_model_limits_name_the_field(req, ids, field):
    with pytest.raises(InvalidRequestError) as exc:
        check_request(req, ids, LIMITS)
    assert exc.value.field == field


def test_a_request_that_fits_exactly_passes():
    check_request(RolloutRequest(prompt_token_ids=[1] * 10, sampling=SamplingConfig(max_tokens=54)), [1] * 10, LIMITS)


def test_invalid_request_error_survives_pickling_across_processes():
    err = pickle.loads(pickle.dumps(InvalidRequestError("requests[2].n", "too many")))
    assert err.field == "requests[2].n" and err.message == "too many" and str(err) == "requests[2].n: too many"
    assert err.at("requests[9]").field == "requests[9].requests[2].n"
