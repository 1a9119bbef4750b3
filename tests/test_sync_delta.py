"""Deltas (rollout.sync.delta): what changed, the rule that picks a delta or a full send, the
gloo_delta round over a real gloo group (the publisher's sender, the replicas' engine, the
coordinator's copy), refusals of a delta onto another base, and sparse_nccl's CPU parts."""

from __future__ import annotations

import asyncio
import textwrap
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.contracts.backend_registry import get_backend, make_sender
from rollout.contracts.sync_protocol import DeltaBaseError, Member, ParamSpec, PushRound, RoundRequest, Transfer
from rollout.sync import delta, digest


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def changed(base: dict[str, torch.Tensor], fraction: float, seed: int = 0) -> dict[str, torch.Tensor]:
    from rollout.bench.weight_sync import changed_weights

    return changed_weights(base, fraction, torch.Generator().manual_seed(seed))


def demo_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


# ---- what changed, and the rule --------------------------------------------------------


def test_changed_elements_are_found_bit_for_bit():
    base = torch.tensor([0.0, 1.0, float("nan"), 3.0, 4.0])
    new = torch.tensor([-0.0, 1.0, float("nan"), 3.5, 4.0])
    # -0.0 differs from 0.0 in its bytes (a dense load would write it); a NaN kept is no change.
    assert delta.changed_indices(base, new).tolist() == [0, 3]
    with pytest.raises(ValueError, match="not the same tensor"):
        delta.changed_indices(base, new[:4])


def test_the_rule_sends_what_is_cheaper_per_tensor_and_a_delta_only_where_the_publish_costs_less():
    base = {"few": torch.zeros(1000), "most": torch.zeros(100), "ints": torch.zeros(10, dtype=torch.int64), "same": torch.ones(50), "nan": torch.zeros(100)}
    new = {k: v.clone() for k, v in base.items()}
    new["few"][:10] = 1.0  # 10 of 1000: 10 x (8 + 4) bytes beat 4000
    new["most"][:60] = 1.0  # 60 of 100: 720 bytes lose to 400
    new["ints"][0] = 7  # not floating: vLLM's loader marks unchanged elements with NaN
    new["nan"][0] = float("nan")  # a NaN value cannot travel sparse
    d = delta.compute(base, list(new.items()), index_bytes=8)
    assert d.counts == [10, delta.DENSE, delta.DENSE, 0, delta.DENSE]
    full = 4000 + 400 + 80 + 200 + 400
    assert d.choice.mode == "delta" and d.choice.full_bytes == full
    assert d.choice.bytes_sent == d.choice.delta_bytes == 10 * 12 + 400 + 80 + 400
    assert d.choice.changed_elements == 10 + 60 + 1 + 1
    assert "1 sparse, 3 dense, 1 unchanged of 5 tensors" in d.choice.rule
    # Everything changed: the delta is the full send, so the publish is full.
    everything = {k: v + 1 if v.is_floating_point() else v + 1 for k, v in base.items()}
    assert delta.compute(base, list(everything.items()), index_bytes=8).choice.mode == "full"
    with pytest.raises(DeltaBaseError, match="'extra' is not in the delta's base"):
        delta.compute(base, [("extra", torch.zeros(1))], index_bytes=8)


@pytest.mark.parametrize("fraction", [0.01, 0.10])
def test_a_delta_applied_to_the_base_is_the_new_demo_model_byte_for_byte(model_dir, fraction):
    from rollout.sync.wire import pack, unpack

    base = demo_weights(model_dir)
    new = changed(base, fraction)
    params = [ParamSpec.of(n, t) for n, t in new.items()]
    d = delta.compute(base, list(new.items()), index_bytes=8)
    assert d.choice.mode == "delta" and d.choice.bytes_sent < d.choice.full_bytes * (0.05 if fraction == 0.01 else 0.4)
    # Through the wire format (packed, unpacked) as the receivers get it.
    wire = delta.wire_specs(params, d.counts)
    received = dict(unpack(pack(delta.wire_tensors(d, list(new.values()))), wire))
    applied = delta.apply(base, params, d.counts, received)
    assert all(same_bytes(applied[n], new[n]) for n in new)
    assert all(same_bytes(base[n], demo_weights(model_dir)[n]) for n in base), "the base was changed in place"


