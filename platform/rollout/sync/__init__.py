"""Versioned weight sync from trainer jobs into every engine replica.

``WeightPublisher`` (torch) loads on first use, so the torch-free parts of this package
(the protocol, the backend registry) can be imported without it.
"""

from __future__ import annotations

from typing import Any

from rollout.contracts.sync_protocol import CoordinatorUnreachableError, FleetAsleepError, PublisherUnreachableError, SleepUnavailableError, SyncError

__all__ = ["WeightPublisher", "SyncError", "PublisherUnreachableError", "CoordinatorUnreachableError", "FleetAsleepError", "SleepUnavailableError"]


def __getattr__(name: str) -> Any:
    if name == "WeightPublisher":
        from rollout.sync.publisher import WeightPublisher

        return WeightPublisher
    raise AttributeError(f"module 'rollout.sync' has no attribute {name!r}")
