"""Greedy output of the platform judged against a reference engine's, as vLLM's own model
tests judge two implementations (``check_logprobs_close`` in vLLM's ``tests/models/utils.py``):
two sequences may part only where each side's token is a near-tie on the reference, and
nothing after the first difference is compared (greedy decoding continues from different
prefixes there). Pure Python: importable and unit tested without a GPU, Ray or vLLM.

The platform's token API gives the logprob of each sampled token; the reference engine
gives its top-k logprobs at each position (its own token always among them, as vLLM
returns the sampled token besides the top k). What the judgement adds to vLLM's is the
logprobs of the shared prefix: the same weights (and the same adapter) run by two engines
give logprobs that agree to a few hundredths, where other weights move them by far more.

The tolerances are a judgement, not a measurement: see :data:`LP_TOL` and :data:`TIE_TOL`;
every GPU run records the deviations and gaps it saw, so they can be tightened from data.

Router replay is judged the same way (:func:`judge_routing`): the engine's top-k experts
against a float32 teacher's router logits, a difference accepted only where the teacher
ranks the experts it swapped within a rounding's reach of each other (:data:`ROUTE_TIE`,
measured on CPU by ``tests/gpu/moe_routing_drift.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

# How far one token's logprob may differ between the platform and the reference (nats).
# Judgement for fp16 logits of a random model (tests/gpu's 1.5B, initializer_range 0.2):
# its logits spread over tens of nats, where fp16's step is 0.016-0.03, and two engines
# whose kernels or batch shapes differ accumulate such rounding over 28 layers; vLLM's
# own HF-vs-vLLM logprob test in half precision allows 1e-2 absolute plus 1e-2 relative.
# A different adapter (or none) moves logits by whole nats: it changes the greedy tokens.
LP_TOL = 0.1
# How far the reference may prefer its own token over the platform's where they part
# (nats). Each side's logit of each of the two tokens may be off by up to LP_TOL, so two
# tokens whose order flips between honest engines are at most 2 * LP_TOL apart.
TIE_TOL = 2 * LP_TOL


@dataclass(frozen=True)
class Verdict:
    """The judgement of one sequence."""

    ok: bool
    equal: bool  # the same tokens, all of them
    compared: int  # tokens compared on logprobs: all when equal, else those before the first difference
    max_deviation: float  # the largest |platform - reference| logprob of the same token over those
    position: Optional[int] = None  # the first difference
    gap: Optional[float] = None  # there: the reference's logprob of its token minus of the platform's
    deviation_at: Optional[float] = None  # there: |platform - reference| logprob of the platform's token
    reason: str = ""  # why not ok


def judge(
    got: Sequence[int],
    got_logprobs: Sequence[float],
    want: Sequence[int],
    want_top: Sequence[Mapping[int, float]],
    lp_tol: float = LP_TOL,
    tie_tol: float = TIE_TOL,
) -> Verdict:
    """``got``/``got_logprobs``: the platform's tokens and the logprob of each; ``want``/
    ``want_top``: the reference's tokens and, at each position, its top-k logprobs
    (token id -> logprob, its own token among them).

    Ok when the tokens are equal, or at their first difference k: (a) every token before k
    has the same logprob on both sides within ``lp_tol``, (b) the platform's token at k is
    in the reference's top-k there, with a logprob within ``lp_tol`` of the platform's, and
    (c) the reference prefers its own token by at most ``tie_tol``. Raises ``ValueError``
    for inputs that are not of that form."""
    if got_logprobs is None or len(got_logprobs) != len(got):
        raise ValueError(f"got_logprobs: one logprob per token expected ({len(got)} tokens), got {None if got_logprobs is None else len(got_logprobs)}")
    if len(want_top) != len(want):
        raise ValueError(f"want_top: one top-k dict per token expected ({len(want)} tokens), got {len(want_top)}")
    for j, (t, top) in enumerate(zip(want, want_top)):
        if t not in top:
            raise ValueError(f"want_top[{j}]: the reference's own token {t} is missing (vLLM returns the sampled token besides the top k)")
    n = min(len(got), len(want))
    k = next((j for j in range(n) if got[j] != want[j]), None)
    compared = n if k is None else k
    deviations = [_deviation(got_logprobs[j], want_top[j][want[j]]) for j in range(compared)]
    max_dev = max(deviations, default=0.0)
    base = dict(compared=compared, max_deviation=max_dev, position=k)
    if max_dev > lp_tol:
        j = deviations.index(max_dev)
        return Verdict(
            ok=False, equal=False, **base,
            reason=f"token {j} ({got[j]}): logprob {got_logprobs[j]:.4f} on the platform, {want_top[j][want[j]]:.4f} on the reference: "
            f"{max_dev:.4f} apart > lp_tol {lp_tol} (other weights than the reference's?)",
        )
    if k is None:
        if len(got) != len(want):
            return Verdict(ok=False, equal=False, **base, reason=f"lengths differ: {len(got)} tokens on the platform, {len(want)} on the reference, equal over the first {n}")
        return Verdict(ok=True, equal=True, **base)
    top = want_top[k]
    if got[k] not in top:
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        return Verdict(
            ok=False, equal=False, **base,
            reason=f"token {k}: the platform's {got[k]} is not in the reference's top {len(top)} "
            f"{[(t, round(lp, 4)) for t, lp in ranked]} (the reference chose {want[k]})",
        )
    gap = top[want[k]] - top[got[k]]
    dev_at = _deviation(got_logprobs[k], top[got[k]])
    base.update(gap=gap, deviation_at=dev_at)
    if gap > tie_tol:
        return Verdict(
            ok=False, equal=False, **base,
            reason=f"token {k}: the reference prefers its {want[k]} over the platform's {got[k]} by {gap:.4f} > tie_tol {tie_tol}: not a near-tie",
        )
    if dev_at > lp_tol:
        return Verdict(
            ok=False, equal=False, **base,
            reason=f"token {k}: the platform's {got[k]} has logprob {got_logprobs[k]:.4f} there, the reference {top[got[k]]:.4f}: {dev_at:.4f} apart > lp_tol {lp_tol}",
        )
    return Verdict(ok=True, equal=False, **base)


def _deviation(a: float, b: float) -> float:
    """|a - b|, infinite where either is not a finite number (never within a tolerance)."""
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


# ---- router replay: the engine's top-k experts against a teacher's router logits ---------
#
# The engine computes in bf16 and returns, for every (token, layer), the ids of the top-k
# experts its router picked. The teacher runs the same weights in float32 and gives every
# expert's router logit. Where the two pick different sets, the teacher must have ranked the
# engine's choice almost as high as its own: the *inversion* of a pair is how far (in the
# teacher's logits) an expert the teacher picked and the engine dropped lies above one the
# engine picked and the teacher did not. An honest flip needs the engine's rounding to undo
# it, so the inversion is at most the sum of two logits' errors; it is measured in the
# standard deviation of that pair's logits (the router's input is RMS-normalised, so its
# logits' spread, and their rounding error, scale with the router's weights alone).
#
# Measured on CPU (tests/gpu/moe_routing_drift.py, the `moe` preset, the check's own prompts,
# 24 greedy tokens each, four sampled continuations and a two-turn chat episode: 4,848 pairs),
# transformers in bf16 (bf16 weights, activations, KV cache and router logits, as vLLM's
# unquantized gate returns them; each prompt prefilled and every other token decoded alone, as
# the engine serves them) against the float32 teacher on the same bf16 weights:
#   * the |bf16 - fp32| router logit error: median 0.02-0.047, p99 0.10-0.17, max 0.40 by layer
#     (logits' std ~6.4); 4,502 of 4,848 pairs (92.9%) chose the same set; the other 346 are
#     near-ties, inversions median 0.007, p99 0.036, largest 0.047 std (~0.3 logits), whether
#     at the boundary or downstream of an earlier flip. The whole sequence in one bf16
#     forward: 93.0%, largest 0.041, 339 of the 340 differing pairs swapping a single expert;
#   * rows one token late (a misalignment): 31.5% agree (this random model's neighbouring
#     tokens route alike), 57.2% of pairs beyond 0.1 std, median inversion 0.48 std, largest
#     5.2; one token early alike (31.4%, 57.2%);
#   * another router, a publish not taken (ids + 1) or layers off by one: 0% agree, every pair
#     beyond 0.1 std (the first percentile of inversions 2.0-2.3 std), 6-8 of 8 experts swapped.

# A disagreement is a near-tie when its inversion is at most this share of the pair's logit
# std: ~2.1x the largest honest inversion measured on CPU (0.047), a fifth of a misaligned
# row's median (0.48) and a twentieth of another router's first percentile (2.0-2.3). GPU
# kernels accumulate in float32 as the CPU's do; every run records its largest inversion, so
# the tolerance can be tightened from data.
ROUTE_TIE = 0.1
# At least this share of all (token, layer) pairs must pick exactly the teacher's set: 92.9%
# on CPU honest, 31% misaligned by one token, 0% for another router. A second line behind
# ROUTE_TIE: it fails a platform that is wrong by near-ties everywhere.
ROUTE_AGREE_FLOOR = 0.75


@dataclass(frozen=True)
class RoutingVerdict:
    """One sequence's routing against its teacher."""

    pairs: int
    agree: int  # pairs whose sets are equal
    agree_by_layer: list[int]
    near_ties: list[tuple[int, int, float]]  # (token, layer, inversion in logit std) within the tolerance
    beyond: list[tuple[int, int, float, list[int], list[int]]]  # (token, layer, inversion, engine's ids, teacher's ids) past it
    largest_inversion: float  # over every disagreement, in logit std (0.0 when all agree)