# ---- a gloo_delta round over real gloo -------------------------------------------------


class RecordingModel(torch.nn.Module):
    """Stands in for vLLM's model in one engine: what load_weights was given, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.loaded[name] = t.clone()
        return {n for n, _ in weights}


def engine():
    from rollout.sync.backends.gloo_delta_worker import GlooDeltaWeightTransferEngine

    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    return GlooDeltaWeightTransferEngine(None, SimpleNamespace(parallel_config=parallel, model_config=None), torch.device("cpu"), RecordingModel())


def push(version: int, params, port: int, transfer_info=None) -> PushRound:
    return PushRound(
        round_id=f"round-{version}-x", version=version, backend="gloo_delta", members=(Member("r", 1, 1),), params=tuple(params),
        bucket_bytes=1 << 16, timeout_s=30.0, transfer=Transfer("127.0.0.1", port, 3), pause_mode="keep", keeper_rank=2, transfer_info=transfer_info,
    )


def run_round(sender, eng, keeper, plan: PushRound, tensors, digest_path: str) -> None:
    """One round: the sender as rank 0, the engine as rank 1, the coordinator's copy as 2."""
    from rollout.sync.backends.gloo_delta_worker import GlooDeltaUpdateInfo

    backend = get_backend("gloo_delta")
    errors = []

    def as_engine():
        try:
            eng.init_transfer_engine(backend.init_info(plan, plan.member("r")))
            eng.receive_weights(GlooDeltaUpdateInfo(**backend.update_info(plan.params, plan.transfer_info), digest_path=digest_path))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def as_keeper():
        try:
            keeper.receive(plan, 2)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=as_engine), threading.Thread(target=as_keeper)]
    for t in threads:
        t.start()
    sender.send(plan, tensors)
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("fraction", [0.01, 0.10])
def test_a_gloo_delta_round_leaves_the_engine_and_the_copy_with_the_new_weights_and_digests_of_them(model_dir, tmp_path, fraction):
    from rollout.contracts.net import free_port
    from rollout.sync.keeper import WeightKeeper

    base = demo_weights(model_dir)
    new = changed(base, fraction, seed=1)
    params = [ParamSpec.of(n, t) for n, t in base.items()]
    sender, eng, keeper = make_sender("gloo_delta"), engine(), WeightKeeper(str(model_dir))
    try:
        # Version 1, in full: nothing committed to price a delta against.
        sender.prepare(list(base.items()))
        assert sender.choice.mode == "full" and sender.offer(list(base.values())) is None
        run_round(sender, eng, keeper, push(1, params, free_port()), list(base.values()), str(tmp_path / "r1"))
        assert digest.read_received(str(tmp_path / "r1")).digests == sender.sent_digests == digest.digest_all(base.items())
        sender.decided(1)
        keeper.commit("round-1-x", 1)

        # Version 2, a delta onto version 1.
        sender.prepare(list(new.items()))
        offered = sender.offer(list(new.values()))
        assert sender.choice.mode == "delta" and offered.delta_base() == 1 and offered.delta_base_digest == digest.combine(digest.digest_all(base.items()))
        assert sender.choice.bytes_sent == sender.choice.delta_bytes < sender.choice.full_bytes
        eng.model.loaded.clear()
        run_round(sender, eng, keeper, push(2, params, free_port(), offered), list(new.values()), str(tmp_path / "r2"))
        # What the publisher digested is the full new weights, and so is what the replica reports.
        want = digest.digest_all(new.items())
        assert sender.sent_digests == want
        assert digest.read_received(str(tmp_path / "r2")).digests == want
        # The model was loaded with every tensor of the new weights, byte for byte (the
        # load a full round of them makes), through vLLM's load_checkpoint_weight_patches.
        assert set(eng.model.loaded) == set(new) and all(same_bytes(eng.model.loaded[n], new[n]) for n in new)
        sender.decided(2)
        keeper.commit("round-2-x", 2)
        held = keeper.committed(params)
        assert keeper.version == 2 and all(same_bytes(h, new[p.name]) for h, p in zip(held, params))
    finally:
        sender.close()
        eng.shutdown()


