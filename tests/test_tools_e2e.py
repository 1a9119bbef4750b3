"""Tools in episodes, end to end on the built model, through the handle and HTTP.

The random model never calls a tool by itself, so calls are forced: by ``tool_choice``
(vLLM's structural tag for hermes, the configured parser) or by a turn's own structured
output naming the exact call. Each forced call goes the whole way: the model's text is
parsed by vLLM's parser, the tool runs on a Ray actor, and its output opens the next turn
as tool-role tokens that the loss mask leaves out."""

from __future__ import annotations

import json
import math
import time
import uuid

import pytest
import ray
from transformers import AutoTokenizer

from rollout.api import RolloutRequest, SamplingConfig, StructuredOutputs
from rollout.errors import InvalidRequestError
from tests.test_episodes_e2e import assert_trajectory_is_the_turns

pytestmark = pytest.mark.e2e

OPENING = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is 6 times 7?"}]


def call(name: str, **arguments) -> SamplingConfig:
    """Sampling that makes the model write exactly this call, in hermes's format."""
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    return SamplingConfig(max_tokens=200, structured_outputs=StructuredOutputs(choice=[text]), seed=1)


FREE = SamplingConfig(max_tokens=12, temperature=1.0, seed=3)


async def test_a_five_turn_episode_with_tool_calls_is_token_exact(any_client, reference, model_dir):
    import platform as stdlib_platform

    episode = await any_client.start_episode(OPENING, tools=["calculator", "python", "python_version"], max_tool_calls=3)
    turns = [await episode.turn(sampling=SamplingConfig(max_tokens=64, seed=2), tool_choice={"name": "python_version"})]
    turns.append(await episode.turn(sampling=call("calculator", expression="6*7")))
    turns.append(await episode.turn([{"role": "user", "content": "Check it in Python."}], sampling=call("python", code="print(6*7)")))
    turns.append(await episode.turn([{"role": "user", "content": "Thanks."}], sampling=FREE))
    with pytest.raises(InvalidRequestError, match="made its max_tool_calls=3 calls") as e:
        await episode.turn(sampling=FREE, tool_choice="required")
    assert e.value.field == "tool_choice"
    turns.append(await episode.turn([{"role": "user", "content": "Bye."}], sampling=FREE))
    traj = await episode.end()

    # The forced calls were parsed, run, and answered.
    (version,) = turns[0].tool_calls
    assert (version.name, version.arguments, version.error) == ("python_version", "{}", None)
    assert version.output == stdlib_platform.python_version()  # (the tool workers run this Python)
    assert [(c.name, c.output, c.error) for c in turns[1].tool_calls] == [("calculator", "42", None)]
    assert [(c.name, json.loads(c.output), c.error) for c in turns[2].tool_calls] == [("python", {"status": "ok", "stdout": "42\n"}, None)]
    assert turns[3].tool_calls == [] and turns[4].tool_calls == []

    # Each call's output opens the next turn, as tool-role tokens (the chat template's).
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for k in (1, 2, 3):
        opened = tokenizer.decode(turns[k].appended_token_ids)
        # (after closing the model's turn when its last token, here end-of-text, did not)
        assert opened.startswith(("<|im_start|>tool\n", "<|im_end|>\n<|im_start|>tool\n")), opened
        assert "<|im_start|>tool\n" + turns[k - 1].tool_calls[0].output + "<|im_end|>" in opened, opened
    assert "<|im_start|>user\nCheck it in Python." in tokenizer.decode(turns[2].appended_token_ids)

    # The trajectory: the rendered messages, tool output and the sampled tokens, turn by turn.
    assert_trajectory_is_the_turns(episode, turns, traj)

    # Unconstrained turns: the model's logprobs are a fresh engine's, teacher-forced on the
    # whole trajectory (tool output included). A forced call's logprobs are those of the
    # constrained distribution, so they are left out here.
    forced = ray.get(reference.teacher_forced_logprobs.remote(traj.token_ids))
    for k in (3, 4):
        span = traj.turns[k]
        for i in range(span.start, span.end):
            assert math.isclose(traj.logprobs[i], forced[i], abs_tol=1e-3), (k, i, traj.logprobs[i], forced[i])


def tokenizer_of(platform):
    return AutoTokenizer.from_pretrained(platform.model.path)


