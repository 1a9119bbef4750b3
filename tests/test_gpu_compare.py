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


REFUSED = {
    # At position 3 the reference puts 23 0.9 nats behind its 13: no honest flip.
    "a clear preference": ([10, 11, 12, 23], [-0.5, -1.0, -0.2, -1.6], 3, ("gap", 0.9), "token 3: the reference prefers its 13 over the platform's 23 by 0.9000 > tie_tol"),
    # Token 0 agrees but its logprob is 0.3 nats off: other weights, whatever token 1 does.
    "a deviation before a near-tie": ([10, 21, 99, 98], [-0.8, -1.05, -0.3, -0.4], 1, ("max_deviation", 0.3), "token 0 (10): logprob -0.8000 on the platform, -0.5000 on the reference"),
    "equal tokens, far logprobs": (WANT, [-0.5, -1.0, -0.2, -1.7], None, ("max_deviation", 1.0), "token 3 (13): logprob -1.7000"),
    "a token outside the top k": ([10, 11, 77, 5], [-0.5, -1.0, -0.2, -0.3], 2, ("gap", None), "the platform's 77 is not in the reference's top 3"),
    # At a near-tie the platform's logprob of its own token must agree with the reference's too.
    "a deviation at the near-tie": ([10, 21, 99, 98], [-0.5, -0.6, -0.3, -0.4], 1, ("deviation_at", 0.45), "token 1: the platform's 21 has logprob -0.6000 there, the reference -1.0500"),
    # One a prefix of the other: equal as far as both go, but not the same output.
    "different lengths": (WANT[:3], [-0.5, -1.0, -0.2], None, ("compared", 3), "lengths differ: 3 tokens on the platform, 4 on the reference"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_judgement_refuses(case):
    got, got_logprobs, position, (field, value), reason = REFUSED[case]
    v = judge(got, got_logprobs, WANT, WANT_TOP)
    assert not v.ok and not v.equal and v.position == position
    assert getattr(v, field) == (value if value is None else pytest.approx(value))
    assert reason in v.reason


def test_the_refusals_are_beyond_the_tolerances():
    assert REFUSED["a clear preference"][3][1] > TIE_TOL
    assert min(REFUSED[c][3][1] for c in ("a deviation before a near-tie", "equal tokens, far logprobs", "a deviation at the near-tie")) > LP_TOL


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


# ---- router replay (compare.judge_routing) -------------------------------------------------

import numpy as np  # noqa: E402

from tests.gpu.compare import ROUTE_AGREE_FLOOR, ROUTE_TIE, judge_routing, routing_failures  # noqa: E402

# Two tokens, one layer, six experts, top 2; scaled so each pair's logits have std 1, so an
# inversion reads in the same units as the logits.
_RAW = np.array([[[2.0, 1.0, 0.95, -1.0, -1.0, -1.95]], [[-0.5, 3.0, -0.5, -0.5, 1.0, -2.5]]])
LOGITS = _RAW / _RAW.std(axis=-1, keepdims=True)


def test_the_teachers_sets_agree_whatever_the_engines_order():
    v = judge_routing(np.array([[[1, 0]], [[4, 1]]]), LOGITS)
    assert (v.pairs, v.agree, v.agree_by_layer, v.near_ties, v.beyond, v.largest_inversion) == (2, 2, [2], [], [], 0.0)
    assert routing_failures([v]) == []


def test_a_swap_at_a_near_tie_is_reported_not_failed():
    # Token 0: the engine took expert 2 for the teacher's 1, 0.036 std below it.
    near = LOGITS[0, 0, 1] - LOGITS[0, 0, 2]
    assert near < ROUTE_TIE
    v = judge_routing(np.array([[[0, 2]], [[1, 4]]]), LOGITS)
    assert v.agree == 1 and v.beyond == [] and v.largest_inversion == pytest.approx(near)
    assert v.near_ties == [(0, 0, pytest.approx(near, abs=1e-4))]
    assert routing_failures([v], floor=0.5) == []


def test_the_inversion_is_between_the_swapped_experts_not_the_boundary():
    # The teacher's 2nd and 3rd nearly tie, but the engine dropped its 1st for its 3rd:
    # 0.75 std apart, beyond any rounding, whatever the gap at the boundary.
    far = LOGITS[0, 0, 0] - LOGITS[0, 0, 2]
    assert far > ROUTE_TIE
    v = judge_routing(np.array([[[1, 2]], [[1, 4]]]), LOGITS)
    assert v.near_ties == [] and v.beyond == [(0, 0, pytest.approx(far, abs=1e-4), [1, 2], [0, 1])]
    assert "1 of 2 (token, layer) pairs route differently from the teacher beyond a near-tie" in routing_failures([v], floor=0.0)[0]


def test_rows_a_token_off_fail():
    # Each token judged against the other's rows.
    v = judge_routing(np.array([[[1, 4]], [[0, 1]]]), LOGITS)
    assert v.agree == 0 and len(v.beyond) == 2 and v.largest_inversion > 1
    reasons = routing_failures([v])
    assert len(reasons) == 2 and "under the floor of 75%" in reasons[1]


def test_near_ties_everywhere_fall_under_the_floor():
    v = judge_routing(np.array([[[0, 2]], [[1, 4]]]), LOGITS)
    assert not v.beyond
    assert routing_failures([v, v], floor=0.6) == ["only 2 of 4 (token, layer) pairs (50.0%) pick the teacher's experts exactly, under the floor of 60%"]
    assert routing_failures([v, v]) == ["only 2 of 4 (token, layer) pairs (50.0%) pick the teacher's experts exactly, under the floor of 75%"]
    assert ROUTE_AGREE_FLOOR == 0.75


def test_the_tolerance_is_the_callers_to_choose():
    v = judge_routing(np.array([[[1, 2]], [[1, 4]]]), LOGITS, tie=1.0)
    assert v.beyond == [] and len(v.near_ties) == 1


@pytest.mark.parametrize(
    "rows, logits, message",
    [
        (np.zeros((2, 1, 2), dtype=int), LOGITS[:1], "the same tokens and layers"),
        (np.array([[[0, 6]], [[1, 4]]]), LOGITS, "expert ids in [0, 6)"),
        (np.array([[[0, 0]], [[1, 4]]]), LOGITS, "rows[0, 0]: 2 distinct experts expected"),
    ],
)
def test_inputs_that_are_not_a_routing_are_refused(rows, logits, message):
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        judge_routing(rows, logits)


def test_no_pairs_is_a_failure():
    assert routing_failures([]) == ["no (token, layer) pairs to judge"]
