"""The publisher's checks before a round opens (a recording stand-in for the coordinator;
the real round trip is in test_weight_sync_e2e.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rollout.contracts.backend import CopyOffer, CopySender
from rollout.sync import SyncError, WeightPublisher


class RecordingCoordinator:
    def __init__(self, backend: str):
        self.backend = backend
        self.opened = 0

    def status(self, timeout_s=None) -> dict:
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

    from rollout.sync.coordinator_client import BlockingCoordinatorHandle

    class Dying:
        def result(self, timeout_s=None):
            raise ActorDiedError()

    class Handle:
        finish = type("Method", (), {"remote": staticmethod(lambda *args: Dying())})

    with pytest.raises(SyncError, match="died during finish.*may have committed"):
        BlockingCoordinatorHandle(Handle()).finish("token", "round-1", None)


class BlockedSender(CopySender):
    """A sender whose peers never join: send() blocks, as gloo's rendezvous does until its timeout."""

    def __init__(self):
        import threading

        super().__init__()
        self.release = threading.Event()

    def offer(self, tensors):
        return None

    def copy_offer(self, ports=None, setting=None):
        return CopyOffer("copy-1", 1)

    def send(self, plan, tensors):
        self.release.wait(60)
        raise RuntimeError("timed out waiting for the other ranks")

    def send_copy(self, plan):
        raise AssertionError("no round commits here")

    def drop_kept(self):
        pass

    def close(self):
        self.release.set()


class AbortingCoordinator:
    """Opens the round, then aborts it the way the real one does when a replica reports that
    it cannot reach the rendezvous: the round shows as decided in status()."""

    host = "10.231.1.1"

    def __init__(self):
        self.request = None
        self.finished_with = None

    def status(self, timeout_s=None) -> dict:
        rounds = [{"round_id": "round-1-x", "committed": False}] if self.request else []
        return {"backend": "gloo", "recent_rounds": rounds}

    def begin_round(self, token, request):
        from rollout.contracts.sync_protocol import Member, PushRound, Transfer

        self.request = request
        r = request
        return PushRound(
            round_id="round-1-x", version=1, backend="gloo", transfer=Transfer(r.master_address, r.master_port, 2), members=(Member("a", 1, 1),),
            params=r.params, bucket_bytes=1 << 16, pause_mode="keep", timeout_s=30.0,
        )

    def finish(self, token, round_id, error, timeout_s=None):
        from rollout.contracts.sync_protocol import RoundOutcome

        self.finished_with = error
        where = f"{self.request.master_address}:{self.request.master_port}"
        return RoundOutcome(round_id, False, 0, f"a: cannot reach the transfer group's rendezvous at {where}", ["a"], unreachable=where)


def test_a_publish_the_replicas_cannot_reach_fails_in_seconds_naming_the_address_and_the_setting(monkeypatch):
    import time

    from rollout.contracts.sync_protocol import PublisherUnreachableError
    import rollout.sync.publisher as publisher_module

    monkeypatch.setenv("ROLLOUT_PUBLISHER_ADDRESS", "10.231.2.1")
    monkeypatch.setattr(publisher_module.net, "is_local", lambda address: address == "10.231.2.1")  # this host's other interface
    monkeypatch.setattr(publisher_module, "DECIDED_POLL_S", 0.1)
    sender = BlockedSender()
    monkeypatch.setattr(publisher_module, "make_sender", lambda backend: sender)
    coordinator = AbortingCoordinator()
    publisher = WeightPublisher(coordinator, "auto", token=None)
    t0 = time.monotonic()
    try:
        with pytest.raises(PublisherUnreachableError) as e:
            publisher.publish({"w": torch.zeros(2)})
    finally:
        sender.close()
    assert time.monotonic() - t0 < 5, "the round's deadline is 30 s: the publisher must not wait it out"
    port = coordinator.request.master_port
    assert (e.value.address, e.value.port) == ("10.231.2.1", port)
    message = str(e.value)
    assert f"10.231.2.1:{port}" in message and "set by ROLLOUT_PUBLISHER_ADDRESS" in message and "replicas keep version 0" in message
    assert "abandoned" in coordinator.finished_with, "the publisher tells the coordinator it gave up"
    assert publisher._sender is None, "the abandoned sender's group is never reused"


