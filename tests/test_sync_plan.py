"""Round plans speak each backend's own init-info dialect; wire plans agree on both sides."""

from __future__ import annotations

import pytest
import torch

from rollout.contracts.backend_registry import get_backend, make_sender
from rollout.contracts.sync_protocol import ParamSpec, PushRound, Transfer
from rollout.sync.rules import assign_ranks
from rollout.sync.wire import bucket_bytes_of, pack, plan_buckets, unpack


def plan(backend: str) -> PushRound:
    members, world = assign_ranks({"b": 2, "a": 1})
    return PushRound(
        round_id="round-1-x", version=1, backend=backend, members=members, params=(ParamSpec("w", "float32", (2, 3)),),
        bucket_bytes=1 << 20, timeout_s=30.0, transfer=Transfer("10.0.0.1", 29500, world), pause_mode="keep",
    )


def init_info(p: PushRound, replica_id: str) -> dict:
    return get_backend(p.backend).engine_init_info(p, p.member(replica_id))


def test_each_kind_of_round_is_its_own_type_and_contradictory_plans_cannot_be_built():
    import pickle
    from dataclasses import replace

    from rollout.contracts.sync_protocol import CopyGroup, Member, PullRound, ReloadRound
    from rollout.sync.remote import PLAN

    push = plan("gloo")
    with pytest.raises(ValueError, match="either in the round \\(keeper_rank\\) or after it \\(copy\\)"):
        replace(push, keeper_rank=3, copy=CopyGroup("copy-1", 29501))
    with pytest.raises(ValueError, match="b.s ranks 2..3 are outside world size 3"):
        replace(push, transfer=Transfer("10.0.0.1", 29500, 3))  # b's ranks are 2..3
    with pytest.raises(ValueError, match="needs the checkpoint directory"):
        ReloadRound(round_id="reload-1-x", version=1, backend="gloo", members=(Member("a", 1, 1),), params=(), bucket_bytes=1, timeout_s=1.0, checkpoint="")
    pull = PullRound(round_id="restore-1-x", version=1, backend="gloo", members=(Member("a", 1, 1),), params=(), bucket_bytes=1, timeout_s=1.0, transfer=Transfer("10.0.0.2", 1, 2))
    assert (push.kind, pull.kind, pull.pause_mode, pull.group) == ("push", "pull", "keep", "restore-1-x")
    with_copy = replace(push, copy=CopyGroup("copy-1", 29501))
    # Over Ray (pickled) and over HTTP (begin_round's answer) a plan arrives as it was sent.
    assert pickle.loads(pickle.dumps(with_copy)) == with_copy
    assert PLAN.validate_python(PLAN.dump_python(with_copy, mode="json")) == with_copy


def test_ranks_are_contiguous_blocks_after_the_trainer_and_account_for_tensor_parallelism():
    members, world = assign_ranks({"b": 2, "a": 1, "c": 4})
    assert [(m.replica_id, m.rank_offset) for m in members] == [("a", 1), ("b", 2), ("c", 4)]
    assert world == 8


def test_nccl_plans_produce_vllms_own_worker_init_info():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    info = NCCLWeightTransferInitInfo(**init_info(plan("nccl"), "b"))
    assert (info.rank_offset, info.world_size, info.packed) == (2, 4, True)
    assert info.packed_buffer_size_bytes == 1 << 20


def test_gloo_plans_produce_our_worker_init_info():
    from rollout.sync.backends.gloo_worker import GlooInitInfo

    info = GlooInitInfo(**init_info(plan("gloo"), "a"))
    assert (info.rank_offset, info.world_size, info.group_name) == (1, 4, "round-1-x")


def test_unknown_backends_are_rejected_by_name():
    with pytest.raises(ValueError, match="backend: unknown 'carrier-pigeon' \\(available: 'gloo', 'nccl', 'ipc'\\)"):
        make_sender("carrier-pigeon")
    assert type(make_sender("nccl")).__name__ == "NcclSender"


def test_packed_buckets_round_trip_every_tensor():
    tensors = {f"t{i}": torch.randn(i + 1, 7).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(9)}
    specs = [ParamSpec.of(n, t) for n, t in tensors.items()]
    buckets = plan_buckets(specs, 64)
    assert [i for b in buckets for i in b] == list(range(len(specs)))
    for b in buckets:
        bs = [specs[i] for i in b]
        buf = pack(tensors[s.name] for s in bs)
        assert buf.numel() == bucket_bytes_of(bs)
        for name, t in unpack(buf, bs):
            assert torch.equal(t, tensors[name])


