"""The OpenAI-compatible endpoints answer standard requests from the official client."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.conftest import API_KEY

pytestmark = pytest.mark.e2e


@pytest.fixture
def oai(base_url):
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


async def test_models_lists_the_served_model(oai, platform):
    models = await oai.models.list()
    assert [m.id for m in models.data] == [platform.model.name]


async def test_completion_answers_a_standard_request(oai, platform):
    r = await oai.completions.create(model=platform.model.name, prompt="the answer is", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0


async def test_completion_with_token_prompt_and_logprobs_matches_our_api(oai, platform, handle_client):
    from rollout.api import RolloutRequest, SamplingConfig

    r = await oai.completions.create(model=platform.model.name, prompt=[5, 6, 7], max_tokens=6, temperature=0, logprobs=0)
    (ours,) = await handle_client.generate([RolloutRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingConfig(max_tokens=6, temperature=0))])
    assert r.choices[0].text == ours.samples[0].text
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ours.samples[0].logprobs, abs=1e-4)


async def test_chat_completion_answers_a_standard_request(oai, platform):
    r = await oai.chat.completions.create(
        model=platform.model.name, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], max_tokens=8, n=2
    )
    assert len(r.choices) == 2
    assert all(c.message.role == "assistant" for c in r.choices)


async def test_streaming_completion_delivers_server_sent_events(oai, platform):
    stream = await oai.completions.create(model=platform.model.name, prompt="one two", max_tokens=6, temperature=0, stream=True)
    events = [e async for e in stream]
    assert len(events) >= 2
    assert events[-1].choices[0].finish_reason in ("length", "stop")


async def test_unknown_model_is_a_400_naming_the_field(oai):
    with pytest.raises(BadRequestError) as exc:
        await oai.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert "model" in str(exc.value)
