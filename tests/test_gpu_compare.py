"""The GPU checks' judgement of the platform's greedy output against a reference engine's
(tests.gpu.compare), on small hand-made sequences: no GPU, Ray or vLLM."""

from __future__ import annotations

import math

import pytest

from tests.gpu.compare import LP_TOL, TIE_TOL, judge

WANT = [10, 11, 12, 13]
# The reference's top logprobs at each position, its own token first.
WANT_TOP = [
    {10: -0.50, 20: -1.90, 30: -3.00},
    {11: -1.00, 21: -1.05, 31: -2.50},  # 11 and 21 nearly tie
    {12: -0.20, 22: -2.40, 32: -4.00},
    {13: -0.70, 23: -1.60, 33: -2.10},
]


def test_the_same_tokens_with_close_logprobs_are_equal():
    v = judge(WANT, [-0.51, -1.02, -0.19, -0.70], WANT, WANT_TOP)
    assert v.ok and v.equal and v.reason == ""
    assert v.compared == 4 and v.position is None and v.gap is None
    assert v.max_deviation == pytest.approx(0.02)


def test_a_difference_at_a_near_tie_after_an_agreeing_prefix_is_accepted():
    # The platform took 21 where the reference, 0.05 nats apart, took 11; after that the
    # sequences go their own ways and are not compared.
    got = [10, 21, 99, 98]
    v = judge(got, [-0.52, -1.01, -0.3, -0.4], WANT, WANT_TOP)
    assert v.ok and not v.equal, v.reason
    assert v.position == 1 and v.compared == 1
    assert v.gap == pytest.approx(0.05)
    assert v.max_deviation == pytest.approx(0.02)
    assert v.deviation_at == pytest.approx(0.04)


def test_a_difference_where_the_reference_clearly_prefers_its_token_is_refused():
    # At position 3 the reference puts 23 0.9 nats behind its 13: no honest flip.
    got = [10, 11, 12, 23]
    v = judge(got, [-0.5, -1.0, -0.2, -1.6], WANT, WANT_TOP)
    assert not v.ok and v.position == 3
    assert v.gap == pytest.approx(0.9) and v.gap > TIE_TOL
    assert "not a near-tie" in v.reason and "token 3" in v.reason


def test_a_logprob_deviation_before_the_difference_is_refused_even_at_a_near_tie():
    # Token 0 agrees but its logprob is 0.3 nats off: other weights, whatever token 1 does.
    got = [10, 21, 99, 98]
    v = judge(got, [-0.8, -1.05, -0.3, -0.4], WANT, WANT_TOP)
    assert not v.ok and v.position == 1
    assert v.max_deviation == pytest.approx(0.3) and v.max_deviation > LP_TOL
    assert "token 0" in v.reason and "lp_tol" in v.reason


def test_equal_tokens_with_far_logprobs_are_refused():
    v = judge(WANT, [-0.5, -1.0, -0.2, -1.7], WANT, WANT_TOP)
    assert not v.ok and not v.equal
    assert "token 3" in v.reason and v.max_deviation == pytest.approx(1.0)


def test_a_token_outside_the_references_top_k_is_refused():
    got = [10, 11, 77, 5]
    v = judge(got, [-0.5, -1.0, -0.2, -0.3], WANT, WANT_TOP)
    assert not v.ok and v.position == 2 and v.gap is None
    assert "77 is not in the reference's top 3" in v.reason


def test_the_platforms_logprob_of_its_own_token_at_the_difference_must_agree_too():
    got = [10, 21, 99, 98]
    v = judge(got, [-0.5, -0.6, -0.3, -0.4], WANT, WANT_TOP)
    assert not v.ok and v.position == 1 and v.deviation_at == pytest.approx(0.45)
    assert "token 1" in v.reason and "lp_tol" in v.reason


def test_sequences_of_different_lengths_are_refused_even_when_one_is_a_prefix_of_the_other():
    v = judge(WANT[:3], [-0.5, -1.0, -0.2], WANT, WANT_TOP)
    assert not v.ok and v.position is None and v.compared == 3
    assert "lengths differ: 3 tokens on the platform, 4 on the reference" in v.reason


def test_a_non_finite_logprob_never_agrees():
    v = judge(WANT, [-0.5, math.nan, -0.2, -0.7], WANT, WANT_TOP)
    assert not v.ok and v.max_deviation == math.inf


def test_tolerances_are_the_callers_to_choose():
    got = [10, 11, 12, 23]
    assert judge(got, [-0.5, -1.0, -0.2, -1.6], WANT, WANT_TOP, tie_tol=1.0).ok
    assert not judge(WANT, [-0.51, -1.02, -0.19, -0.70], WANT, WANT_TOP, lp_tol=0.01).ok


@pytest.mark.parametrize(
    "got_logprobs, want_top, field",
    [
        (None, WANT_TOP, "got_logprobs"),
        ([-0.5, -1.0], WANT_TOP, "got_logprobs"),
        ([-0.5, -1.0, -0.2, -0.7], WANT_TOP[:3], "want_top"),
        ([-0.5, -1.0, -0.2, -0.7], [WANT_TOP[0], {21: -1.0}, *WANT_TOP[2:]], r"want_top\[1\]"),
    ],
)
def test_malformed_inputs_name_the_field(got_logprobs, want_top, field):
    with pytest.raises(ValueError, match=field):
        judge(WANT, got_logprobs, WANT, want_top)
