"""The direct receive's copy plan (rollout.sync.backends.direct_plan): baked from a
model's load_weights on meta tensors, replayed on buckets packed exactly as vLLM's NCCL
producer packs them, it leaves the parameters as load_weights does; what it cannot replay
is refused with the reason, and baking never writes a live tensor.

The toy model's loaders do what vLLM's do for Qwen2 (checked against vLLM's own Qwen2 at
the end): q/k/v and gate/up fused into stacked parameters by narrowing the destination,
vocabulary padding rows filled with zeros, a tied lm_head skipped by name."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rollout.sync.backends.direct_plan import Ineligible, bake, plan_key

H, Q, KV, I, VOCAB, VOCAB_PADDED = 8, 8, 4, 12, 10, 16


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(H, Q + 2 * KV)
        self.o_proj = nn.Linear(Q, H, bias=False)
        self.gate_up_proj = nn.Linear(H, 2 * I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.norm = nn.Parameter(torch.ones(H))


class Toy(nn.Module):
    """A vLLM-shaped model: checkpoint names q/k/v_proj and gate/up_proj land in slices of
    the fused parameters; embeddings are padded; lm_head is tied to the embeddings."""

    stacked = [("qkv_proj", "q_proj", 0, Q), ("qkv_proj", "k_proj", Q, KV), ("qkv_proj", "v_proj", Q + KV, KV), ("gate_up_proj", "gate_proj", 0, I), ("gate_up_proj", "up_proj", I, I)]

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(VOCAB_PADDED, H))
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.lm_head = nn.Linear(H, VOCAB_PADDED, bias=False)
        self.lm_head.weight = self.embed  # tied
        for p in self.parameters():
            p.requires_grad_(False)

    def checkpoint_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        specs = [("embed", torch.float32, (VOCAB, H))]
        for i in range(len(self.layers)):
            p = f"layers.{i}"
            specs += [(f"{p}.q_proj.weight", torch.float32, (Q, H)), (f"{p}.k_proj.weight", torch.float32, (KV, H)), (f"{p}.v_proj.weight", torch.float32, (KV, H))]
            specs += [(f"{p}.q_proj.bias", torch.float32, (Q,)), (f"{p}.k_proj.bias", torch.float32, (KV,)), (f"{p}.v_proj.bias", torch.float32, (KV,))]
            specs += [(f"{p}.o_proj.weight", torch.float32, (H, Q)), (f"{p}.gate_proj.weight", torch.float32, (I, H)), (f"{p}.up_proj.weight", torch.float32, (I, H))]
            specs += [(f"{p}.down_proj.weight", torch.float32, (H, I)), (f"{p}.norm", torch.float32, (H,))]
        return specs + [("lm_head.weight", torch.float32, (VOCAB, H))]

    @torch.no_grad()
    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "lm_head.weight":
                continue  # tied: AutoWeightsLoader skips the alias
            if name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0] :].fill_(0)
                continue
            for fused, part, offset, rows in self.stacked:
                if f".{part}." in name:
                    param = params[name.replace(part, fused)]
                    param.data.narrow(0, offset, rows).copy_(w)
                    break
            else:
                if name not in params:
                    raise ValueError(f"There is no module or parameter named {name!r}")
                param = params[name]
                assert param.shape == w.shape
                param.data.copy_(w)


def weights_for(specs, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(d) for n, d, s in specs}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def packed_buckets(weights: dict[str, torch.Tensor], bucket_bytes: int):
    """The buckets a replica unpacks: vLLM's producer packing (pack_tensors), unpacked as
    its consumer does (unpack_tensor), each a list of views of one uint8 buffer."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    it = iter(weights.items())
    while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
        yield unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes)


def test_the_plan_replayed_on_packed_buckets_leaves_the_parameters_as_load_weights_does():
    model, twin = Toy(), Toy()
    specs = model.checkpoint_specs()
    before = snapshot(model)
    plan = bake(model, specs)
    assert same(snapshot(model), before), "baking wrote a live parameter"
    assert plan.dropped == ("lm_head.weight",)
    assert len(plan.fills) == 1  # the embeddings' padding rows
    # Fused destinations are narrowed slices of one parameter; sources are whole tensors.
    assert [c.holder for c in plan.copies["layers.1.k_proj.weight"]] == ["layers.1.qkv_proj.weight"]
    assert all(c.src is None for cs in plan.copies.values() for c in cs)

    for seed in (1, 2):  # two rounds on one plan
        weights = weights_for(specs, seed)
        twin.load_weights(weights.items())
        buckets = list(packed_buckets(weights, bucket_bytes=600))
        assert len(buckets) > 3
        assert plan.stale(model) is None
        plan.apply_fills()
        for named in buckets:
            plan.apply(named)
        assert same(snapshot(model), snapshot(twin))
        assert not torch.equal(model.embed, before["embed"])


