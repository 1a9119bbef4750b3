"""Versioned weight sync from trainer jobs into every engine replica."""

from rollout.sync.coordinator import SyncError
from rollout.sync.publisher import WeightPublisher

__all__ = ["WeightPublisher", "SyncError"]
