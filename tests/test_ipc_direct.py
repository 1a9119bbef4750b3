"""The ``ipc`` backend's receiving engine (rollout.sync.backends.ipc_worker) and its exports
(rollout.sync.backends.ipc_handles), on CPU: the CUDA IPC mapping is replaced by a stand-in
that hands out the "trainer's" tensors themselves (what a mapping is: the same memory), so
everything else runs as on a GPU: the direct plan replayed from the mapped tensors, the
export kept across rounds (nothing mapped again while the publisher offers the same one),
a new export mapped whole, vLLM's path where the plan cannot replay, and the refusals.
tests/gpu (``-k ipc``) runs the real handles."""

from __future__ import annotations

import base64
import copy
import pickle
from types import SimpleNamespace

import pytest
import torch

from rollout.sync.backends.ipc_handles import ExportSignature, HeldExport, pickle_handles, unpickle_handles
from tests.test_direct_plan import Toy, same, snapshot, weights_for

GPU = "GPU-test-uuid"


class Trainer:
    """The publisher's tensors and the handles it offers for them: each handle's args name
    the tensor (index 0) where rebuild_cuda_tensor's would name memory; index 6 is the
    device, which the receiver overwrites with its own."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights
        self.rebuilt: list[str] = []

    def handles(self, gpu: str = GPU) -> list[dict]:
        return [{gpu: (name, None, None, None, None, None, 99)} for name in self.weights]

    def rebuild(self, args: list) -> torch.Tensor:
        assert args[6] == 0, "the receiver's own device index replaces the publisher's"
        self.rebuilt.append(args[0])
        return self.weights[args[0]]

    def info(self, export_id: str = "e1", gpu: str = GPU) -> dict:
        return dict(
            names=list(self.weights),
            dtype_names=[str(t.dtype).removeprefix("torch.") for t in self.weights.values()],
            shapes=[list(t.shape) for t in self.weights.values()],
            ipc_handles_pickled=pickle_handles(self.handles(gpu)),
            export_id=export_id,
        )


@pytest.fixture
def vllm_steps(monkeypatch):
    """vLLM's own IPC engine steps (layerwise reload) recorded instead of run; no device
    synchronize; pickled handles allowed, as in ipc replicas."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    calls: list[str] = []
    for step in ("start_weight_update", "finish_weight_update"):
        monkeypatch.setattr(IPCWeightTransferEngine, step, lambda self, step=step: calls.append(step))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)  # our engine needs it not (issue 41)
    return calls


def make_engine(model, trainer: Trainer, device: str = "cuda", **overrides):
    from rollout.sync.backends.ipc_worker import DirectIpcWeightTransferEngine

    cfg = dict(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1), model_config=SimpleNamespace(quantization=None), quant_config=None, lora_config=None)
    cfg.update(overrides)
    engine = DirectIpcWeightTransferEngine(SimpleNamespace(backend="rollout-ipc-direct"), SimpleNamespace(**cfg), torch.device(device), model)
    engine._held = HeldExport(rebuild=trainer.rebuild)
    engine._gpu = lambda: (GPU, 0)
    return engine


def publish(engine, info: dict) -> None:
    engine.start_weight_update()
    engine.update_weights(info)
    engine.finish_weight_update()


def test_a_round_replays_the_plan_from_the_trainers_mapped_tensors_without_vllms_reload(vllm_steps):
    model, twin = Toy(), Toy()
    trainer = Trainer(weights_for(model.checkpoint_specs(), 1))
    twin.load_weights(trainer.weights.items())
    engine = make_engine(model, trainer)
    publish(engine, trainer.info())
    assert engine.last_path == "direct" and vllm_steps == []
    assert same(snapshot(model), snapshot(twin))
    assert trainer.rebuilt == list(trainer.weights)  # every handle mapped once
    assert engine.held_export() == "e1" and set(engine.phases) == {"map", "copy"}


def test_the_same_export_offered_again_maps_nothing_and_lands_the_trainers_new_values(vllm_steps):
    model, twin = Toy(), Toy()
    trainer = Trainer(weights_for(model.checkpoint_specs(), 1))
    engine = make_engine(model, trainer)
    publish(engine, trainer.info("e1"))
    trainer.rebuilt.clear()
    # The trainer's optimizer step writes its tensors in place: the mapped memory.
    for t in trainer.weights.values():
        t.mul_(-2).add_(1)
    info = trainer.info("e1")
    info["ipc_handles_pickled"] = base64.b64encode(b"not unpickled when the export is held").decode()
    publish(engine, info)
    assert trainer.rebuilt == []
    twin.load_weights(trainer.weights.items())
    assert same(snapshot(model), snapshot(twin)) and engine.last_path == "direct"


