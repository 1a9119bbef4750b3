"""Bad input is rejected with a 4xx (HTTP) or a typed exception (client) naming the field,
and the service keeps serving the next valid request."""

from __future__ import annotations

import httpx
import pytest

from rollout.errors import AuthenticationError, InvalidRequestError
from tests.conftest import API_KEY, MAX_MODEL_LEN, MAX_N

pytestmark = pytest.mark.e2e

OK = {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}}

# (case, request body, field the error must name, words the message must contain)
BAD = [
    ("wrong type", {"prompt_token_ids": "abc"}, "requests[0].prompt_token_ids", "list"),
    ("max_tokens zero", {**OK, "sampling": {"max_tokens": 0}}, "requests[0].sampling.max_tokens", "greater than or equal to 1"),
    ("max_tokens over context", {**OK, "sampling": {"max_tokens": MAX_MODEL_LEN}}, "requests[0].sampling.max_tokens", f"max_model_len={MAX_MODEL_LEN}"),
    ("token id outside vocab", {"prompt_token_ids": [1, 10**6]}, "requests[0].prompt_token_ids[1]", "outside the vocabulary"),
    ("negative token id", {"prompt_token_ids": [1, -2]}, "requests[0].prompt_token_ids[1]", "greater than or equal to 0"),
    ("prompt longer than context", {"prompt_token_ids": [5] * (MAX_MODEL_LEN + 10)}, "requests[0].prompt_token_ids", f"max_model_len={MAX_MODEL_LEN}"),
    ("n over cap", {**OK, "n": MAX_N + 1}, "requests[0].n", f"limits.max_n={MAX_N}"),
    ("two prompt forms", {**OK, "prompt": "hello"}, "requests[0]", "exactly one of"),
    ("no prompt", {"sampling": {"max_tokens": 4}}, "requests[0]", "exactly one of"),
    ("unknown field", {**OK, "temprature": 0.5}, "requests[0].temprature", "not permitted"),
    ("top_p out of range", {**OK, "sampling": {"top_p": 1.5}}, "requests[0].sampling.top_p", "less than or equal to 1"),
]


@pytest.mark.parametrize("case,body,field,words", BAD, ids=[b[0] for b in BAD])
async def test_http_rejects_bad_request_naming_the_field(base_url, case, body, field, words):
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        r = await c.post("/v1/rollouts", json={"requests": [body]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"].startswith(field), err
        assert words in err["message"], err
        ok = await c.post("/v1/rollouts", json={"requests": [OK]})
        assert ok.status_code == 200 and len(ok.json()["results"][0]["samples"][0]["token_ids"]) == 4


@pytest.mark.parametrize("case,body,field,words", BAD, ids=[b[0] for b in BAD])
async def test_client_raises_typed_error_naming_the_field(handle_client, case, body, field, words):
    with pytest.raises(InvalidRequestError) as exc:
        await handle_client.generate([body])
    assert exc.value.field.startswith(field) and words in exc.value.message
    (res,) = await handle_client.generate([OK])
    assert len(res.samples[0].token_ids) == 4


async def test_error_names_the_index_of_the_bad_request_in_a_batch(handle_client, base_url):
    batch = [OK] * 70 + [{**OK, "n": MAX_N + 1}]
    with pytest.raises(InvalidRequestError) as exc:
        await handle_client.generate(batch)
    assert exc.value.field == "requests[70].n"
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        r = await c.post("/v1/rollouts", json={"requests": batch})
    assert r.status_code == 400 and r.json()["error"]["field"] == "requests[70].n"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}], ids=["missing", "wrong", "not-bearer"])
async def test_api_key_is_required_on_every_api_route(base_url, headers):
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as c:
        for method, path, body in [("POST", "/v1/rollouts", {"requests": [OK]}), ("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/v1/models", None)]:
            r = await c.request(method, path, json=body)
            assert r.status_code == 401, (path, r.text)
            assert "API key" in r.json()["error"]["message"]


async def test_http_client_raises_authentication_error_on_wrong_key(base_url):
    from rollout.client import RolloutClient

    c = RolloutClient.http(base_url, api_key="nope")
    with pytest.raises(AuthenticationError):
        await c.generate([OK])


async def test_healthz_needs_no_key(base_url):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
        r = await c.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


async def test_an_oversized_body_is_refused_with_413_before_it_is_parsed_and_serving_goes_on(base_url):
    from tests.conftest import MAX_BODY_BYTES

    big = {"requests": [{**OK, "request_id": "x" * 100}] * (MAX_BODY_BYTES // 100)}
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        r = await c.post("/v1/rollouts", json=big)
        assert r.status_code == 413, r.text[:300]
        assert r.json()["error"]["field"] == "body" and "http.max_body_bytes" in r.json()["error"]["message"]

        # Without Content-Length (chunked), counted as it arrives.
        async def chunks():
            data = b'{"requests": [' + b" " * (MAX_BODY_BYTES + 1)
            for i in range(0, len(data), 1 << 16):
                yield data[i : i + (1 << 16)]

        r = await c.post("/v1/rollouts", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text[:300]
        ok = await c.post("/v1/rollouts", json={"requests": [OK]})
        assert ok.status_code == 200


# Issue 31: two bodies schemathesis found that got a bare 500 (vLLM refused the sampling
# parameters when the request was built). Each is now a 400 naming the field at fault.
ALL_TOOL_MESSAGES = (
    '{"messages": [{"name": null, "content": "\\u00f0", "role": "tool"}, {"content": "\\u008bO\\udbd9\\ude3d\\u00f6yh6\\udbc8\\udfca<\\u00da\\ud896\\udfee\\ud824\\udf13", '
    '"role": "tool"}, {"role": "tool", "content": "\\u0090\\u00af"}], "n": 3, "request_id": "0", "sampling": {"max_tokens": 8, "ignore_eos": false, "logprobs": false, '
    '"stop": [], "temperature": 0.0}, "session_id": "s"}'
)


async def test_an_episode_turn_with_a_temperature_vllm_refuses_is_a_400_naming_it_and_the_episode_goes_on(base_url):
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        started = await c.post("/v1/episodes", json={"messages": [{"role": "user", "content": "hi"}]})
        assert started.status_code == 200, started.text
        turns = f"/v1/episodes/{started.json()['episode_id']}/turns"
        r = await c.post(turns, json={"sampling": {"temperature": 16.516691213187798, "top_p": 0.573584850452408}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "sampling.temperature", r.json()
        ok = await c.post(turns, json={"sampling": {"temperature": 1.5, "top_p": 0.57, "max_tokens": 4}})
        assert ok.status_code == 200 and ok.json()["turn"] == 1, ok.text


@pytest.mark.parametrize("path", ["/v1/rollouts/stream", "/v1/rollouts"])
async def test_several_greedy_samples_are_a_400_naming_n_and_one_is_served(base_url, path):
    import json

    body = json.loads(ALL_TOOL_MESSAGES)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        raw = ALL_TOOL_MESSAGES if path.endswith("stream") else json.dumps({"requests": [body]})
        r = await c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == ("n" if path.endswith("stream") else "requests[0].n") and "greedy" in err["message"], err
        # The chat template renders these messages: with one sample the same request is served.
        one = {**body, "n": 1}
        ok = await c.post(path, json=one if path.endswith("stream") else {"requests": [one]})
        assert ok.status_code == 200, ok.text