def test_pipelined_buckets_arrive_intact_at_every_receiver_and_a_kept_group_serves_the_next_round():
    import threading

    from rollout.contracts.net import free_port as _free_port
    from rollout.sync.backends.gloo_group import GroupSlot, Rendezvous
    from rollout.sync.backends.gloo_stream import receive_buckets, send_buckets

    specs_tensors = {f"t{i}": torch.randn(i + 3, 5) for i in range(7)}
    specs = [ParamSpec.of(n, t) for n, t in specs_tensors.items()]
    port, world = _free_port(), 3
    slots = [GroupSlot() for _ in range(world)]
    received: dict[int, dict[str, torch.Tensor]] = {}
    groups_of_round = []

    def receiver(rank: int) -> None:
        group = slots[rank].join(Rendezvous("g", "127.0.0.1", port, world, 30.0), rank)
        received[rank] = {n: t.clone() for named in receive_buckets(group, specs, 200) for n, t in named}

    for round_no in range(2):
        threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        sender = slots[0].join(Rendezvous("g", "127.0.0.1", port, world, 30.0), 0)
        scaled = [t * (round_no + 1) for t in specs_tensors.values()]
        send_buckets(sender, specs, scaled, 200)  # several buckets of at most 200 bytes
        for t in threads:
            t.join(30)
        for rank in (1, 2):
            assert all(torch.equal(received[rank][s.name], x) for s, x in zip(specs, scaled)), (round_no, rank)
        groups_of_round.append([s.group for s in slots])
    assert all(a is b for a, b in zip(*groups_of_round)), "the second round ran on the groups of the first"


def test_a_group_of_the_same_name_at_a_new_rendezvous_is_joined_anew():
    """A trainer written for ``vllm serve`` that starts a second transfer engine keeps its
    fixed group name but hosts a new store: members holding the old group must join the new
    one (they used to keep the old one by name, and the trainer's rendezvous timed out)."""
    import threading

    from rollout.contracts.net import free_port as _free_port
    from rollout.sync.backends.gloo_group import GlooGroup, GroupSlot, Rendezvous
    from rollout.sync.backends.gloo_stream import receive_buckets, send_buckets

    specs_tensors = {f"t{i}": torch.randn(i + 3, 5) for i in range(3)}
    specs = [ParamSpec.of(n, t) for n, t in specs_tensors.items()]
    member = GroupSlot()
    groups, received = [], {}
    for engine in range(2):  # each "trainer engine" at a port of its own, one group name
        where = Rendezvous("rollout-weights", "127.0.0.1", _free_port(), 2, 10.0)

        def receiver() -> None:
            group = member.join(where, 1)
            received.update({n: t.clone() for named in receive_buckets(group, specs, 200) for n, t in named})

        thread = threading.Thread(target=receiver)
        thread.start()
        send_buckets(GlooGroup(where, 0), specs, list(specs_tensors.values()), 200)  # a new engine: a new group
        thread.join(30)
        assert not thread.is_alive() and all(torch.equal(received[n], t) for n, t in specs_tensors.items()), engine
        groups.append(member.group)
    assert groups[0] is not groups[1], "the member joined the new rendezvous"



def test_ipc_plans_produce_vllms_ipc_init_info_and_our_engines_update_info():
    import base64
    import pickle
    from dataclasses import fields, replace

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo

    from rollout.sync.backends.ipc_handles import unpickle_handles
    from rollout.sync.backends.ipc_worker import DirectIpcUpdateInfo

    handles = [{"GPU-uuid": ("rebuild", "args")}]
    payload = base64.b64encode(pickle.dumps(handles)).decode()
    ipc = replace(plan("ipc"), transfer_info={"ipc_handles_pickled": payload, "export_id": "e1"})
    assert IPCWeightTransferInitInfo(**init_info(ipc, "a")).packed is False
    # The replicas' engine is ours (registered under its own name), its update info vLLM's
    # unpacked one's fields plus the export's id; the handles stay pickled until needed.
    assert get_backend("ipc").vllm_engine == "rollout-ipc-direct"
    info = DirectIpcUpdateInfo(**get_backend("ipc").update_info(ipc.params, ipc.transfer_info))
    assert (info.names, info.shapes, info.export_id) == (["w"], [[2, 3]], "e1")
    assert unpickle_handles(info.ipc_handles_pickled) == handles
    vllms = {f.name for f in fields(IPCWeightTransferUpdateInfo)}
    assert {f.name for f in fields(DirectIpcUpdateInfo)} - vllms == {"export_id"}
    # Without an export id (a publisher that names none) the round still carries the handles.
    bare = replace(plan("ipc"), transfer_info={"ipc_handles_pickled": payload})
    assert DirectIpcUpdateInfo(**get_backend("ipc").update_info(bare.params, bare.transfer_info)).export_id == ""
    # The update info crosses vLLM's engine-core channel as plain msgpack (no pickle fallback).
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    update = get_backend("ipc").update_info(ipc.params, ipc.transfer_info)
    assert MsgpackDecoder().decode(MsgpackEncoder().encode(update)) == update


def test_ipc_replicas_get_our_engine_and_no_insecure_serialization():
    """VLLM_ALLOW_INSECURE_SERIALIZATION is a factor of vLLM's compile-cache key (issue 41)."""
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in get_backend("ipc").engine_env


def test_ipc_publishers_need_a_cuda_device_and_say_so():
    sender = make_sender("ipc")
    assert sender.group_name is None
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; tests/gpu/test_gpu_senders.py covers the real handles")
    with pytest.raises(RuntimeError, match="backend: 'ipc' needs a CUDA device"):
        sender.offer([torch.zeros(2)])