HAZARDS = [
    ("while True:\n    pass", '"status": "stopped: CPU time limit"'),
    ("x = bytearray(1 << 31)", "MemoryError"),
    ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", "Temporary failure in name resolution"),
    ("open('{target}', 'w').write('x')", "Error: [Errno"),  # read-only, or not there at all
]


async def test_the_python_tool_stops_each_hazard_within_its_limits_and_the_replica_keeps_serving(handle_client, platform, tmp_path):
    limits = platform.tools.python
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    for code, says in HAZARDS:
        episode = await handle_client.start_episode(OPENING, tools=["python"])
        t0 = time.monotonic()
        turn = await episode.turn(sampling=call("python", code=code.format(target=target)))
        seconds = time.monotonic() - t0
        (result,) = turn.tool_calls
        assert says in result.output and len(result.output) <= platform.tools.output_chars, (code, result.output)
        assert seconds < limits.wall_time_s + 10, (code, seconds)
        # The model reads the refusal as a tool message, and its episode goes on.
        tail = await episode.turn(sampling=FREE, tool_choice="none")
        assert tail.tool_calls == [] and f"<|im_start|>tool\n{result.output}<|im_end|>" in tokenizer_of(platform).decode(tail.appended_token_ids)
        await episode.end()
    assert not target.exists()
    (result,) = await handle_client.generate([RolloutRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingConfig(max_tokens=8, ignore_eos=True))])
    assert len(result.samples[0].token_ids) == 8, "the replica serves on"


async def test_tool_requests_that_cannot_run_name_the_field(any_client):
    with pytest.raises(InvalidRequestError) as e:
        await any_client.start_episode(OPENING, tools=["calculator", "web_search"])
    assert e.value.field == "tools[1]" and "unknown tool 'web_search'" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        await any_client.start_episode(OPENING, tools=["calculator"], max_tool_calls=10_000)
    assert e.value.field == "max_tool_calls"
    episode = await any_client.start_episode(OPENING, tools=["calculator"])
    with pytest.raises(InvalidRequestError) as e:
        await episode.turn(sampling=FREE, tool_choice={"name": "python"})
    assert e.value.field == "tool_choice.name"
    plain = await any_client.start_episode(OPENING)
    with pytest.raises(InvalidRequestError) as e:
        await plain.turn(sampling=FREE, tool_choice="required")
    assert e.value.field == "tool_choice"
    # A call the model makes with bad arguments is answered with the error, not a dead turn.
    turn = await episode.turn(sampling=call("calculator", expression="__import__('os')"))
    (result,) = turn.tool_calls
    assert result.error and result.output.startswith("error: ") and "not arithmetic" in result.output
    await episode.end()
    await plain.end()


async def test_structured_outputs_constrain_a_plain_request_and_one_vllm_cannot_compile_names_the_field(any_client):
    choices = ["[rock]", "[paper]", "[scissors]"]
    sampling = SamplingConfig(max_tokens=16, structured_outputs=StructuredOutputs(choice=choices))
    results = await any_client.generate([RolloutRequest(prompt_token_ids=[5 + i, 6], sampling=sampling) for i in range(4)])
    assert all(r.samples[0].text in choices and r.samples[0].finish_reason == "stop" for r in results)
    bad = SamplingConfig(max_tokens=4, structured_outputs=StructuredOutputs(json_schema={"type": "object", "properties": {"x": {"type": "no-such-type"}}}))
    with pytest.raises(InvalidRequestError) as e:
        await any_client.generate([RolloutRequest(prompt_token_ids=[5], sampling=FREE), RolloutRequest(prompt_token_ids=[6], sampling=bad)])
    assert e.value.field == "requests[1].sampling.structured_outputs", e.value
    with pytest.raises(InvalidRequestError) as e:
        await any_client.generate([RolloutRequest(prompt_token_ids=[5], sampling=SamplingConfig(structured_outputs=StructuredOutputs(regex="(unclosed")))])
    assert e.value.field == "requests[0].sampling.structured_outputs.regex", e.value
    episode = await any_client.start_episode(OPENING)
    with pytest.raises(InvalidRequestError) as e:
        await episode.turn(sampling=bad)
    assert e.value.field == "sampling.structured_outputs", e.value
    await episode.end()