def test_a_delta_onto_a_base_not_held_is_refused_by_the_engine_and_the_copy_before_anything_loads(model_dir):
    from rollout.sync.backends.gloo_delta import GlooDelta
    from rollout.sync.backends.gloo_delta_worker import GlooDeltaUpdateInfo
    from rollout.sync.keeper import WeightKeeper

    base = {"w": torch.zeros(4)}
    params = [ParamSpec.of("w", base["w"])]
    info = GlooDelta(delta_base_version=3, delta_base_digest=digest.combine(digest.digest_all(base.items())), delta_counts=(1,))
    update = GlooDeltaUpdateInfo(**get_backend("gloo_delta").update_info(params, info))
    eng = engine()
    with pytest.raises(DeltaBaseError, match="holds no base"):
        eng.check_base(update)
    eng.held, eng.held_digests = {"w": torch.ones(4)}, digest.digest_all([("w", torch.ones(4))])
    with pytest.raises(DeltaBaseError, match="not its base"):
        eng.check_base(update)
    eng.held, eng.held_digests = dict(base), digest.digest_all(base.items())
    assert eng.check_base(update) is eng.held
    # The coordinator's copy holds version 0 (the checkpoint): a delta onto 3 is refused.
    with pytest.raises(DeltaBaseError, match="delta onto version 3; the coordinator's copy holds version 0"):
        WeightKeeper(str(model_dir)).receive(push(4, params, 1, info), 2)


async def test_the_coordinator_refuses_a_delta_onto_another_version_before_any_round_opens():
    from rollout.sync.backends.gloo_delta import GlooDelta
    from rollout.sync.coordinator import WeightSyncCoordinator

    c = WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, "gloo_delta")
    specs = (ParamSpec("w", "float32", (2, 2)),)
    await c.register("a", 1, 0, list(specs))
    with pytest.raises(DeltaBaseError, match="onto version 2, the committed version is 0"):
        await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=GlooDelta(2, "d", (0,))))
    assert c.rounds.current is None, "no round opened, no replica woke"
    # A full send (nothing offered) opens as on gloo.
    plan = await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1))
    assert plan.transfer_info is None


async def test_the_coordinator_refuses_a_delta_onto_the_committed_version_but_other_bytes_and_counts_that_do_not_fit(tmp_path):
    from rollout.contracts.net import free_port
    from rollout.errors import InvalidRequestError
    from rollout.sync.backends.gloo_delta import GlooDelta
    from rollout.sync.coordinator import WeightSyncCoordinator

    c = WeightSyncCoordinator({"model": {"path": str(tmp_path)}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, "gloo_delta")
    specs = (ParamSpec("w", "float32", (2, 2)),)
    await c.register("a", 1, 0, list(specs))
    with pytest.raises(InvalidRequestError, match="2 counts for 1 parameters") as e:
        await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=GlooDelta(0, "d", (0, 0))))
    assert e.value.field == "transfer_info.delta_counts"
    with pytest.raises(InvalidRequestError, match="5 changed elements of w, which has 4") as e:
        await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=GlooDelta(0, "d", (5,))))
    assert e.value.field == "transfer_info.delta_counts[0]" and c.rounds.current is None

    # Version 1 committed in full, with its publisher's digests (the copy goes after the
    # commit, over a group no one hosts here: the commit does not wait for it).
    sent = digest.digest_all([("w", torch.zeros(2, 2))])
    plan = await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, copy_group="copy-x", copy_port=free_port()))
    asyncio.get_running_loop().create_task(c.report(plan.round_id, "a", None))
    finish = asyncio.create_task(c.finish(None, plan.round_id, digests=sent))
    await asyncio.sleep(0.05)
    await c.applied(plan.round_id, "a", plan.version)
    assert (await finish).committed and c.store.version == 1
    with pytest.raises(DeltaBaseError, match="onto version 1 with digest 0000000000000000…, the committed version's digest is"):
        await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=GlooDelta(1, "0" * 64, (1,))))
    assert c.rounds.current.plan.round_id == plan.round_id, "no round opened after the committed one"
    opened = await c.begin_round(None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=GlooDelta(1, digest.combine(sent), (1,))))
    assert opened.transfer_info == GlooDelta(1, digest.combine(sent), (1,))
    await c.finish(None, opened.round_id, "not sent: the test ends here")


