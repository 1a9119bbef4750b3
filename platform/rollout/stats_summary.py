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


def paired_ratios(paths: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Round-by-round ratios of two interleaved measurements: each round of a path is
    divided by the baseline round run next to it, so drift of the machine over the run
    (which moves both) cancels instead of landing in one path's median."""
    if len(paths) != len(baseline) or not paths:
        raise ValueError(f"paired ratios need rounds of equal, non-zero count, got {len(paths)} and {len(baseline)}")
    return [p / b for p, b in zip(paths, baseline)]


def median_interval(values: Sequence[float], confidence: float = 0.9, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the median: how far a rerun's median may plausibly land.
    Seeded, so the same rounds always give the same interval."""
    import random
    import statistics

    if not values:
        raise ValueError("an interval of an empty sequence")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1.0 - tail) * (resamples - 1))]