def test_the_plan_key_names_dtypes_and_shapes():
    specs = Toy().checkpoint_specs()
    assert plan_key(specs)[0] == ("embed", "float32", (VOCAB, H))
    assert plan_key(specs) != plan_key([(n, torch.bfloat16, s) for n, _, s in specs])


def test_a_narrowed_source_is_replayed_as_the_same_slice():
    class Narrowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3, 4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:  # a loader taking its shard (rows 2..4) of the input
                self.w.data.copy_(t.narrow(0, 2, 3))

    model = Narrowing()
    plan = bake(model, [("w", torch.float32, (6, 4))])
    (c,) = plan.copies["w"]
    assert c.src is not None and c.src.shape == (3, 4) and c.src.offset == 8
    w = torch.arange(24.0).view(6, 4)
    for named in packed_buckets({"w": w}, 1 << 20):
        plan.apply(named)
    assert torch.equal(model.w, w[2:5])


@pytest.mark.parametrize(
    "loader, reason",
    [
        (lambda m, w: m.w.data.copy_(w * 2), "computed from the received one"),
        (lambda m, w: m.w.data.mul_(0).add_(w), "writes a live parameter"),
        (lambda m, w: m.w.data.copy_(w[0]), "broadcasts"),
        (lambda m, w: m.w.data.t().copy_(w.t()), "non-dense destination"),
        (lambda m, w: (_ for _ in ()).throw(KeyError("no such weight")), "load_weights raised KeyError"),
    ],
    ids=["transformed", "mutated", "broadcast", "strided", "raises"],
)
def test_what_cannot_be_replayed_is_refused_with_its_reason_and_nothing_live_is_written(loader, reason):
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                loader(self, t)

    model = One()
    before = snapshot(model)
    with pytest.raises(Ineligible, match=reason):
        bake(model, [("w", torch.float32, (4, 4))])
    assert same(snapshot(model), before)


def test_a_parameter_the_round_leaves_unwritten_makes_the_plan_ineligible():
    model = Toy()
    specs = [s for s in model.checkpoint_specs() if s[0] != "layers.0.v_proj.weight"]
    with pytest.raises(Ineligible, match=r"layers.0.qkv_proj.weight: 96 of 128 elements"):
        bake(model, specs)
    with pytest.raises(Ineligible, match="received twice"):
        bake(model, model.checkpoint_specs() + [("embed", torch.float32, (VOCAB, H))])


def test_a_name_load_weights_does_not_know_is_refused():
    model = Toy()
    with pytest.raises(Ineligible, match="There is no module or parameter named 'bogus'"):
        bake(model, model.checkpoint_specs() + [("bogus", torch.float32, (2,))])


