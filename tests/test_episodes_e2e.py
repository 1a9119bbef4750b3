"""Token-exact episodes end to end, on the built model (one replica here), through the
handle and HTTP: five turns with tool and user messages between them; the trajectory is
exactly the rendered messages and the tokens the engine sampled, turn by turn; the model's
logprobs equal a fresh engine's teacher-forced logprobs of the same sequence; re-rendering
the same conversation as text gives other token ids; the bounds and a lost episode fail
with a clear error."""

from __future__ import annotations

import math

import pytest
import ray
from transformers import AutoTokenizer

from rollout.api import SamplingConfig
from rollout.episodes import EpisodeLostError
from rollout.errors import InvalidRequestError

pytestmark = pytest.mark.e2e

OPENING = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "What is 6 times 7?"}]
BETWEEN = [
    [{"role": "tool", "content": "42"}],
    [{"role": "user", "content": "Are you sure?"}],
    [{"role": "tool", "content": "calculator: 6*7 = 42"}, {"role": "user", "content": "Say it once more."}],
    [{"role": "user", "content": "Thanks."}],
]
SAMPLING = SamplingConfig(max_tokens=16, temperature=1.0, seed=3)


async def five_turns(client):
    episode = await client.start_episode(OPENING)
    turns = [await episode.turn(sampling=SAMPLING)]
    for messages in BETWEEN:
        turns.append(await episode.turn(messages, sampling=SAMPLING))
    return episode, turns, await episode.end()


def assert_trajectory_is_the_turns(episode, turns, traj) -> None:
    """The trajectory is the opening, then each turn's appended tokens (mask 0) and the
    tokens the model sampled (mask 1, with their logprobs), in order."""
    expected, mask = list(episode.prompt_token_ids), [0] * len(episode.prompt_token_ids)
    for k, turn in enumerate(turns):
        assert turn.turn == k + 1 and (turn.appended_token_ids == []) == (k == 0)
        expected += turn.appended_token_ids
        mask += [0] * len(turn.appended_token_ids)
        span = traj.turns[k]
        assert (span.start, span.end) == (len(expected), len(expected) + len(turn.sample.token_ids))
        expected += turn.sample.token_ids
        mask += [1] * len(turn.sample.token_ids)
        assert traj.logprobs[span.start : span.end] == turn.sample.logprobs, "the model's logprobs, as sampled"
        assert [(sp.start, sp.end) for sp in span.weight_versions] == [(span.start, span.end)]
    assert traj.token_ids == expected and traj.loss_mask == mask
    assert all(lp is None for lp, m in zip(traj.logprobs, mask) if m == 0)


async def test_the_trajectory_is_exactly_the_rendered_messages_and_the_sampled_tokens(any_client, reference, model_dir):
    episode, turns, traj = await five_turns(any_client)
    assert_trajectory_is_the_turns(episode, turns, traj)

    # A fresh engine, teacher-forced on the whole trajectory, gives the model's logprobs.
    forced = ray.get(reference.teacher_forced_logprobs.remote(traj.token_ids))
    for i, (m, sampled) in enumerate(zip(traj.loss_mask, traj.logprobs)):
        if m:
            assert math.isclose(sampled, forced[i], abs_tol=1e-3), (i, sampled, forced[i])

    # Re-rendering the same conversation as text (what agent loops do every turn) does not
    # give back the tokens the model sampled; the episode does.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    history = list(OPENING)
    for k, turn in enumerate(turns):
        history.append({"role": "assistant", "content": tokenizer.decode(turn.sample.token_ids, skip_special_tokens=True)})
        history += BETWEEN[k] if k < len(BETWEEN) else []
    rerendered = tokenizer.apply_chat_template(history, tokenize=True, return_dict=False)
    assert rerendered[: len(traj.token_ids)] != traj.token_ids


async def test_a_lost_episode_and_the_bounds_fail_with_a_clear_error(any_client):
    episode = await any_client.start_episode(OPENING, max_turns=1)
    with pytest.raises(InvalidRequestError, match="the first turn takes none") as e:
        await episode.turn([{"role": "user", "content": "too early"}], sampling=SamplingConfig(max_tokens=4))
    assert e.value.field == "messages"
    await episode.turn(sampling=SamplingConfig(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="has had its 1 turns"):
        await episode.turn([{"role": "user", "content": "again"}], sampling=SamplingConfig(max_tokens=4))
    await episode.end()
    with pytest.raises(EpisodeLostError, match="is not on this replica"):
        await episode.turn([{"role": "user", "content": "after the end"}], sampling=SamplingConfig(max_tokens=4))
    long = await any_client.start_episode(OPENING, max_tokens=60)
    with pytest.raises(InvalidRequestError, match="its max_tokens is 60") as e:
        await long.turn(sampling=SamplingConfig(max_tokens=64))
    assert e.value.field == "sampling.max_tokens"
