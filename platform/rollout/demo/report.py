"""One PNG that shows a demo run without Grafana."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def write_report(path: Path, steps: Sequence[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    panels = [
        ("reward", "mean reward (target-token rate)"),
        ("tokens_per_s", "rollout tokens/s"),
        ("kv_cache_usage", "the step's peak KV-cache usage"),
        ("sync_ms", "publish to committed (ms)"),
        ("version", "committed policy version"),
        ("loss", "policy-gradient loss"),
    ]
    for ax, (key, title) in zip(axes.flat, panels):
        values = [s[key] for s in steps]
        ax.plot(x, [float("nan") if v is None else v for v in values], marker="o", markersize=3)
        if values and all(v is None for v in values):
            # Said on the panel rather than drawn as zeros.
            title += "\nnot reported: the replica predates kv_cache_usage_peak"
        elif key == "kv_cache_usage":
            # From 0, as a share of the cache: a step using 3.08% or 3.13% of it looks alike.
            ax.set_ylim(0, max(0.05, 1.25 * max(v for v in values if v is not None)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle("Rollout Platform demo: policy-gradient loop on CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
