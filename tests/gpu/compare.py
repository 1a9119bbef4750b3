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