def test_partly_overlapping_destinations_are_refused_and_exact_rewrites_keep_the_last():
    class Overlap(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.rows = rows
            self.w = nn.Parameter(torch.zeros(4, 2), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                start = 0 if name == "a" else 4 - self.rows
                self.w.data.narrow(0, start, self.rows).copy_(t)

    with pytest.raises(Ineligible, match="a and b write overlapping elements"):
        bake(Overlap(3), [("a", torch.float32, (3, 2)), ("b", torch.float32, (3, 2))])
    plan = bake(Overlap(4), [("a", torch.float32, (4, 2)), ("b", torch.float32, (4, 2))])
    assert "a" not in plan.copies and "b" in plan.copies  # b is loaded after a: b wins


def test_a_parameter_moved_since_the_bake_makes_the_plan_stale_and_the_engine_bakes_again():
    from rollout.sync.backends.nccl_worker import DirectNcclWeightTransferEngine

    model = Toy()
    engine = make_engine(model, "cpu")
    specs = model.checkpoint_specs()
    info = SimpleNamespace(names=[n for n, _, _ in specs], dtype_names=["float32"] * len(specs), shapes=[list(s) for _, _, s in specs])
    first = engine._plan_for(info.names, info.dtype_names, info.shapes)
    assert engine._plan_for(info.names, info.dtype_names, info.shapes) is first  # kept while nothing moved
    model.layers[0].norm.data = torch.ones(H)  # new storage (as a reload would allocate)
    assert "layers.0.norm moved" in first.stale(model)
    second = engine._plan_for(info.names, info.dtype_names, info.shapes)
    assert second is not first and second.stale(model) is None
    weights = weights_for(specs, 3)
    for named in packed_buckets(weights, 1 << 20):
        second.apply(named)
    assert torch.equal(model.layers[0].norm, weights["layers.0.norm"])


def make_engine(model: nn.Module, device: str, **overrides):
    """Our engine as vLLM's factory builds it, on a config holding what it reads."""
    from rollout.sync.backends.nccl_worker import DirectNcclWeightTransferEngine

    cfg = dict(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1), model_config=SimpleNamespace(quantization=None), quant_config=None, lora_config=None)
    cfg.update(overrides)
    engine = DirectNcclWeightTransferEngine(SimpleNamespace(backend="rollout-nccl-direct"), SimpleNamespace(**cfg), torch.device(device), model)
    engine.packed = True  # as the trainer's init info sets it
    return engine


def test_the_engine_goes_direct_only_for_a_packed_unquantized_single_gpu_cuda_model():
    model = Toy()
    assert make_engine(model, "cuda")._static_reason() is None
    assert "not CUDA" in make_engine(model, "cpu")._static_reason()
    assert "quantized" in make_engine(model, "cuda", quant_config=object())._static_reason()
    assert "LoRA" in make_engine(model, "cuda", lora_config=object())._static_reason()
    tp2 = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2)
    assert "tensor parallel 1/2" in make_engine(model, "cuda", parallel_config=tp2)._static_reason()
    draft = make_engine(model, "cuda")
    draft.set_weight_update_target(Toy(), SimpleNamespace(quantization=None))
    assert "draft" in draft._static_reason()
    unpacked = make_engine(model, "cuda")
    unpacked.packed = False
    assert "not packed" in unpacked._static_reason()


def test_the_nccl_backend_names_our_engine_and_the_plugin_registers_it_beside_vllms():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout.contracts.backend_registry import get_backend
    from rollout.sync.backends.nccl_worker import DirectNcclWeightTransferEngine
    from rollout.sync.vllm_plugin import register

    backend = get_backend("nccl")
    assert backend.name == "nccl" and backend.vllm_engine == "rollout-nccl-direct"
    assert get_backend("gloo").vllm_engine == "gloo"
    register()
    register()  # plugins load more than once per process
    assert WeightTransferEngineFactory._registry["rollout-nccl-direct"]() is DirectNcclWeightTransferEngine
    assert WeightTransferEngineFactory._registry["nccl"]().__name__ == "NCCLWeightTransferEngine"


# vLLM's own Qwen2ForCausalLM, built on CPU from the demo model (a process of its own:
# it initializes vLLM's distributed state), its params randomized, then: the plan baked on
# meta tensors wrote nothing, and replayed on the checkpoint it equals load_weights.
_QWEN2 = textwrap.dedent(
    """
    import json, sys, torch
    from safetensors.torch import load_file
    from rollout.sync.backends.direct_plan import bake
    from tests.vllm_cpu_qwen2 import qwen2_on_cpu

    model_dir, port, tied = sys.argv[1], sys.argv[2], sys.argv[3] == "tied"
    with qwen2_on_cpu(model_dir, port, tied) as (model, g):
        sd = load_file(f"{model_dir}/model.safetensors")
        if "lm_head.weight" not in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in sd.items()]
        snap = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}
        before = snap()
        plan = bake(model, specs)
        untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        model.load_weights(iter(sd.items()))
        want = snap()
        for p in model.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g))
        plan.apply_fills()
        for n, t in sd.items():
            plan.apply([(n, t)])
        got = snap()
        print("RESULT " + json.dumps(dict(
            untouched=untouched, dropped=list(plan.dropped), fills=len(plan.fills), copies=plan.num_copies, names=len(specs),
            params=len(want), differ=[n for n in want if not torch.equal(want[n], got[n])],
        )))
    """
)


