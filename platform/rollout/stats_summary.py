"""Small numeric summaries shared by the demo and the benchmarks."""

from __future__ import annotations

from typing import Sequence


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        raise ValueError("percentiles of an empty sequence")
    s = sorted(values)
    out = {}
    for q in qs:
        # Nearest-rank: an observed value, never an interpolation between two.
        k = max(0, min(len(s) - 1, -(-q * len(s) // 100) - 1))
        out[f"p{q}"] = s[k]
    return out