def test_a_new_export_is_mapped_whole_and_replaces_the_held_one(vllm_steps):
    model, twin = Toy(), Toy()
    trainer = Trainer(weights_for(model.checkpoint_specs(), 1))
    engine = make_engine(model, trainer)
    publish(engine, trainer.info("e1"))
    trainer.weights = weights_for(model.checkpoint_specs(), 2)  # new storage: the publisher exports anew
    trainer.rebuilt.clear()
    publish(engine, trainer.info("e2"))
    assert trainer.rebuilt == list(trainer.weights) and engine.held_export() == "e2"
    twin.load_weights(trainer.weights.items())
    assert same(snapshot(model), snapshot(twin))
    trainer.rebuilt.clear()
    publish(engine, trainer.info(""))  # a publisher that names no export: mapped every round
    publish(engine, trainer.info(""))
    assert trainer.rebuilt == 2 * list(trainer.weights) and engine.held_export() is None


def test_a_round_the_plan_cannot_replay_goes_vllms_way_from_the_mapped_tensors(vllm_steps):
    model = Toy()
    specs = [s for s in model.checkpoint_specs() if s[0] != "layers.1.up_proj.weight"]  # leaves gate_up half unwritten
    trainer = Trainer(weights_for(specs, 4))
    twin = copy.deepcopy(model)
    twin.load_weights(trainer.weights.items())
    engine = make_engine(model, trainer)
    publish(engine, trainer.info())
    assert engine.last_path == "vllm"
    # vLLM's reload (recorded) around the model's own load_weights, from the mapped tensors.
    assert vllm_steps == ["start_weight_update", "finish_weight_update"]
    assert same(snapshot(model), snapshot(twin))
    vllm_steps.clear()
    publish(make_engine(model, trainer, device="cpu"), trainer.info())  # not CUDA: vLLM's from the start
    assert vllm_steps == ["start_weight_update", "finish_weight_update"]


def test_refusals_name_what_is_wrong(vllm_steps, monkeypatch):
    model = Toy()
    trainer = Trainer(weights_for(model.checkpoint_specs(), 1))
    engine = make_engine(model, trainer)
    with pytest.raises(ValueError, match="IPC handle not found for GPU UUID GPU-test-uuid"):
        publish(engine, trainer.info(gpu="GPU-other"))
    engine = make_engine(model, trainer)
    engine.packed = True
    with pytest.raises(ValueError, match="unpacked transfers only"):
        engine.start_weight_update()
    with pytest.raises(ValueError, match="ipc_handles_pickled"):
        make_engine(model, trainer).parse_update_info({**trainer.info(), "ipc_handles_pickled": "", "export_id": ""})
    # An export named by id alone (the coordinator believed this engine holds it) that the
    # engine does not hold: the round fails before anything is copied.
    engine = make_engine(model, trainer)
    publish(engine, trainer.info("e1"))
    before = snapshot(model)
    engine.start_weight_update()
    with pytest.raises(ValueError, match="names export e2 without its handles, but this engine holds e1"):
        engine.update_weights({**trainer.info("e2"), "ipc_handles_pickled": ""})
    assert same(snapshot(model), before)


def test_an_export_the_engine_holds_named_by_id_alone_maps_nothing(vllm_steps):
    model, twin = Toy(), Toy()
    trainer = Trainer(weights_for(model.checkpoint_specs(), 1))
    engine = make_engine(model, trainer)
    publish(engine, trainer.info("e1"))
    trainer.rebuilt.clear()
    for t in trainer.weights.values():
        t.add_(1.0)  # the optimizer step, in place
    twin.load_weights(trainer.weights.items())
    publish(engine, {**trainer.info("e1"), "ipc_handles_pickled": ""})
    assert trainer.rebuilt == [] and engine.last_path == "direct"
    assert same(snapshot(model), snapshot(twin))


def test_the_ipc_backend_names_our_engine_and_the_plugin_registers_it_beside_vllms():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout.contracts.backend_registry import get_backend
    from rollout.sync.backends.ipc_worker import DirectIpcWeightTransferEngine
    from rollout.sync.vllm_plugin import register

    assert get_backend("ipc").vllm_engine == "rollout-ipc-direct"
    register()
    assert WeightTransferEngineFactory._registry["rollout-ipc-direct"]() is DirectIpcWeightTransferEngine
    assert WeightTransferEngineFactory._registry["ipc"]().__name__ == "IPCWeightTransferEngine"


def test_an_export_signature_is_equal_exactly_while_the_tensors_are_the_same_memory():
    base = torch.zeros(4, 6)
    tensors = [base, base[1], torch.ones(3)]
    sig = ExportSignature.of(tensors)
    assert ExportSignature.of([base, base[1], tensors[2]]) == sig  # the same tensors, offered again
    assert ExportSignature.of([base, base[2], tensors[2]]) != sig  # another view of the storage
    assert ExportSignature.of([base, base[1], torch.ones(3)]) != sig  # new storage (the old one is held)
    assert ExportSignature.of([base, base[1], tensors[2].view(1, 3)]) != sig  # another shape
    assert ExportSignature.of([base, base[1], tensors[2].to(torch.float64)]) != sig  # another dtype


def test_handles_round_trip_and_anything_else_is_refused():
    handles = [{GPU: ("args", 1)}, {GPU: ("args", 2)}]
    assert unpickle_handles(pickle_handles(handles)) == handles
    with pytest.raises(ValueError, match="list of"):
        unpickle_handles(base64.b64encode(pickle.dumps({"not": "a list"})).decode())
