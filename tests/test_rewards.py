"""Inline rewards, one module at a time: math_equal on a table of equivalent and
non-equivalent answers, the other built-ins, and the scorer's rules (names, params,
failures that become ``reward_error``, the deadline)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pydantic import ValidationError

from rollout.api import RewardSpec, RolloutRequest
from rollout.config import PlatformConfig
from rollout.errors import InvalidRequestError
from rollout.rewards import RewardScorer
from rollout.rewards.math_equal import extract_answer, math_equal

EQUAL = [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
    (r"The answer is 2\sqrt{2}.", r"\sqrt{8}"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{50\%}", "50"),
    (r"\boxed{(1, 2)}", "(1,2)"),
    ("x = 5", "5"),
    (r"\boxed{\sqrt[3]{27}}", "3"),
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{\text{yes}}", "yes"),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}"),
    (r"$\boxed{-\frac{1}{3}}$", "-1/3"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
    ("answer: 1.5", "3/2"),
    (r"\boxed{\infty}", r"\infty"),
    (r"so \boxed{\left(\frac{1}{2}\right)^2}", "0.25"),
    (r"\boxed{2 \cdot 3}", "6"),
    (r"\boxed{3 \times 10^2}", "300"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}"),
    (r"\boxed{\frac{\pi}{2}}", "1.5707963"),  # within the relative tolerance
    (r"first \boxed{7} then \boxed{8}", "8"),  # the last box
    (r"\boxed{\boxed{12}}", "12"),
    (r"\boxed{a+b}", "b+a"),
    (r"\boxed{\frac{x}{x}}", "1"),
    (r"\boxed{ 42 }", "42.0"),
]
NOT_EQUAL = [
    (r"\boxed{(2, 1)}", "(1,2)"),
    (r"\boxed{3}", "4"),
    (r"\boxed{0.333}", "1/3"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{3}"),
    (r"\boxed{x^2}", "x^3"),
    (r"\boxed{(1, 2, 3)}", "(1,2)"),
    (r"\boxed{\sqrt{2}}", "1.41"),
    (r"\boxed{-5}", "5"),
    (r"\boxed{\text{no}}", "yes"),
    ("no answer at all", "17"),
    (r"\boxed{12", "12"),  # unbalanced: the completion never closed its box
    (r"\boxed{\unknowncommand{3}}", "3"),
]


@pytest.mark.parametrize("completion,answer", EQUAL)
def test_math_equal_accepts_equivalent_answers(completion, answer):
    verdict = math_equal(completion, answer)
    assert verdict.equal, verdict


@pytest.mark.parametrize("completion,answer", NOT_EQUAL)
def test_math_equal_refuses_different_answers(completion, answer):
    verdict = math_equal(completion, answer)
    assert not verdict.equal, verdict


@pytest.mark.parametrize(
    "completion",
    [
        r"\boxed{__import__('os').system('touch /tmp/pwned-by-a-reward')}",
        r"\boxed{exec(1)}",
        r"\boxed{(1).__class__}",
        r"\boxed{9^{9^{9^{9}}}}",
        r"\boxed{10^{100000}}",
        "answer: " + "9" * 400,
    ],
)
def test_text_that_is_not_plain_arithmetic_never_reaches_sympys_eval(completion, tmp_path):
    t0 = time.monotonic()
    verdict = math_equal(completion, "1")
    assert not verdict.equal and verdict.method in ("unparsed", "text"), verdict
    assert time.monotonic() - t0 < 2, "refused before any evaluation"


def test_the_answer_is_read_from_the_last_box_or_after_the_last_answer_marker():
    assert extract_answer(r"we get \boxed{\frac{1}{2}} so") == r"\frac{1}{2}"
    assert extract_answer("Answer: 12.") == "12"
    assert extract_answer("  9 ") == "9"


def scorer(**functions) -> RewardScorer:
    return RewardScorer(functions, default=None, timeout_s=0.5, workers=2)


def score(s: RewardScorer, name: str, text: str, **params):
    return asyncio.run(s.score(s.resolve(RewardSpec(name=name, params=params)), text))


def test_builtins_score_and_say_what_they_read():
    s = scorer()
    assert score(s, "exact_match", " Paris\n", answer="Paris").reward == 1.0
    assert score(s, "exact_match", "paris", answer="Paris").reward == 0.0
    assert score(s, "exact_match", "paris", answer="Paris", ignore_case=True).reward == 1.0
    assert score(s, "regex_format", "<think>x</think> 4", pattern=r"<think>.*</think>").reward == 1.0
    assert score(s, "regex_format", "4 <think>", pattern=r"<think>.*</think>\s*\d+", full_match=True).reward == 0.0
    got = score(s, "math_equal", r"so \boxed{\frac{6}{8}}", answer="0.75")
    assert got.reward == 1.0 and got.details == {"extracted": r"\frac{6}{8}", "method": "symbolic"} and got.error is None


@pytest.mark.parametrize(
    "spec,field",
    [
        ({"name": "nope"}, "reward.name"),
        ({"name": "math_equal"}, "reward.params.answer"),
        ({"name": "math_equal", "params": {"answer": 3}}, "reward.params.answer"),
        ({"name": "exact_match", "params": {"answer": "a", "typo": 1}}, "reward.params.typo"),
        ({"name": "regex_format", "params": {"pattern": "("}}, "reward.params.pattern"),
        ({"name": "mine", "params": {"unknown_kwarg": 1}}, "reward.params"),
    ],
)
def test_a_spec_that_cannot_run_is_refused_naming_the_field(spec, field):
    with pytest.raises(InvalidRequestError) as e:
        scorer(mine="tests.test_rewards:length_reward").resolve(RewardSpec.model_validate(spec))
    assert e.value.field == field, e.value


def length_reward(text: str, scale: float = 1.0):
    return len(text) * scale, {"chars": len(text), "not_json": object()}


def raising_reward(text: str):
    raise ZeroDivisionError("bad luck")


def slow_reward(text: str):
    time.sleep(3)
    return 1.0


def wrong_type_reward(text: str):
    return "high"


def test_registered_functions_run_with_their_params_and_their_failures_become_reward_errors():
    s = scorer(
        length="tests.test_rewards:length_reward",
        raising="tests.test_rewards:raising_reward",
        slow="tests.test_rewards:slow_reward",
        wrong="tests.test_rewards:wrong_type_reward",
    )
    got = score(s, "length", "abcd", scale=0.5)
    assert got.reward == 2.0 and got.details["chars"] == 4 and isinstance(got.details["not_json"], str)
    failed = score(s, "raising", "x")
    assert failed.reward is None and failed.error == "ZeroDivisionError: bad luck"
    t0 = time.monotonic()
    late = score(s, "slow", "x")
    assert late.reward is None and "rewards.timeout_s=0.5" in late.error and time.monotonic() - t0 < 2
    assert score(s, "wrong", "x").error.startswith("the reward function returned 'high', not a finite number")


def test_rewards_run_off_the_event_loop():
    s = scorer(length="tests.test_rewards:length_reward")
    scorer_fn = s.resolve(RewardSpec(name="length"))
    seen = []

    def spy(text):
        seen.append(threading.current_thread().name)
        return scorer_fn(text)

    asyncio.run(s.score(spy, "x"))
    assert seen and seen[0].startswith("reward")


def test_config_imports_nothing_but_names_what_is_wrong():
    base = {"model": {"path": "m"}}
    for rewards, needle in [
        ({"functions": {"math_equal": "a:b"}}, "rewards.functions.math_equal: the name of a built-in"),
        ({"functions": {"mine": "no_colon"}}, "rewards.functions.mine: 'no_colon' is not 'module:function'"),
        ({"default": {"name": "mine"}}, "rewards.default.name: 'mine' is neither a built-in"),
    ]:
        with pytest.raises(ValidationError, match=needle):
            PlatformConfig.model_validate({**base, "rewards": rewards})
    with pytest.raises(ValueError, match="cannot import 'tests.nowhere:f'"):
        scorer(mine="tests.nowhere:f")


def test_a_request_names_its_reward_in_the_schema():
    req = RolloutRequest.model_validate({"prompt": "2+2=", "reward": {"name": "math_equal", "params": {"answer": "4"}}})
    assert req.reward == RewardSpec(name="math_equal", params={"answer": "4"})
    with pytest.raises(ValidationError):
        RolloutRequest.model_validate({"prompt": "2+2=", "reward": {"name": "math_equal", "answer": "4"}})