@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_vllms_own_qwen2_loaders_bake_on_meta_and_the_plan_equals_load_weights(model_dir, tied):
    from tests.conftest import free_port

    root = Path(__file__).resolve().parents[1]  # the script imports tests.vllm_cpu_qwen2
    out = subprocess.run([sys.executable, "-c", _QWEN2, str(model_dir), str(free_port()), tied], capture_output=True, text=True, timeout=600, cwd=root)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    r = json.loads(line[len("RESULT ") :])
    assert r["untouched"], "baking wrote a live parameter"
    assert r["differ"] == []
    # Tied: lm_head.weight is the embeddings' parameter, and vLLM's loader skips the alias.
    assert r["dropped"] == (["lm_head.weight"] if tied == "tied" else [])
    assert r["copies"] == r["names"] - len(r["dropped"])


class _Wire:
    """Stands in for the NCCL stream in the engine's round logic: vLLM's consumer replaced
    by one that hands the engine the buckets vLLM's producer would pack, and vLLM's own
    engine steps (layerwise reload) recorded instead of run."""

    def __init__(self, monkeypatch, weights: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer import packed_tensor
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self.calls: list[str] = []
        self.weights = weights
        called = self.calls.append

        def consumer(iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers, device):
            announced = [name for name, _ in iterator]
            assert announced == list(self.weights)
            for named in packed_buckets(self.weights, buffer_size_bytes):
                post_unpack_func(named)

        monkeypatch.setattr(packed_tensor, "packed_nccl_broadcast_consumer", consumer)
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
        for step in ("start_weight_update", "receive_weights", "finish_weight_update"):
            monkeypatch.setattr(NCCLWeightTransferEngine, step, lambda self, *a, step=step: called(step))

    def info(self) -> dict:
        return dict(names=list(self.weights), dtype_names=["float32"] * len(self.weights), shapes=[list(t.shape) for t in self.weights.values()])


def _round(engine, wire: _Wire) -> None:
    engine.model_update_group = object()  # joined (the wire stands in for it)
    engine.packed_buffer_size_bytes = 700
    engine.start_weight_update()
    engine.update_weights(wire.info())
    engine.finish_weight_update()


def test_a_round_goes_direct_without_vllms_reload_and_lands_what_load_weights_would(monkeypatch):
    model, twin = Toy(), Toy()
    weights = weights_for(model.checkpoint_specs(), 5)
    twin.load_weights(weights.items())
    wire = _Wire(monkeypatch, weights)
    engine = make_engine(model, "cuda")
    _round(engine, wire)
    assert engine.last_path == "direct" and wire.calls == []  # no layerwise reload, no load_weights
    assert same(snapshot(model), snapshot(twin))


def test_a_round_the_plan_cannot_replay_is_vllms_own_whole_round(monkeypatch):
    model = Toy()
    specs = [s for s in model.checkpoint_specs() if s[0] != "layers.1.up_proj.weight"]  # leaves gate_up half unwritten
    wire = _Wire(monkeypatch, weights_for(specs))
    engine = make_engine(model, "cuda")
    before = snapshot(model)
    _round(engine, wire)
    assert engine.last_path == "vllm"
    assert wire.calls == ["start_weight_update", "receive_weights", "finish_weight_update"]
    assert same(snapshot(model), before)  # the (recorded) vLLM path wrote it, not ours
    wire.calls.clear()
    _round(make_engine(model, "cpu"), wire)  # CPU: vLLM's from the start
    assert wire.calls == ["start_weight_update", "receive_weights", "finish_weight_update"]


def test_a_failed_vllm_round_is_finalized_so_no_layer_stays_on_meta(monkeypatch):
    wire = _Wire(monkeypatch, weights_for(Toy().checkpoint_specs()))
    engine = make_engine(Toy(), "cpu")
    engine.model_update_group = object()
    engine.start_weight_update()
    # An unknown key: vLLM's parse refuses it in 0.32 and 0.33 alike (0.33's update info
    # defaults its three lists, so leaving them out no longer fails the parse).
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.update_weights({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "unknown": 1})
    assert wire.calls == ["start_weight_update", "finish_weight_update"]
