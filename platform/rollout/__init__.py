"""Rollout Platform: vLLM rollouts for RL trainers, served by Ray Serve."""

from rollout.api import RewardSpec, RolloutChunk, RolloutRequest, RolloutResult, RoutedExperts, Sample, SamplingConfig, StructuredOutputs, WeightVersionSpan
from rollout.errors import AuthenticationError, EngineUnavailableError, InvalidRequestError, RolloutError

__version__ = "0.1.0"

__all__ = [
    "RewardSpec",
    "RolloutChunk",
    "RolloutRequest",
    "RolloutResult",
    "RoutedExperts",
    "Sample",
    "SamplingConfig",
    "StructuredOutputs",
    "WeightVersionSpan",
    "RolloutError",
    "InvalidRequestError",
    "AuthenticationError",
    "EngineUnavailableError",
]
