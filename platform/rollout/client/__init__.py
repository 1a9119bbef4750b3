"""The trainer's side: ``RolloutClient`` over a Serve handle or over HTTP."""

from rollout.client.client import RolloutClient

__all__ = ["RolloutClient"]