def judge_routing(rows: "np.ndarray", logits: "np.ndarray", tie: float = ROUTE_TIE) -> RoutingVerdict:
    """``rows``: the engine's expert ids, ``[tokens, layers, k]`` (token t: the routing of
    the sequence's t-th token); ``logits``: the teacher's router logits of the same tokens,
    ``[tokens, layers, experts]``. Raises ``ValueError`` for inputs that are not of that form
    (other shapes are a misalignment the caller checks first; an id out of range or repeated
    within a row is not a routing)."""
    import numpy as np

    rows = np.asarray(rows)
    logits = np.asarray(logits, dtype=np.float64)
    if rows.ndim != 3 or logits.ndim != 3 or rows.shape[:2] != logits.shape[:2]:
        raise ValueError(f"rows [tokens, layers, k] and logits [tokens, layers, experts] expected with the same tokens and layers, got {rows.shape} and {logits.shape}")
    n, layers, k = rows.shape
    experts = logits.shape[2]
    if k >= experts or (rows.size and (rows.min() < 0 or rows.max() >= experts)):
        raise ValueError(f"rows: expert ids in [0, {experts}) expected, k < {experts}; got k={k}, ids {rows.min() if rows.size else None}..{rows.max() if rows.size else None}")
    teacher = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    std = logits.std(axis=-1)
    agree, near, beyond, largest = 0, [], [], 0.0
    by_layer = [0] * layers
    for t in range(n):
        for l in range(layers):
            mine, theirs = set(rows[t, l].tolist()), set(teacher[t, l].tolist())
            if len(mine) != k:
                raise ValueError(f"rows[{t}, {l}]: {k} distinct experts expected, got {rows[t, l].tolist()}")
            if mine == theirs:
                agree += 1
                by_layer[l] += 1
                continue
            row = logits[t, l]
            inversion = float((max(row[e] for e in theirs - mine) - min(row[e] for e in mine - theirs)) / max(std[t, l], 1e-12))
            largest = max(largest, inversion)
            if inversion <= tie:
                near.append((t, l, round(inversion, 4)))
            else:
                beyond.append((t, l, round(inversion, 4), sorted(mine), sorted(theirs)))
    return RoutingVerdict(pairs=n * layers, agree=agree, agree_by_layer=by_layer, near_ties=near, beyond=beyond, largest_inversion=largest)


def routing_failures(verdicts: Sequence[RoutingVerdict], tie: float = ROUTE_TIE, floor: float = ROUTE_AGREE_FLOOR) -> list[str]:
    """Why a set of sequences' routing is not the teacher's (empty: it is): any pair beyond
    ``tie`` (the same tolerance the verdicts were judged with), or fewer than ``floor`` of all
    pairs in agreement."""
    pairs, agree = sum(v.pairs for v in verdicts), sum(v.agree for v in verdicts)
    beyond = [(i, *b) for i, v in enumerate(verdicts) for b in v.beyond]
    out = []
    if beyond:
        out.append(
            f"{len(beyond)} of {pairs} (token, layer) pairs route differently from the teacher beyond a near-tie (inversion > {tie} of the logits' std): "
            f"(sequence, token, layer, inversion, engine's, teacher's) {beyond[:5]}"
        )
    if pairs and agree / pairs < floor:
        out.append(f"only {agree} of {pairs} (token, layer) pairs ({agree / pairs:.1%}) pick the teacher's experts exactly, under the floor of {floor:.0%}")
    if not pairs:
        out.append("no (token, layer) pairs to judge")
    return out
