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
    from rollout.errors import AdapterNotFoundError

    err = pickle.loads(pickle.dumps(AdapterNotFoundError("'math' is not a published LoRA adapter", field="name")))
    assert (err.field, err.message, str(err)) == ("name", "'math' is not a published LoRA adapter", "name: 'math' is not a published LoRA adapter")
    assert pickle.loads(pickle.dumps(AdapterNotFoundError("The lora adapter 'math' cannot be found."))).field is None


def test_a_samples_versions_are_the_integers_publishes_return_not_vllms_labels():
    """vLLM labels weight versions with strings ("default" before any update, then the
    numbers the platform sets); a sample's spans carry the platform's integers, as
    ``publish*()`` and ``adapter_version`` are, over Serve and in JSON alike."""
    from types import SimpleNamespace

    from vllm.outputs import WeightVersionSpan as VllmSpan

    from rollout.api import Sample
    from rollout.engine.convert import spans, to_chunk, to_sample
    from rollout.sync.adapters import ServedAdapter

    completion = SimpleNamespace(
        index=0, token_ids=[7, 8, 9], logprobs=None, finish_reason="length", stop_reason=None, text="x",
        weight_versions=[VllmSpan("default", 0, 1), VllmSpan("3", 1, 3)],
    )
    lora = ServedAdapter(name="math", version=2, lora_id=5, path="/tmp/x")
    sample = to_sample(completion, lora)
    assert [(s.version, s.start, s.end, s.adapter, s.adapter_version) for s in sample.weight_versions] == [(0, 0, 1, "math", 2), (3, 1, 3, "math", 2)]
    assert all(type(s.version) is int for s in sample.weight_versions)
    assert [s.version for s in to_chunk("r", completion).weight_versions] == [0, 3] == [s.version for s in spans(completion)]
    wire = sample.model_dump(mode="json")["weight_versions"]
    assert [(s["version"], s["adapter_version"]) for s in wire] == [(0, 2), (3, 2)]
    assert Sample.model_validate_json(sample.model_dump_json()) == sample


def test_sampled_logprobs_read_vllms_flat_lists_as_its_dicts():
    """The replica asks vLLM for flat logprobs (a constant number of objects a request);
    read back, they are the sampled tokens' logprobs, as from vLLM's per-token dicts, also
    when a position holds more entries than the sampled one and for a streamed delta."""
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs

    from rollout.api import SamplingConfig
    from rollout.engine.convert import sampled_logprobs, to_sampling_params

    assert to_sampling_params(SamplingConfig(max_tokens=4), 1).flat_logprobs is True
    steps = [([5, 9], [-0.5, -0.25], 3), ([7, 5], [-1.5, -0.125], 2), ([2, 7], [-2.0, -0.75], 1)]  # (token ids, logprobs, rank): sampled first
    sampled = [ids[0] for ids, _, _ in steps]
    for num_logprobs in (0, 1):
        flat, dicts = create_sample_logprobs(True), create_sample_logprobs(False)
        for ids, lps, rank in steps:
            for container in (flat, dicts):
                append_logprobs_for_next_position(container, ids[: num_logprobs + 1], lps[: num_logprobs + 1], [None] * 2, rank, num_logprobs)
        assert sampled_logprobs(sampled, flat) == sampled_logprobs(sampled, dicts) == [-0.5, -1.5, -2.0]
        assert sampled_logprobs(sampled[1:], flat[1:]) == [-1.5, -2.0]  # a delta, as vLLM slices it
    assert sampled_logprobs(sampled, None) is None
