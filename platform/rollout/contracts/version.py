"""Policy versions as vLLM labels them: the ``weight_version`` string on every output."""

from __future__ import annotations

INITIAL_VERSION_LABEL = "default"  # what vLLM reports before any update


def version_of(label: str) -> int:
    if label == INITIAL_VERSION_LABEL:
        return 0
    try:
        return int(label)
    except ValueError:
        raise ValueError(f"engine reports weight version {label!r}, which this platform did not set") from None