class HttpIngress:
    """What ``POST /v1/sync/rounds`` does (rollout.http.ingress), over an httpx transport
    in this process: the body typed by ``BeginRoundBody``, the coordinator (on the test's
    loop) answering, its errors from the one wire table."""

    def __init__(self, coordinator, loop):
        self.coordinator, self.loop, self.bodies = coordinator, loop, []

    def __call__(self, request):
        import httpx

        from rollout import wire_errors
        from rollout.errors import RolloutError
        from rollout.sync.remote import PLAN, BeginRoundBody

        assert request.url.path == "/v1/sync/rounds"
        self.bodies.append(request.content)
        try:
            body = BeginRoundBody.model_validate_json(request.content)
            plan = asyncio.run_coroutine_threadsafe(self.coordinator.begin_round(None, body.request()), self.loop).result(10)
        except RolloutError as e:
            answer = wire_errors.encode(e)
            return httpx.Response(answer.status, json=answer.body, headers=answer.headers)
        return httpx.Response(200, json=PLAN.dump_python(plan, mode="json"))

    def client(self):
        import httpx

        from rollout.sync.remote import HttpCoordinator

        c = HttpCoordinator("http://ingress", None, 10.0)
        c.client = httpx.Client(base_url="http://ingress", transport=httpx.MockTransport(self))
        return c


@pytest.mark.parametrize("backend", ["gloo_delta", "sparse_nccl"])
async def test_over_http_a_delta_travels_typed_and_a_wrong_base_is_the_same_typed_refusal(backend):
    import json

    from rollout.errors import InvalidRequestError
    from rollout.sync.backends.delta_info import GlooDelta, SparseNcclDelta
    from rollout.sync.coordinator import WeightSyncCoordinator

    c = WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 1, "require_token": False}}, backend)
    specs = (ParamSpec("w", "float32", (2, 2)), ParamSpec("b", "float32", (2,)))
    await c.register("a", 1, 0, list(specs))
    ingress = HttpIngress(c, asyncio.get_running_loop())
    client = ingress.client()
    onto = {"gloo_delta": lambda v: GlooDelta(v, "ab" * 32, (1, -1)), "sparse_nccl": lambda v: SparseNcclDelta((1, 0), v)}[backend]

    # A base that is not the committed version: the coordinator's DeltaBaseError, read back
    # as that type (the publisher's cue to send in full); nothing opened.
    with pytest.raises(DeltaBaseError, match="onto version 2, the committed version is 0"):
        await asyncio.to_thread(client.begin_round, None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=onto(2)))
    assert c.rounds.current is None
    assert json.loads(ingress.bodies[-1])["transfer_info"]["backend"] == backend
    # The other delta backend's offer is not this platform's: 400 naming the field.
    other = SparseNcclDelta((1, 0), 0) if backend == "gloo_delta" else GlooDelta(0, "ab" * 32, (1, -1))
    with pytest.raises(InvalidRequestError) as e:
        await asyncio.to_thread(client.begin_round, None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=other))
    assert e.value.field == "transfer_info"

    # Onto the committed version: the round opens, and its plan comes back with the offer
    # typed as the backend's sender checks it (JSON carried its fields).
    plan = await asyncio.to_thread(client.begin_round, None, RoundRequest(specs, "127.0.0.1", 1, transfer_info=onto(0)))
    assert type(plan.transfer_info) is type(onto(0)) and plan.transfer_info == onto(0) and plan.transfer_info.delta_base() == 0
    await c.finish(None, plan.round_id, "not sent: the test ends here")


