"""The trainer's side: ``RolloutClient`` over a Serve handle or over HTTP."""

from rollout.client.client import RolloutClient
from rollout.client.episode import Episode
from rollout.client.rollout_stream import Eval, RolloutStream

__all__ = ["Episode", "Eval", "RolloutClient", "RolloutStream"]
