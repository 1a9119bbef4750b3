"""End to end through real Ray, Serve and vLLM (CPU) on the built model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray

from rollout.api import RolloutRequest, SamplingConfig
from tests.conftest import API_KEY, wait_until

pytestmark = pytest.mark.e2e

PROMPTS = [[11 + i, 200 + 3 * i, 57, 900 - i, 33 + 5 * i][: 2 + i % 4] + list(range(40 + i, 40 + i + i)) for i in range(8)]


def greedy(ids, max_tokens=24, **kw) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=ids, sampling=SamplingConfig(max_tokens=max_tokens, temperature=0.0, **kw))


async def test_token_in_token_out_returns_sampled_tokens_with_their_logprobs(handle_client):
    (res,) = await handle_client.generate([RolloutRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingConfig(max_tokens=16, ignore_eos=True))])
    assert res.prompt_token_ids == [5, 6, 7]
    (s,) = res.samples
    assert len(s.token_ids) == 16 and s.finish_reason == "length"
    assert s.logprobs is not None and len(s.logprobs) == 16
    assert all(lp <= 0.0 for lp in s.logprobs)
    assert s.weight_versions and s.weight_versions[0].start == 0 and s.weight_versions[-1].end == 16


async def test_greedy_output_equals_vllm_llm_generate_on_the_same_model(handle_client, reference):
    results = await handle_client.generate([greedy(p, ignore_eos=True) for p in PROMPTS])
    expected = ray.get(reference.greedy.remote(PROMPTS, 24, ignore_eos=True))
    assert [r.samples[0].token_ids for r in results] == expected


async def test_built_model_greedy_output_is_varied_and_depends_on_the_prompt(handle_client):
    results = await handle_client.generate([greedy(p, max_tokens=32, ignore_eos=True) for p in PROMPTS])
    outs = [tuple(r.samples[0].token_ids) for r in results]
    assert len(set(outs)) == len(outs), "different prompts must give different continuations"
    for prompt, out in zip(PROMPTS, outs):
        assert len(set(out)) >= 8, f"a degenerate continuation {out}"
        assert set(out) != {prompt[-1]}, "the model only repeats the last prompt token"


async def test_n_samples_come_back_distinct_with_logprobs(any_client):
    (res,) = await any_client.generate([RolloutRequest(prompt="the reward model", n=4, sampling=SamplingConfig(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))])
    assert len(res.samples) == 4
    assert len({tuple(s.token_ids) for s in res.samples}) > 1
    for s in res.samples:
        assert len(s.logprobs) == len(s.token_ids) == 16


async def test_results_keep_request_order_and_ids(any_client):
    reqs = [greedy(p, max_tokens=4).model_copy(update={"request_id": f"req-{i}"}) for i, p in enumerate(PROMPTS)]
    results = await any_client.generate(reqs)
    assert [r.request_id for r in results] == [f"req-{i}" for i in range(len(PROMPTS))]
    assert [r.prompt_token_ids for r in results] == PROMPTS


async def test_an_http_batch_spanning_several_engine_calls_returns_every_result_in_order(base_url, platform):
    # The ingress splits it into concurrent engine calls that share one HTTP request's
    # context; each must be routed (Serve keys pending calls by that request's id).
    size = 2 * platform.deployment.client_batch_size + 5
    body = {"requests": [{"prompt_token_ids": [3 + i % 50, 7], "request_id": f"r{i}", "sampling": {"max_tokens": 2}} for i in range(size)]}
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        r = await c.post("/v1/rollouts", json=body)
    assert r.status_code == 200, r.text
    assert [x["request_id"] for x in r.json()["results"]] == [f"r{i}" for i in range(size)]


async def test_stop_string_ends_the_sample_before_the_string(handle_client):
    prompt = PROMPTS[3]
    (full,) = await handle_client.generate([greedy(prompt, max_tokens=48, ignore_eos=True)])
    text = full.samples[0].text
    i = next(i for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].isalnum())
    stop = text[i : i + 2]
    (res,) = await handle_client.generate([greedy(prompt, max_tokens=48, ignore_eos=True, stop=[stop])])
    s = res.samples[0]
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert s.text == text[: text.index(stop)]
    assert s.token_ids == full.samples[0].token_ids[: len(s.token_ids)]


async def test_streaming_yields_the_same_tokens_as_a_unary_call(any_client):
    req = greedy(PROMPTS[5], max_tokens=20, ignore_eos=True)
    (unary,) = await any_client.generate([req])
    chunks = [c async for c in any_client.stream(req)]
    assert len(chunks) > 1, "tokens must arrive incrementally"
    assert chunks[0].prompt_token_ids == PROMPTS[5]
    assert [t for c in chunks for t in c.token_ids] == unary.samples[0].token_ids
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(unary.samples[0].logprobs, abs=1e-4)
    assert chunks[-1].finish_reason == "length" and chunks[-1].weight_versions


async def test_seeded_request_gives_the_same_tokens_over_http_and_handle(handle_client, http_client):
    req = RolloutRequest(prompt="one two three", sampling=SamplingConfig(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True))
    (a,) = await handle_client.generate([req])
    (b,) = await http_client.generate([req])
    assert a.samples[0].token_ids == b.samples[0].token_ids
    assert a.samples[0].logprobs == pytest.approx(b.samples[0].logprobs, abs=1e-5)


def long_request() -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=[9, 8, 7], sampling=SamplingConfig(max_tokens=480, ignore_eos=True))


async def _engine_idle(handle_client):
    s = await handle_client.stats()
    return s.inflight_requests == 0 and s.unfinished_requests == 0


async def test_cancelling_a_unary_call_aborts_it_in_the_engine(handle_client):
    task = asyncio.create_task(handle_client.generate([long_request(), long_request()]))

    async def busy():
        s = await handle_client.stats()
        return s.unfinished_requests >= 2

    await wait_until(busy, timeout_s=60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: _engine_idle(handle_client), timeout_s=30)


async def test_leaving_a_stream_early_aborts_it_in_the_engine(any_client, handle_client):
    seen = 0
    async for chunk in any_client.stream(long_request()):
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    await wait_until(lambda: _engine_idle(handle_client), timeout_s=30)
    # The engine is free: a short request finishes promptly.
    (res,) = await asyncio.wait_for(handle_client.generate([greedy([1, 2, 3], max_tokens=4)]), timeout=60)
    assert len(res.samples[0].token_ids) == 4


def test_blocking_api_works_outside_an_event_loop(handle_client):
    (res,) = handle_client.generate_sync([{"prompt": "hello", "sampling": {"max_tokens": 3}}])
    assert len(res.samples[0].token_ids) <= 3


async def test_stats_report_engine_state_and_weight_version(handle_client, platform):
    s = await handle_client.stats()
    assert s.weight_version == "default"
    assert s.max_num_seqs == platform.model.max_num_seqs
    assert 0.0 <= s.kv_cache_usage <= 1.0
    assert s.prefix_cache_queries > 0


async def test_stats_over_http_are_one_replicas_load_as_over_a_handle(http_client, handle_client, base_url, platform):
    from rollout.contracts.load import ReplicaLoad

    await http_client.generate([greedy([1, 2, 3], max_tokens=2)])  # a prompt looked up in the prefix cache
    over_http, over_handle = await http_client.stats(), await handle_client.stats()
    assert isinstance(over_http, ReplicaLoad)
    assert over_http.replica_id and over_http.weight_version == over_handle.weight_version == "default"
    assert over_http.max_num_seqs == platform.model.max_num_seqs
    assert 0.0 <= over_http.kv_cache_usage <= 1.0 and over_http.prefix_cache_queries > 0
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        refused = await c.get("/v1/stats")
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        raw = await c.get("/v1/stats", headers={"Authorization": f"Bearer {API_KEY}"})
    assert raw.status_code == 200 and ReplicaLoad.model_validate(raw.json()).max_num_seqs == platform.model.max_num_seqs