def test_a_delta_is_described_by_fields_the_engine_takes_and_bad_counts_name_the_field():
    from rollout.errors import InvalidRequestError
    from rollout.sync.backends.gloo_delta import GlooDelta
    from rollout.sync.backends.gloo_delta_worker import GlooDeltaUpdateInfo

    backend = get_backend("gloo_delta")
    params = [ParamSpec("a", "float32", (3,)), ParamSpec("b", "float32", (2,))]
    typed = backend.check_transfer_info({"delta_base_version": 1, "delta_base_digest": "d", "delta_counts": [2, -1]})
    info = GlooDeltaUpdateInfo(**backend.update_info(params, typed))
    assert (info.delta_base_version, info.delta_counts) == (1, [2, -1])
    assert [s.name for s in delta.wire_specs(info.specs(), info.delta_counts)] == ["a#indices", "a#values", "b"]
    assert backend.check_transfer_info(None) is None  # a full send
    with pytest.raises(InvalidRequestError) as e:
        backend.check_transfer_info({"delta_base_version": 1, "delta_base_digest": "d", "delta_counts": [-2]})
    assert e.value.field == "transfer_info.delta_counts"
    with pytest.raises(ValueError, match="one count per parameter"):
        GlooDeltaUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[3]], delta_base_version=1, delta_base_digest="d", delta_counts=[1, 1])


# ---- sparse_nccl: what runs without a GPU ------------------------------------------------


def test_sparse_nccl_sends_every_tensor_whole_first_then_only_what_changed_in_our_engines_update_info():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    from rollout.sync.backends.sparse_nccl_worker import DenseOrSparseUpdateInfo

    # Our engine (vLLM's sparse one, taking whole tensors too), under a name of its own.
    backend = get_backend("sparse_nccl")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout.sync.backends.sparse_nccl_worker import DenseOrSparseNCCLWeightTransferEngine
    from rollout.sync.vllm_plugin import register

    assert backend.vllm_engine == "rollout-sparse-nccl" and not backend.keeps_copy
    register()
    assert WeightTransferEngineFactory._registry["rollout-sparse-nccl"]() is DenseOrSparseNCCLWeightTransferEngine
    assert WeightTransferEngineFactory._registry["sparse_nccl"]().__name__ == "SparseNCCLWeightTransferEngine"  # vLLM's stays vLLM's
    assert DenseOrSparseNCCLWeightTransferEngine.update_info_cls is DenseOrSparseUpdateInfo
    v1 = {"w": torch.zeros(100), "b": torch.zeros(10)}
    params = [ParamSpec.of(n, t) for n, t in v1.items()]
    sender = make_sender("sparse_nccl")
    sender.prepare(list(v1.items()))
    first = sender.offer(list(v1.values()))
    # No base: every tensor whole, the bytes of a dense send (no indices).
    assert sender.choice.mode == "full" and first.num_updates_list == (delta.DENSE, delta.DENSE) and first.delta_base() is None
    assert sender.choice.bytes_sent == sender.choice.full_bytes == 110 * 4
    sender.decided(1)
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["w"][[3, 50]] = 2.0
    sender.prepare(list(v2.items()))
    second = sender.offer(list(v2.values()))
    assert sender.choice.mode == "delta" and second.num_updates_list == (2, 0) and second.delta_base() == 1
    assert sender.choice.bytes_sent == 2 * 8 and sender.choice.full_bytes == 440
    plan = PushRound(
        round_id="round-2-x", version=2, backend="sparse_nccl", members=(Member("a", 1, 1),), params=tuple(params),
        bucket_bytes=1, timeout_s=1.0, transfer=Transfer("10.0.0.1", 29500, 2), pause_mode="keep", transfer_info=backend.check_transfer_info({"num_updates_list": [2, 0], "base_version": 1}),
    )
    info = DenseOrSparseUpdateInfo(**backend.update_info(plan.params, plan.transfer_info))
    assert info.num_updates_list == [2, 0] and info.names == ["w", "b"]
    init = NCCLWeightTransferInitInfo(**backend.engine_init_info(plan, plan.member("a")))
    assert (init.rank_offset, init.world_size, init.packed) == (1, 2, False)
    # An aborted delta: the next publish sends every tensor whole again.
    sender.decided(None)
    sender.prepare(list(v2.items()))
    assert sender.choice.mode == "full" and sender.offer([]).num_updates_list == (delta.DENSE, delta.DENSE)


