"""The publisher's checks before a round opens (a recording stand-in for the coordinator;
the real round trip is in test_weight_sync_e2e.py)."""

from __future__ import annotations

import pytest
import torch

from rollout.sync import SyncError, WeightPublisher


class RecordingCoordinator:
    def __init__(self, backend: str):
        self.backend = backend
        self.opened = 0

    def status(self) -> dict:
        return {"backend": self.backend}

    def begin_round(self, *args):
        self.opened += 1
        raise AssertionError("no round may open")


def test_a_publisher_that_asks_for_another_backend_than_the_platforms_fails_before_any_round_opens():
    coordinator = RecordingCoordinator("gloo")
    publisher = WeightPublisher(coordinator, "nccl", token=None)
    with pytest.raises(SyncError, match="syncs over 'gloo', not 'nccl'"):
        publisher.publish({"w": torch.zeros(2)})
    assert coordinator.opened == 0


def test_a_coordinator_that_dies_mid_call_is_a_typed_sync_error_not_a_ray_error():
    # Before: publish() raised Ray's ActorDiedError, which a trainer catching SyncError missed.
    from ray.exceptions import ActorDiedError

    from rollout.sync.remote import HandleCoordinator

    class Dying:
        def result(self, timeout_s=None):
            raise ActorDiedError()

    class Handle:
        finish = type("Method", (), {"remote": staticmethod(lambda *args: Dying())})

    with pytest.raises(SyncError, match="died during finish.*may have committed"):
        HandleCoordinator(Handle()).finish("token", "round-1", None)