def test_without_the_setting_a_publisher_names_how_it_chose_the_address(monkeypatch):
    from rollout.contracts import net
    from rollout.contracts.sync_protocol import PublisherUnreachableError
    import rollout.sync.publisher as publisher_module

    monkeypatch.delenv("ROLLOUT_PUBLISHER_ADDRESS", raising=False)
    monkeypatch.delenv(net.NODE_ADDRESS_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))  # a trainer outside the cluster
    monkeypatch.setattr(net, "route_address", lambda toward: {"10.231.1.1": "10.231.1.2"}.get(toward))
    monkeypatch.setattr(net, "is_local", lambda address: address == "10.231.1.2")
    monkeypatch.setattr(publisher_module, "DECIDED_POLL_S", 0.1)
    sender = BlockedSender()
    monkeypatch.setattr(publisher_module, "make_sender", lambda backend: sender)
    coordinator = AbortingCoordinator()
    try:
        with pytest.raises(PublisherUnreachableError, match="the interface that routes to 10.231.1.1.*Set ROLLOUT_PUBLISHER_ADDRESS"):
            WeightPublisher(coordinator, "auto", token=None).publish({"w": torch.zeros(2)})
    finally:
        sender.close()
    assert coordinator.request.master_address == "10.231.1.2", "advertised toward the ingress's host"


def test_the_rounds_rendezvous_never_takes_the_port_promised_to_the_coordinators_copy(monkeypatch):
    # Both come from the publisher's range; the copy's binds only after the round. With a
    # range of two, the copy holding one leaves the round the other, every time (in CI
    # they once shared a port of a ten-port range).
    import rollout.sync.publisher as publisher_module
    from tests.test_sync_net import free_run

    base = free_run(2)
    monkeypatch.setenv("ROLLOUT_PUBLISHER_ADDRESS", "127.0.0.1")
    monkeypatch.setattr(publisher_module, "DECIDED_POLL_S", 0.1)
    for _ in range(5):
        sender = BlockedSender()
        sender.copy_offer = lambda ports=None, setting=None: CopyOffer("copy-1", base)
        monkeypatch.setattr(publisher_module, "make_sender", lambda backend: sender)
        coordinator = AbortingCoordinator()
        try:
            with pytest.raises(SyncError):
                WeightPublisher(coordinator, "auto", token=None, ports=f"{base}-{base + 1}").publish({"w": torch.zeros(2)})
        finally:
            sender.close()
        assert (coordinator.request.copy_port, coordinator.request.master_port) == (base, base + 1)


def test_an_address_that_is_not_this_hosts_is_refused_before_any_round_opens(monkeypatch):
    import rollout.sync.publisher as publisher_module

    # 198.51.100.7 (TEST-NET-2) is on no interface here; checking it only tries to bind.
    monkeypatch.setenv("ROLLOUT_PUBLISHER_ADDRESS", "198.51.100.7")
    monkeypatch.setattr(publisher_module, "make_sender", lambda backend: BlockedSender())
    coordinator = AbortingCoordinator()
    with pytest.raises(SyncError, match="'198.51.100.7' \\(set by ROLLOUT_PUBLISHER_ADDRESS\\), which is not an address of this host"):
        WeightPublisher(coordinator, "auto", token=None).publish({"w": torch.zeros(2)})
    assert coordinator.request is None, "no round opened"


def test_a_coordinator_out_of_reach_mid_round_is_a_typed_error_within_the_rounds_bound_not_the_clients(monkeypatch):
    """A trainer whose link is cut mid-publish: the ingress takes the connection (or the
    kernel holds it) and never answers. Before: httpx's ReadTimeout after the client's 600 s."""
    import socket
    import threading
    import time

    from rollout.contracts.sync_protocol import CoordinatorUnreachableError, Member, PushRound, Transfer
    import rollout.sync.publisher as publisher_module
    from rollout.sync.remote import HttpCoordinator

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    accepted = []
    threading.Thread(target=lambda: [accepted.append(silent.accept()) for _ in range(8)], daemon=True).start()

    class LinkCutAfterOpening(HttpCoordinator):
        def status(self, timeout_s=None):
            if timeout_s is None:
                return {"backend": "gloo"}  # asked before the round, while the link was up
            return super().status(timeout_s)

        def begin_round(self, token, request):
            return PushRound(
                round_id="round-1-x", version=1, backend="gloo", transfer=Transfer(request.master_address, request.master_port, 2), members=(Member("a", 1, 1),),
                params=request.params, bucket_bytes=1 << 16, pause_mode="keep", timeout_s=0.5,
            )

    class SentSender(BlockedSender):
        def send(self, plan, tensors):
            return None

    monkeypatch.setenv("ROLLOUT_PUBLISHER_ADDRESS", "127.0.0.1")
    monkeypatch.setattr(publisher_module, "FINISH_MARGIN_S", 1.0)
    monkeypatch.setattr(publisher_module, "make_sender", lambda backend: SentSender())
    coordinator = LinkCutAfterOpening(f"http://127.0.0.1:{silent.getsockname()[1]}", None, timeout_s=600)
    publisher = WeightPublisher(coordinator, "auto", token=None)
    t0 = time.monotonic()
    try:
        with pytest.raises(CoordinatorUnreachableError, match="round-1-x: the coordinator at .* did not answer POST .*finish within [0-9.]+s.*aborts at its deadline"):
            publisher.publish({"w": torch.zeros(2)})
    finally:
        silent.close()
    # The commit's bound: four steps of 0.5 s from opening, plus the margin; not 600 s.
    assert time.monotonic() - t0 < 6
    assert publisher._sender is None, "a round of unknown outcome leaves no group to reuse"