def test_sparse_nccl_prices_each_tensor_with_int32_indices_and_goes_full_where_nothing_is_cheaper_as_a_patch():
    from rollout.sync.backends.sparse_nccl import INDEX_BYTES, patches_for

    assert INDEX_BYTES == 4
    base = {"few": torch.zeros(100), "most": torch.zeros(100), "same": torch.ones(50), "half": torch.zeros(100, dtype=torch.bfloat16)}
    new = {k: t.clone() for k, t in base.items()}
    new["few"][:1] = 1.0  # 1 x (4 + 4) bytes beat 400
    new["most"][:60] = 1.0  # 60 x 8 = 480 bytes lose to 400: whole
    new["half"][:30] = 1.0  # 30 x (4 + 2) = 180 beat 200 (with int64 indices 300 would not)
    patches, choice = patches_for(base, list(new.items()))
    assert [p.count for p in patches] == [1, delta.DENSE, 0, 30]
    assert choice.mode == "delta" and choice.full_bytes == 400 + 400 + 200 + 200
    assert choice.bytes_sent == choice.delta_bytes == 8 + 400 + 180 < choice.full_bytes
    assert patches[1].indices is None and same_bytes(patches[1].values, new["most"].reshape(-1))
    assert patches[0].indices.dtype == torch.int32 and patches[0].indices.tolist() == [0] and patches[0].values.tolist() == [1.0]
    assert patches[2].values.numel() == 0 and patches[2].indices.numel() == 0
    # Every element changed: no tensor is cheaper as a patch, so the publish is full,
    # every tensor whole, the bytes of a dense send.
    everything = {k: t + 1 for k, t in base.items()}
    patches, choice = patches_for(base, list(everything.items()))
    assert choice.mode == "full" and choice.bytes_sent == choice.full_bytes == 1200
    assert all(p.indices is None for p in patches) and sum(p.values.numel() * p.values.element_size() for p in patches) == 1200
    # Patches against most of a tensor lose even where one is unchanged: still whole.
    mostly = {k: (t + 1 if k != "same" else t) for k, t in base.items()}
    patches, choice = patches_for(base, list(mostly.items()))
    assert [p.count for p in patches] == [delta.DENSE, delta.DENSE, 0, delta.DENSE] and choice.mode == "delta" and choice.bytes_sent == 1000


class RecordingGroup:
    """Stands in for vLLM's PyNcclCommunicator on CPU: the sender's broadcasts recorded in
    order, or (``replay``) handed back in that order to a receiver's empty tensors."""

    def __init__(self, replay: list[torch.Tensor] | None = None) -> None:
        self.sent: list[torch.Tensor] = []
        self.replay = list(replay) if replay is not None else None

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        assert src == 0
        if self.replay is None:
            self.sent.append(tensor.clone())
            return
        got = self.replay.pop(0)
        assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), f"received {tensor.dtype} {tuple(tensor.shape)}, sent {got.dtype} {tuple(got.shape)}"
        tensor.copy_(got)


