"""Inline rewards end to end: a reward spec on a request is scored on the replica as each
sample finishes, through the handle, HTTP and a stream; a reward function that fails gives
the sample ``reward=None`` and the error, and the request still succeeds. The session
platform registers two stdlib functions as rewards (`length`: ``builtins:len``; `json`:
``json:loads``, which raises on text that is not JSON)."""

from __future__ import annotations

import pytest

from rollout.api import RewardSpec, RolloutRequest, SamplingConfig
from rollout.errors import InvalidRequestError

pytestmark = pytest.mark.e2e


def request(reward: dict, n: int = 2, **sampling) -> RolloutRequest:
    return RolloutRequest(prompt="the answer is", n=n, sampling=SamplingConfig(max_tokens=12, ignore_eos=True, **sampling), reward=RewardSpec.model_validate(reward))


async def test_every_sample_carries_its_reward_and_a_failing_function_only_its_error(any_client):
    scored, failing, matched = await any_client.generate([request({"name": "length"}), request({"name": "json"}), request({"name": "math_equal", "params": {"answer": "42"}})])
    for s in scored.samples:
        assert s.reward == float(len(s.text)) and s.reward_error is None
    for s in failing.samples:
        assert s.reward is None and s.reward_error.startswith("JSONDecodeError"), s
        assert len(s.token_ids) == 12, "the request itself succeeded"
    for s in matched.samples:
        assert s.reward == 0.0 and s.reward_details["extracted"] == s.text.strip() and s.reward_details["method"] in ("text", "unparsed", "symbolic", "numeric")


async def test_exact_match_rewards_the_greedy_answer_itself(any_client):
    (first,) = await any_client.generate([RolloutRequest(prompt="the answer is", sampling=SamplingConfig(max_tokens=12, temperature=0.0, ignore_eos=True))])
    text = first.samples[0].text
    (again,) = await any_client.generate([request({"name": "exact_match", "params": {"answer": text}}, n=1, temperature=0.0)])
    assert again.samples[0].text == text and again.samples[0].reward == 1.0


async def test_a_stream_carries_each_samples_reward_on_its_last_chunk(any_client):
    chunks = [c async for c in any_client.stream(request({"name": "length"}))]
    texts: dict[int, str] = {}
    for c in chunks:
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is None:
            assert c.reward is None and c.reward_error is None
        else:
            assert c.reward == float(len(texts[c.index])), (c, texts[c.index])
    assert {c.index for c in chunks if c.finish_reason} == {0, 1}


async def test_an_unknown_reward_or_a_missing_param_is_refused_naming_the_field(any_client):
    for reward, field, needle in [
        ({"name": "nope"}, "requests[1].reward.name", "unknown reward 'nope'; this platform has exact_match, math_equal, regex_format, json, length"),
        ({"name": "math_equal"}, "requests[1].reward.params.answer", "math_equal: Field required"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            await any_client.generate([request({"name": "length"}), request(reward)])
        assert e.value.field == field and needle in e.value.message, e.value


async def test_an_episode_is_scored_when_it_ends_on_the_models_last_turn(any_client):
    opening = [{"role": "user", "content": "the answer is"}]
    episode = await any_client.start_episode(opening, reward={"name": "length"})
    first = await episode.turn(sampling=SamplingConfig(max_tokens=6, ignore_eos=True))
    assert first.sample.reward is None, "turns are not scored one by one"
    last = await episode.turn([{"role": "user", "content": "again"}], sampling=SamplingConfig(max_tokens=9, ignore_eos=True))
    assert (await episode.trajectory()).reward is None, "scored when it ends"
    ended = await episode.end()
    assert ended.reward == float(len(last.sample.text)) and ended.reward_error is None
    with pytest.raises(InvalidRequestError) as e:
        await any_client.start_episode(opening, reward={"name": "no_such_reward"})
    assert e.value.field == "reward.name"