# ---- NcclSender keeps its communicator across rounds (vLLM's NCCL pieces substituted: no GPU here)


class FakeCommunicator:
    """Stands in for vLLM's PyNcclCommunicator: records its rendezvous and its destroy."""

    def __init__(self, info, fail=False):
        import threading

        self.info = info
        self.fail = fail
        self.destroyed = threading.Event()

    def destroy(self):
        self.destroyed.set()


@pytest.fixture
def nccl_without_cuda(monkeypatch):
    """vLLM's trainer_init and packed producer, and torch's device calls, replaced in the
    sender's module: what the sender forms, sends over and releases is recorded."""
    import contextlib

    import vllm.distributed.weight_transfer.nccl_common as nccl_common
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    import rollout.sync.backends.nccl as nccl

    record = types.SimpleNamespace(formed=[], sent=[], fail_next=False)

    def trainer_init(info):
        record.formed.append(FakeCommunicator(info, fail=record.fail_next))
        return record.formed[-1]

    def producer(iterator, group, **kwargs):
        record.sent.append(group)
        list(iterator)
        if group.fail:
            raise RuntimeError("NCCL error: remote process exited")

    monkeypatch.setattr(nccl_common, "trainer_init", trainer_init)
    monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_producer", producer)
    monkeypatch.setattr(nccl, "sending_device", lambda tensors, backend: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return record


def nccl_plan(round_id: str, group_name: str = "", port: int = 29500, world_size: int = 2):
    from rollout.contracts.sync_protocol import Member, ParamSpec, PushRound, Transfer

    return PushRound(
        round_id=round_id, version=1, backend="nccl", transfer=Transfer("127.0.0.1", port, world_size, group_name), members=(Member("a", 1, 1),),
        params=(ParamSpec("w", "float32", (2,)),), bucket_bytes=1 << 16, pause_mode="keep", timeout_s=30.0,
    )


def test_the_nccl_sender_keeps_its_communicator_while_rounds_name_it_and_replaces_it_otherwise(nccl_without_cuda):
    from rollout.sync.backends.nccl import NcclSender

    record, w = nccl_without_cuda, [torch.zeros(2)]
    sender = NcclSender()
    assert sender.group_name is None, "nothing to offer before the first round"
    sender.send(nccl_plan("round-1"), w)
    first = record.formed[0]
    assert sender.group_name == "round-1" and first.info == {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
    assert not first.destroyed.is_set(), "kept for the next round"

    # The coordinator names it (the kept transfer, the port the first round formed it on).
    sender.send(nccl_plan("round-2", group_name="round-1"), w)
    assert len(record.formed) == 1 and record.sent == [first, first] and sender.group_name == "round-1"
    assert set(sender.phases) == {"rendezvous", "broadcast", "drain"}

    # A round naming a new group (membership changed, or the last round aborted): formed
    # again, and the old one released once the send is done.
    sender.send(nccl_plan("round-3", port=29501, world_size=3), w)
    second = record.formed[1]
    assert record.sent[-1] is second and sender.group_name == "round-3" and second.info["world_size"] == 3
    assert first.destroyed.wait(5) and not second.destroyed.is_set()

    # A plan naming the kept group over another rendezvous never gets it.
    sender.send(nccl_plan("round-4", group_name="round-3", port=29502, world_size=3), w)
    assert len(record.formed) == 3 and sender.group_name == "round-3" and record.sent[-1] is record.formed[2]
    assert second.destroyed.wait(5)

    sender.close()
    assert record.formed[2].destroyed.is_set() and sender.group_name is None, "close() releases it"


def test_a_failed_nccl_send_drops_its_communicator_without_destroying_it(nccl_without_cuda):
    from rollout.sync.backends.nccl import NcclSender

    record, w = nccl_without_cuda, [torch.zeros(2)]
    sender = NcclSender()
    sender.send(nccl_plan("round-1"), w)
    kept = record.formed[0]
    kept.fail = True  # a replica died mid-broadcast
    with pytest.raises(RuntimeError, match="remote process exited"):
        sender.send(nccl_plan("round-2", group_name="round-1"), w)
    assert sender.group_name is None, "the next round forms a new one"
    assert not kept.destroyed.wait(0.2), "destroying it would wait on a peer that is gone"
    sender.send(nccl_plan("round-3"), w)
    assert len(record.formed) == 2 and sender.group_name == "round-3"

    # A new communicator that fails its first send: the clean one it replaced is released.
    record.fail_next = True
    with pytest.raises(RuntimeError):
        sender.send(nccl_plan("round-4", port=29501), w)
    assert record.formed[1].destroyed.wait(5) and not record.formed[2].destroyed.wait(0.2)
    assert sender.group_name is None