def _sent_over(monkeypatch, sender, plan, tensors) -> list[torch.Tensor]:
    """What ``sender.send`` broadcasts, recorded (its communicator and CUDA stream stood in for)."""
    from rollout.sync.backends import sparse_nccl

    group = RecordingGroup()
    monkeypatch.setattr(sparse_nccl, "sending_device", lambda tensors, backend: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(sender, "_over_communicator", lambda plan, device, broadcast: broadcast(group, device))
    sender.send(plan, tensors)
    return group.sent


def test_sparse_nccl_broadcasts_a_patchs_indices_then_values_a_whole_tensors_values_alone_and_our_engine_receives_them_in_that_order(monkeypatch):
    from rollout.errors import InvalidRequestError
    from rollout.sync.backends.sparse_nccl_worker import DenseOrSparseUpdateInfo, receive

    backend = get_backend("sparse_nccl")
    base = {"a": torch.zeros(100), "b": torch.zeros(8), "c": torch.zeros(20)}
    new = {"a": base["a"].clone(), "b": base["b"] + 1, "c": base["c"].clone()}
    new["a"][[7, 9]] = 3.0
    sender = make_sender("sparse_nccl")
    sender.prepare(list(base.items()))
    sender.decided(4)
    sender.prepare(list(new.items()))
    offer = sender.offer(list(new.values()))
    assert offer == backend.check_transfer_info({"num_updates_list": [2, -1, 0], "base_version": 4})
    params = tuple(ParamSpec.of(n, t) for n, t in new.items())
    offer.check_params(params)
    plan = PushRound(
        round_id="round-5-x", version=5, backend="sparse_nccl", members=(Member("r", 1, 1),), params=params,
        bucket_bytes=1, timeout_s=1.0, transfer=Transfer("10.0.0.1", 29500, 2), pause_mode="keep", transfer_info=offer,
    )
    sent = _sent_over(monkeypatch, sender, plan, list(new.values()))
    # a: int32 indices then values; b: its 8 values alone; c: an empty patch (as vLLM's trainer sends one).
    assert [(t.dtype, t.numel()) for t in sent] == [(torch.int32, 2), (torch.float32, 2), (torch.float32, 8), (torch.int32, 0), (torch.float32, 0)]
    assert sent[0].tolist() == [7, 9] and sent[1].tolist() == [3.0, 3.0] and same_bytes(sent[2], new["b"])

    info = DenseOrSparseUpdateInfo(**backend.update_info(plan.params, offer))
    got = list(receive(RecordingGroup(sent), info, torch.device("cpu"), None))
    assert [(p.name, whole) for p, whole in got] == [("a", False), ("b", True), ("c", False)]
    assert got[1][0].indices.tolist() == list(range(8)) and same_bytes(got[1][0].values, new["b"])  # indices made here, not sent

    # A round whose counts are not what this sender offered is refused before any byte moves.
    other = replace(plan, transfer_info=backend.check_transfer_info({"num_updates_list": [2, 0, 0], "base_version": 4}))
    with pytest.raises(RuntimeError, match="not the ones this sender offered"):
        _sent_over(monkeypatch, sender, other, list(new.values()))
    # A full round offers every tensor whole and no base; counts that patch with no base
    # to patch onto are refused naming the count.
    with pytest.raises(InvalidRequestError) as e:
        backend.check_transfer_info({"num_updates_list": [2, -1, 0]}).check_params(params)
    assert e.value.field == "transfer_info.num_updates_list[0]"
    backend.check_transfer_info({"num_updates_list": [100, -1, 20]}).check_params(params)  # every element: no base needed
    with pytest.raises(InvalidRequestError) as e:
        backend.check_transfer_info({"num_updates_list": [-1, -2, 0], "base_version": 1})
    assert e.value.field == "transfer_info.num_updates_list[1]"
    with pytest.raises(ValueError, match="-1 \\(sent whole\\), 0 \\(unchanged\\)"):
        DenseOrSparseUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2]], num_updates_list=[-2])
    with pytest.raises(ValueError, match="`shapes` should be of the same size as `names`"):
        DenseOrSparseUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[2], [3]], num_updates_list=[-1])


