"""Trainer-side senders with a GPU trainer: the ``ipc`` handles another process on the
same GPU reads exactly as vLLM's ``IPCWeightTransferEngine`` rebuilds them, and ``gloo``
publishing straight from GPU tensors. Skipped without CUDA (CI is CPU-only);
``tests/gpu/check.sh run`` runs them on a GPU machine (they need torch only, no vLLM or Ray)."""

from __future__ import annotations

import io
import multiprocessing as mp

import pytest
import torch

from rollout.contracts.backend_registry import make_sender

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on one: torch only)")


def _read_like_vllm(payload: str, out) -> None:
    # vllm/distributed/weight_transfer/ipc_engine.py, unpacked receive_weights.
    import base64
    import io
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    tensors = []
    for handle in pickle.loads(base64.b64decode(payload)):
        args = list(handle[uuid])
        args[6] = device  # the receiver's own device index
        tensors.append(rebuild_cuda_tensor(*args).cpu())
    buffer = io.BytesIO()
    torch.save(tensors, buffer)  # plain bytes: torch would share a tensor put on a queue
    out.put(buffer.getvalue())


def test_a_process_on_the_same_gpu_reads_every_published_tensor_through_the_offered_handles():
    params = [
        torch.randn(256, 64, device="cuda"),
        torch.randn(100, device="cuda").to(torch.bfloat16),
        torch.randn(8, 16, device="cuda").t(),  # a non-contiguous view: shared as a copy
        torch.randn(5, 3),  # a host tensor: copied to the GPU
    ]
    sender = make_sender("ipc")
    info = sender.offer(params)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reader = ctx.Process(target=_read_like_vllm, args=(info.ipc_handles_pickled, out))
    reader.start()
    try:
        got = torch.load(io.BytesIO(out.get(timeout=180)))
    finally:
        reader.join(60)
    assert reader.exitcode == 0
    for want, have in zip(params, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want.cpu())
    sender.close()


def test_contiguous_gpu_parameters_are_shared_in_place_without_a_copy():
    weight = torch.randn(128, 128, device="cuda")
    sender = make_sender("ipc")
    sender.offer([weight])
    assert sender._shared[0].data_ptr() == weight.data_ptr()
    sender.close()


def test_ipc_tensors_that_did_not_move_are_offered_as_the_same_export_and_moved_ones_anew():
    weights = [torch.randn(64, 64, device="cuda"), torch.randn(32, device="cuda")]
    sender = make_sender("ipc")
    first = sender.offer(weights)
    assert not sender.export_reused and first.export_id
    with torch.no_grad():
        weights[0].mul_(2)  # an optimizer step: in place, the same memory
    again = sender.offer(list(weights))
    assert sender.export_reused and again == first  # the same handles, the same export id
    weights[1] = torch.randn(32, device="cuda")  # re-allocated: its handle would point elsewhere
    moved = sender.offer(weights)
    assert not sender.export_reused and moved.export_id != first.export_id
    assert set(sender.phases) == {"offer"}
    sender.close()


def test_a_gpu_trainer_publishes_over_gloo_from_its_gpu_tensors():
    import threading

    from rollout.contracts.sync_protocol import ParamSpec
    from rollout.sync.backends.gloo_group import GroupSlot, Rendezvous
    from rollout.sync.backends.gloo_stream import receive_buckets, send_buckets

    params = {f"layer{i}.weight": torch.randn(64, 32 + i, device="cuda") for i in range(6)}
    specs = [ParamSpec.of(n, t) for n, t in params.items()]
    port = 29577
    received = {}

    def replica() -> None:
        group = GroupSlot().join(Rendezvous("g", "127.0.0.1", port, 2, 60.0), 1)
        received.update((n, t.clone()) for named in receive_buckets(group, specs, 20_000) for n, t in named)

    thread = threading.Thread(target=replica)
    thread.start()
    trainer = GroupSlot().join(Rendezvous("g", "127.0.0.1", port, 2, 60.0), 0)
    send_buckets(trainer, specs, list(params.values()), 20_000)  # several buckets
    thread.join(60)
    assert all(torch.equal(received[n], t.cpu()) for n, t in params.items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_senders_work_on_the_gpu_holding_the_tensors_not_the_current_device():
    # The smoke test's defect: tensors on cuda:1, current device cuda:0 (a replica's GPU),
    # and the NCCL communicator was built on cuda:0 ("NCCL error: invalid usage").
    from rollout.sync.backends.cuda_device import sending_device

    torch.cuda.set_device(0)
    assert sending_device([torch.zeros(2, device="cuda:1"), torch.zeros(3)], "nccl") == torch.device("cuda", 1)
    assert sending_device([torch.zeros(2)], "nccl") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"backend: 'nccl' sends from one GPU, but the tensors are on \['cuda:0', 'cuda:1'\]"):
        sending_device([torch.zeros(2, device="cuda:0"), torch.zeros(2, device="cuda:1")], "nccl")
