"""The trainer's side: ``RolloutClient`` over a Serve handle or over HTTP."""

from rollout.client.client import RolloutClient
from rollout.client.rollout_stream import Eval, RolloutStream

__all__ = ["Eval", "RolloutClient", "RolloutStream"]