# vLLM's own Qwen2ForCausalLM on CPU, from the demo model (a process of its own: it
# initializes vLLM's distributed state). Two rounds go sender -> recorded broadcasts ->
# our engine's receive and apply (vLLM's load_checkpoint_weight_patches, in small groups):
# a full one (every tensor whole) onto randomized parameters, then a delta mixing whole,
# patched and unchanged tensors; each must leave the parameters exactly as load_weights
# of the full new weights does.
_SPARSE_QWEN2 = textwrap.dedent(
    """
    import json, sys, torch
    from safetensors.torch import load_file
    from rollout.contracts.backend_registry import get_backend
    from rollout.contracts.sync_protocol import ParamSpec
    from rollout.sync.backends.sparse_nccl import broadcast_patches, patches_for
    from rollout.sync.backends.sparse_nccl_worker import DenseOrSparseUpdateInfo, apply_patches, receive
    from tests.test_sync_delta import RecordingGroup
    from tests.vllm_cpu_qwen2 import qwen2_on_cpu

    model_dir, port = sys.argv[1], sys.argv[2]
    backend = get_backend("sparse_nccl")
    snap = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}
    differ = lambda a, b: [n for n in a if not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]

    def round_(base, new):
        named = list(new.items())
        patches, choice = patches_for(base, named)
        sent = RecordingGroup()
        broadcast_patches(sent, patches, torch.device("cpu"), None)
        counts = tuple(p.count for p in patches)
        offer = backend.check_transfer_info({"num_updates_list": list(counts), "base_version": 1 if choice.mode == "delta" else None})
        info = DenseOrSparseUpdateInfo(**backend.update_info([ParamSpec.of(n, t) for n, t in named], offer))
        apply_patches(model, receive(RecordingGroup(sent.sent), info, torch.device("cpu"), None), chunk_bytes=64 << 10)
        got = snap()
        model.load_weights(iter(new.items()))
        return dict(mode=choice.mode, sent=choice.bytes_sent, full=choice.full_bytes, counts=counts, differ=differ(got, snap()))

    with qwen2_on_cpu(model_dir, port) as (model, g):
        sd = load_file(f"{model_dir}/model.safetensors")
        first = round_(None, sd)
        new = {n: t.clone() for n, t in sd.items()}
        names = sorted(new, key=lambda n: -new[n].numel())
        for n in names[:2]:  # every element: whole
            new[n] += 1.0
        for n in names[2:6]:  # 1% of the elements: a patch
            flat = new[n].reshape(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            flat[idx] += 0.5
        second = round_(sd, new)  # the rest unchanged
        print("RESULT " + json.dumps(dict(first=first, second=second, whole=names[:2], patched=names[2:6], order=list(new))))
    """
)


def test_our_sparse_engine_applies_whole_patched_and_unchanged_tensors_into_vllms_qwen2_as_load_weights_does(model_dir):
    import json
    import subprocess
    import sys

    from tests.conftest import free_port

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _SPARSE_QWEN2, str(model_dir), str(free_port())], capture_output=True, text=True, timeout=600, cwd=root)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    r = json.loads(line[len("RESULT ") :])
    first, second = r["first"], r["second"]
    assert first["mode"] == "full" and first["sent"] == first["full"] and set(first["counts"]) == {delta.DENSE}
    assert first["differ"] == []
    counts = dict(zip(r["order"], second["counts"]))
    assert [counts[n] for n in r["whole"]] == [delta.DENSE] * 2 and all(counts[n] > 0 for n in r["patched"])
    assert {c for n, c in counts.items() if n not in r["whole"] + r["patched"]} == {0}
    assert second["mode"] == "delta" and second["sent"] < second["full"]
    assert second["differ"] == []


def test_sparse_nccl_refuses_what_vllms_sparse_loader_cannot_patch_naming_the_tensor():
    from rollout.errors import InvalidRequestError

    sender = make_sender("sparse_nccl")
    with pytest.raises(ValueError, match="sparse_nccl: steps is torch.int64"):
        sender.prepare([("steps", torch.zeros(3, dtype=torch.int64))])
    with pytest.raises(ValueError, match="sparse_nccl: w holds NaN values"):
        sender.prepare([("w", torch.tensor([1.0, float("nan")]))])
    with pytest.raises(InvalidRequestError, match="SparseNcclDelta"):
        get_backend("sparse_nccl").check_transfer_info(None)  # every sparse_nccl round offers its counts


def test_unknown_backends_name_the_delta_forms_too():
    with pytest.raises(ValueError, match="or, sending deltas, \\('gloo_delta', 'sparse_nccl'\\)"):
        get_backend("carrier-pigeon")
