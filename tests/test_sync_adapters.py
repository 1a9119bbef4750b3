"""LoRA adapters as versioned policies, in one process: what a publish must hold (refused
naming the field or the tensor), and the coordinator with real sync agents over stand-in
engines (all or none, catch-up, versions per adapter) without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import torch

from rollout.contracts.sync_protocol import AdapterRequest, SyncError
from rollout.errors import InvalidRequestError
from rollout.sync.adapters import ServedAdapters, adapter_of, check_adapter, encode_tensors
from rollout.sync.agent import SyncAgent
from rollout.sync.checkpoint import checkpoint_spec
from tests.inprocess import InProcess
from tests.lora import demo_adapter


def request(model_dir, seed=0, **changes) -> AdapterRequest:
    tensors, config = demo_adapter(model_dir, seed)
    return AdapterRequest(name=changes.pop("name", "math"), config={**config, **changes.pop("config", {})}, tensors=changes.pop("tensors", None) or encode_tensors(tensors), **changes)


def refused(model_dir, req: AdapterRequest, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        check_adapter(req, checkpoint_spec(str(model_dir)), **kwargs)
    return e.value


# ---- what a publish must hold ---------------------------------------------------------


def test_a_peft_adapter_of_the_served_model_passes(model_dir):
    check_adapter(request(model_dir), checkpoint_spec(str(model_dir)), max_rank=8, served_name="model")
    # PEFT's LoraConfig.to_dict() keeps target_modules as a set: stored as adapter_config.json holds it.
    as_peft = request(model_dir, config={"target_modules": {"q_proj", "v_proj", "down_proj"}})
    check_adapter(as_peft, checkpoint_spec(str(model_dir)))
    assert adapter_of(as_peft, 1).config["target_modules"] == ["down_proj", "q_proj", "v_proj"]


def test_bad_names_and_configs_are_refused_naming_the_field(model_dir):
    assert refused(model_dir, request(model_dir, name="no spaces")).field == "name"
    assert refused(model_dir, request(model_dir, name="model"), served_name="model").field == "name"
    assert refused(model_dir, request(model_dir, version=0)).field == "version"
    e = refused(model_dir, request(model_dir), max_rank=4)
    assert e.field == "config.r" and "max_lora_rank (4)" in e.message
    assert refused(model_dir, request(model_dir, config={"r": "8"})).field == "config.r"
    assert refused(model_dir, request(model_dir, config={"lora_alpha": 0})).field == "config.lora_alpha"
    assert refused(model_dir, request(model_dir, config={"target_modules": []})).field == "config.target_modules"
    assert refused(model_dir, request(model_dir, config={"peft_type": "IA3"})).field == "config.peft_type"


def test_tensors_that_do_not_fit_are_refused_naming_the_tensor(model_dir):
    tensors, _ = demo_adapter(model_dir, 0)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    wrong_rank = dict(tensors, **{q_a: torch.zeros(4, 128)})
    e = refused(model_dir, request(model_dir, tensors=encode_tensors(wrong_rank)))
    assert e.field == f'tensors["{q_a}"]' and "(r=8, in)" in e.message

    wrong_in = dict(tensors, **{q_a: torch.zeros(8, 64)})
    e = refused(model_dir, request(model_dir, tensors=encode_tensors(wrong_in)))
    assert e.field == f'tensors["{q_a}"]' and "in dimension is 128" in e.message

    no_b = {k: v for k, v in tensors.items() if k != q_a.replace("lora_A", "lora_B")}
    e = refused(model_dir, request(model_dir, tensors=encode_tensors(no_b)))
    assert e.field == f'tensors["{q_a.replace("lora_A", "lora_B")}"]' and "missing" in e.message

    unknown = dict(tensors, **{"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128)})
    e = refused(model_dir, request(model_dir, tensors=encode_tensors(unknown)))
    assert "layers.9" in e.field and "no model.layers.9.self_attn.q_proj.weight" in e.message

    untargeted = dict(tensors, **{"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(8, 128)})
    assert "k_proj" in refused(model_dir, request(model_dir, tensors=encode_tensors(untargeted))).field

    not_peft = dict(tensors, **{"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 128)})
    assert refused(model_dir, request(model_dir, tensors=encode_tensors(not_peft))).field == 'tensors["model.layers.0.self_attn.q_proj.weight"]'

    whole = encode_tensors(tensors)
    e = refused(model_dir, request(model_dir, tensors=whole[: len(whole) // 2]))
    assert e.field.startswith("tensors") and "truncated" in e.message
    assert refused(model_dir, request(model_dir, tensors=b"not a file")).field == "tensors"


# ---- the coordinator and the replicas' agents -------------------------------------------


class LoraEngine:
    """Stands in for vLLM's AsyncLLM as far as adapters go: what is loaded, by id. With
    ``refuse`` set, its add_lora fails as vLLM's does for an adapter it cannot load."""

    def __init__(self, refuse: bool = False):
        self.loaded: dict[int, object] = {}
        self.refuse = refuse

    async def get_weight_version(self):
        return "0"

    async def add_lora(self, lora_request) -> bool:
        if self.refuse:
            raise ValueError("LoRA rank 8 is greater than max_lora_rank 4")
        with open(f"{lora_request.lora_path}/adapter_config.json") as f:
            json.load(f)  # what vLLM's loader reads first
        self.loaded[lora_request.lora_int_id] = lora_request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None


def coordinator_for(model_dir, enabled: bool = True):
    from rollout.sync.coordinator import WeightSyncCoordinator

    config = {"model": {"path": str(model_dir), "lora": {"enabled": enabled, "max_lora_rank": 8}}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}
    return WeightSyncCoordinator(config, "nccl")


async def started(coordinator, model_dir, replica_id: str, engine=None) -> SyncAgent:
    agent = SyncAgent(engine=engine or LoraEngine(), coordinator=InProcess(coordinator), replica_id=replica_id, ranks=1, model_path=str(model_dir))
    await agent.start()
    return agent


@contextlib.asynccontextmanager
async def replicas(coordinator, model_dir, *replica_ids: str):
    """Started agents of ``replica_ids``, stopped at the end."""
    agents = [await started(coordinator, model_dir, rid) for rid in replica_ids]
    try:
        yield agents
    finally:
        for agent in agents:
            agent.stop()


def served(agent: SyncAgent) -> dict[str, int]:
    return agent.adapters.versions()


async def test_an_adapter_is_loaded_by_every_replica_and_each_publish_serves_the_next_version(model_dir):
    coordinator = coordinator_for(model_dir)
    a, b = await started(coordinator, model_dir, "a"), await started(coordinator, model_dir, "b")
    try:
        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)
        assert outcome.committed and outcome.version == 1, outcome
        assert served(a) == served(b) == {"math": 1}
        first = a.adapters.get("math")
        assert first.lora_request().lora_name == "math@1" and list(a.engine.loaded) == [first.lora_id]

        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 1)), 10)
        assert outcome.version == 2 and served(a) == served(b) == {"math": 2}
        second = a.adapters.get("math")
        assert second.lora_id != first.lora_id, "a version never reuses another's vLLM id"
        assert list(a.engine.loaded) == [second.lora_id], "the version before left the engine"
        assert (await coordinator.status())["adapters"] == {"math": 2}
        assert (await coordinator.status())["committed_version"] == 0, "the base weights keep their version"

        # Another adapter beside it, with versions of its own.
        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 2, name="code")), 10)
        assert outcome.version == 1 and served(a) == {"math": 2, "code": 1}

        with pytest.raises(InvalidRequestError, match="greater than adapter 'math'"):
            await coordinator.publish_adapter(None, request(model_dir, 3, version=2))
    finally:
        a.stop()
        b.stop()


async def test_a_replica_that_cannot_load_it_aborts_the_round_and_every_replica_keeps_the_version_before(model_dir):
    coordinator = coordinator_for(model_dir)
    a, b = await started(coordinator, model_dir, "a"), await started(coordinator, model_dir, "b")
    try:
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
        b.engine.refuse = True
        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 1)), 10)
        assert not outcome.committed and outcome.failed_replicas == ["b"] and "max_lora_rank" in outcome.error
        assert outcome.version == 1
        assert served(a) == served(b) == {"math": 1}
        assert list(a.engine.loaded) == [a.adapters.get("math").lora_id], "a dropped the version it staged"
        assert (await coordinator.status())["adapters"] == {"math": 1}
    finally:
        a.stop()
        b.stop()


async def test_a_replica_that_starts_later_loads_every_committed_adapter_before_serving(model_dir):
    coordinator = coordinator_for(model_dir)
    # No replica yet: the adapter commits into the coordinator alone.
    assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
    assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 1)), 10)).version == 2
    late = await started(coordinator, model_dir, "late")
    try:
        assert served(late) == {"math": 2} and len(late.engine.loaded) == 1
    finally:
        late.stop()


async def test_with_lora_off_a_publish_is_refused_and_an_unknown_adapter_names_the_field(model_dir):
    from rollout.config import SyncConfig
    from rollout.engine.sync_gate import SyncGate

    with pytest.raises(SyncError, match="model.lora.enabled"):
        await coordinator_for(model_dir, enabled=False).publish_adapter(None, request(model_dir))

    from rollout.api import RolloutRequest

    agent = SyncAgent(engine=None, coordinator=None, replica_id="r", ranks=1, model_path=str(model_dir))
    gate = SyncGate.over(agent, SyncConfig(), "r")
    with pytest.raises(InvalidRequestError) as e:
        gate.check_adapters([(RolloutRequest(prompt_token_ids=[1], adapter="math"), [1])], offset=3)
    assert e.value.field == "requests[3].adapter" and "not a published LoRA adapter" in e.value.message
    off = SyncGate.over(None, SyncConfig(), "r")
    with pytest.raises(InvalidRequestError, match="weight sync is disabled"):
        off.adapter("math")


async def test_a_staged_adapter_whose_bytes_differ_from_the_published_ones_is_not_loaded(model_dir):
    from dataclasses import replace

    adapters = ServedAdapters(LoraEngine(), "r")
    try:
        adapter = replace(adapter_of(request(model_dir), 1), digest="0" * 64)
        with pytest.raises(RuntimeError, match="sha256"):
            await adapters.stage(adapter)
        assert adapters.engine.loaded == {} and adapters.versions() == {}
    finally:
        adapters.close()


def test_model_lora_feeds_the_engine_arguments_and_refuses_a_cpu_cache_smaller_than_a_batch(model_dir):
    from pydantic import ValidationError

    from rollout.config import LoraConfig, ModelConfig
    from rollout.engine.args import engine_kwargs

    off = engine_kwargs(ModelConfig(path=str(model_dir), kv_cache_memory_bytes=64 << 20), "cpu")
    assert "enable_lora" not in off, "engines start without LoRA unless it is enabled"
    on = engine_kwargs(ModelConfig(path=str(model_dir), kv_cache_memory_bytes=64 << 20, lora={"enabled": True, "max_loras": 2, "max_lora_rank": 8}), "cpu")
    assert (on["enable_lora"], on["max_loras"], on["max_lora_rank"], on["max_cpu_loras"]) == (True, 2, 8, None)
    with pytest.raises(ValidationError, match="max_cpu_loras"):
        LoraConfig(max_loras=4, max_cpu_loras=2)


# ---- vLLM's LoRA routes: the directory a trainer names, load_inplace, unload --------------


def peft_dir(model_dir, directory, seed=0) -> str:
    from tests.lora import write_adapter

    tensors, config = demo_adapter(model_dir, seed)
    return write_adapter(directory, tensors, config)


def test_a_peft_directory_is_read_as_a_publish_takes_it_and_anything_else_is_refused_naming_lora_path(model_dir, tmp_path):
    import os

    from rollout.sync.adapters import CONFIG_FILE, TENSORS_FILE, read_peft_directory

    good = peft_dir(model_dir, tmp_path / "good")
    config, tensors = read_peft_directory(good, 64 << 20)
    check_adapter(AdapterRequest("math", config, tensors), checkpoint_spec(str(model_dir)))
    assert tensors == (tmp_path / "good" / TENSORS_FILE).read_bytes()

    def refusal(path, limit=64 << 20) -> str:
        with pytest.raises(InvalidRequestError) as e:
            read_peft_directory(str(path), limit)
        assert e.value.field == "lora_path"
        return e.value.message

    assert "absolute path" in refusal("relative/dir")
    assert "No such file" in refusal(tmp_path / "absent")
    assert "not a directory" in refusal(tmp_path / "good" / CONFIG_FILE)
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / CONFIG_FILE).write_text("{}")
    assert f"has no {TENSORS_FILE}" in refusal(missing)
    (missing / "adapter_model.bin").write_bytes(b"x")
    assert "safe_serialization=True" in refusal(missing)

    # A link inside the directory is read; one resolving outside it is refused.
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "weights").write_bytes((tmp_path / "good" / TENSORS_FILE).read_bytes())
    (inside / CONFIG_FILE).write_text((tmp_path / "good" / CONFIG_FILE).read_text())
    os.symlink("weights", inside / TENSORS_FILE)
    assert read_peft_directory(str(inside), 64 << 20)[1] == tensors
    escaping = tmp_path / "escaping"
    escaping.mkdir()
    (escaping / CONFIG_FILE).write_text("{}")
    os.symlink(tmp_path / "good" / TENSORS_FILE, escaping / TENSORS_FILE)
    assert "outside the directory" in refusal(escaping)
    os.unlink(escaping / TENSORS_FILE)
    os.mkfifo(escaping / TENSORS_FILE)
    assert "not a regular file" in refusal(escaping)

    assert "more than the 1024 read here" in refusal(good, limit=1024)
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / CONFIG_FILE).write_text("{not json")
    (bad_json / TENSORS_FILE).write_bytes(tensors)
    assert f"{CONFIG_FILE} is not JSON" in refusal(bad_json)


async def test_load_inplace_false_on_a_loaded_name_is_refused_as_vllm_refuses_it_and_true_publishes_the_next_version(model_dir):
    from rollout.contracts.sync_protocol import LoadAdapter

    coordinator = coordinator_for(model_dir)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        outcome = await asyncio.wait_for(coordinator.drive(None, LoadAdapter(request(model_dir, 0), inplace=False)), 10)
        assert outcome.committed and outcome.version == 1 and served(a) == served(b) == {"math": 1}
        with pytest.raises(InvalidRequestError) as e:
            await coordinator.drive(None, LoadAdapter(request(model_dir, 1), inplace=False))
        assert e.value.field == "name" and "The lora adapter 'math' has already been loaded" in e.value.message and "load_inplace" in e.value.message
        assert served(a) == {"math": 1}
        outcome = await asyncio.wait_for(coordinator.drive(None, LoadAdapter(request(model_dir, 1), inplace=True)), 10)
        assert outcome.committed and outcome.version == 2 and served(a) == served(b) == {"math": 2}


async def test_an_unload_stops_every_replica_serving_it_the_store_forgets_it_and_a_later_load_continues_its_versions(model_dir):
    from rollout.contracts.sync_protocol import LoadAdapter, UnloadAdapter
    from rollout.errors import AdapterNotFoundError

    coordinator = coordinator_for(model_dir)
    seen: list[tuple[str, object]] = []
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        a.adapters.listen(lambda name, adapter: seen.append((name, adapter and adapter.version)))
        for seed, name in ((0, "math"), (1, "math"), (2, "code")):
            assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, seed, name=name)), 10)).committed
        math_id = a.adapters.get("math").lora_id
        outcome = await asyncio.wait_for(coordinator.drive(None, UnloadAdapter("math")), 10)
        assert outcome.committed and outcome.version == 0, outcome
        assert served(a) == served(b) == {"code": 1}, "every replica stopped serving it; the other adapter stays"
        assert math_id not in a.engine.loaded and ("math", None) == seen[-1]
        assert (await coordinator.status())["adapters"] == {"code": 1}

        # vLLM's 404 for a name it does not serve.
        with pytest.raises(AdapterNotFoundError, match="The lora adapter 'math' cannot be found"):
            await coordinator.drive(None, UnloadAdapter("math"))

        # A replica that starts now does not load it.
        late = await started(coordinator, model_dir, "late")
        assert served(late) == {"code": 1}

        # Loaded again, it continues after the version removed: "math@1" and "math@2" name
        # other weights in the replicas' prefix caches.
        outcome = await asyncio.wait_for(coordinator.drive(None, LoadAdapter(request(model_dir, 3), inplace=False)), 10)
        assert outcome.committed and outcome.version == 3 and served(a) == served(b) == served(late) == {"code": 1, "math": 3}
        with pytest.raises(InvalidRequestError, match="greater than adapter 'math'"):
            await coordinator.publish_adapter(None, request(model_dir, 4, version=2))
        late.stop()


async def test_an_unload_that_a_replica_does_not_answer_aborts_and_every_replica_keeps_serving_it(model_dir):
    from rollout.contracts.sync_protocol import UnloadAdapter

    coordinator = coordinator_for(model_dir)
    coordinator.rounds.sync = coordinator.rounds.sync.model_copy(update={"timeout_s": 0.5})
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
        b.stop()  # still a member (it polled within the liveness window) but never reports
        outcome = await asyncio.wait_for(coordinator.drive(None, UnloadAdapter("math")), 10)
        assert not outcome.committed and "b" in outcome.error and outcome.version == 1, outcome
        assert served(a) == {"math": 1} and (await coordinator.status())["adapters"] == {"math": 1}


class LoopHandle:
    """The coordinator's Serve handle as a blocking caller (a trainer's thread) sees it:
    each call runs on the test's loop; ``result(timeout_s)`` waits for it."""

    def __init__(self, coordinator, loop):
        self.coordinator, self.loop = coordinator, loop

    def __getattr__(self, name):
        method, loop = getattr(self.coordinator, name), self.loop

        class Response:
            def __init__(self, future):
                self.future = future

            def result(self, timeout_s=None):
                return self.future.result(timeout_s)

        return type("Method", (), {"remote": staticmethod(lambda *args: Response(asyncio.run_coroutine_threadsafe(method(*args), loop)))})


class HttpUnloads:
    """What ``POST /v1/sync/adapter-removals`` does (rollout.http.ingress), over an httpx
    transport in this process: the body typed by ``AdapterRemovalBody``, the coordinator
    (on the test's loop) answering, its errors from the one wire table."""

    def __init__(self, coordinator, loop):
        self.coordinator, self.loop = coordinator, loop

    def __call__(self, request):
        import httpx

        from rollout import wire_errors
        from rollout.errors import RolloutError
        from rollout.sync.remote import OUTCOME, AdapterRemovalBody

        assert request.url.path == "/v1/sync/adapter-removals", request.url.path
        try:
            body = AdapterRemovalBody.model_validate_json(request.content)
            outcome = asyncio.run_coroutine_threadsafe(self.coordinator.unload_adapter(None, body.name), self.loop).result(10)
        except RolloutError as e:
            answer = wire_errors.encode(e)
            return httpx.Response(answer.status, json=answer.body, headers=answer.headers)
        return httpx.Response(200, json=OUTCOME.dump_python(outcome, mode="json"))


def publishers(coordinator):
    """``WeightPublisher.connect``'s and ``WeightPublisher.http``'s, reaching ``coordinator``."""
    import httpx

    from rollout.sync import WeightPublisher
    from rollout.sync.coordinator_client import BlockingCoordinatorHandle
    from rollout.sync.remote import HttpCoordinator

    loop = asyncio.get_running_loop()
    over_http = HttpCoordinator("http://ingress", None, 10.0)
    over_http.client = httpx.Client(base_url="http://ingress", transport=httpx.MockTransport(HttpUnloads(coordinator, loop)))
    return WeightPublisher(BlockingCoordinatorHandle(LoopHandle(coordinator, loop), 10.0), "auto", None), WeightPublisher(over_http, "auto", None)


async def test_a_publisher_unloads_an_adapter_from_every_replica_and_replicas_that_start_later_do_not_load_it(model_dir):
    """``WeightPublisher.unload_adapter``, in the cluster and over HTTP: every live replica
    stops serving it, the coordinator's catch-up state forgets it, and a name not published
    is refused naming ``name`` before any round opens."""
    from rollout.config import SyncConfig
    from rollout.engine.sync_gate import SyncGate
    from rollout.errors import AdapterNotFoundError

    coordinator = coordinator_for(model_dir)
    in_cluster, over_http = publishers(coordinator)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        for seed, name in ((0, "math"), (1, "math"), (2, "code")):
            assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, seed, name=name)), 10)).committed
        math_ids = {a.adapters.get("math").lora_id, b.adapters.get("math").lora_id}

        assert await asyncio.to_thread(in_cluster.unload_adapter, "math") is None
        assert in_cluster.last_outcome.committed and in_cluster.last_outcome.failed_replicas == []
        assert served(a) == served(b) == {"code": 1}, "every live replica stopped serving it; the other adapter stays"
        assert not math_ids & (set(a.engine.loaded) | set(b.engine.loaded)), "it left every engine"
        with pytest.raises(InvalidRequestError, match="not a published LoRA adapter"):
            SyncGate.over(a, SyncConfig(), "a").adapter("math")
        assert (await coordinator.status())["adapters"] == {"code": 1}
        caught_up = coordinator.store.committed_adapters()
        assert [c.name for c in caught_up.copies] == ["code"] and caught_up.without_copy == (), "catch-up no longer holds it"

        # A replica that starts now loads what is committed, not the adapter unloaded.
        late = await started(coordinator, model_dir, "late")
        try:
            assert served(late) == {"code": 1}

            # Over HTTP too, on every replica, the late one included.
            assert await asyncio.to_thread(over_http.unload_adapter, "code") is None
            assert served(a) == served(b) == served(late) == {} and (await coordinator.status())["adapters"] == {}

            # A name not published: typed, naming the field, before any round opens; the
            # same error over HTTP (a 404 `adapter_not_found`).
            rounds_before = [o.round_id for o in coordinator.rounds.history]
            for publisher in (in_cluster, over_http):
                with pytest.raises(AdapterNotFoundError) as e:
                    await asyncio.to_thread(publisher.unload_adapter, "math")
                assert e.value.field == "name" and e.value.message == "'math' is not a published LoRA adapter (published: none)", e.value
            assert [o.round_id for o in coordinator.rounds.history] == rounds_before, "no round opened"

            # Published again, it continues after the version removed.
            outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 3)), 10)
            assert outcome.committed and outcome.version == 3 and served(a) == served(late) == {"math": 3}
            with pytest.raises(AdapterNotFoundError, match=r"^name: 'nope' is not a published LoRA adapter \(published: 'math'\)$"):
                await asyncio.to_thread(over_http.unload_adapter, "nope")
        finally:
            late.stop()


async def test_a_publishers_unload_that_a_replica_does_not_answer_raises_and_every_replica_keeps_serving_it(model_dir):
    coordinator = coordinator_for(model_dir)
    coordinator.rounds.sync = coordinator.rounds.sync.model_copy(update={"timeout_s": 0.5})
    in_cluster, _ = publishers(coordinator)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
        b.stop()  # still a member (it polled within the liveness window) but never reports
        with pytest.raises(SyncError, match="every replica keeps serving adapter 'math' version 1"):
            await asyncio.to_thread(in_cluster.unload_adapter, "math")
        assert served(a) == {"math": 1} and (await coordinator.status())["adapters"] == {"math": 1}


async def test_with_lora_off_a_publishers_unload_is_refused_saying_so(model_dir):
    in_cluster, _ = publishers(coordinator_for(model_dir, enabled=False))
    with pytest.raises(SyncError, match="model.lora.enabled"):
        await asyncio.to_thread(in_cluster.unload_adapter, "math")


async def test_the_readmes_peft_calls_publish_an_adapter_every_replica_stages_as_vllm_reads_it(model_dir, tmp_path):
    """The LoRA example as a trainer writes it with PEFT (the ``lora`` extra):
    ``publish_adapter(name, get_peft_model_state_dict(model), peft_config.to_dict())`` through
    a publisher, and the directory ``save_pretrained`` writes (what vLLM's
    ``/v1/load_lora_adapter`` route reads): both pass the coordinator's checks, every replica
    stages them, and vLLM's own reader of the config takes what a replica wrote."""
    peft = pytest.importorskip("peft", reason="PEFT: pip install -e '.[lora]'")
    from transformers import AutoModelForCausalLM
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    from rollout.sync.adapters import read_peft_directory

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    peft_config = model.peft_config["default"]
    # A trained adapter's B is not zero: make this one change something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    tensors = peft.get_peft_model_state_dict(model)
    assert tensors and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in tensors), list(tensors)

    coordinator = coordinator_for(model_dir)
    in_cluster, _ = publishers(coordinator)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        version = await asyncio.to_thread(in_cluster.publish_adapter, "math", tensors, peft_config.to_dict())
        assert version == 1 and served(a) == served(b) == {"math": 1}
        staged = a.adapters.get("math").path
        helper = PEFTHelper.from_local_dir(staged, None)
        helper.validate_legal(LoRAConfig(max_lora_rank=8))
        assert (helper.r, helper.lora_alpha, sorted(helper.target_modules)) == (8, 16, ["q_proj", "v_proj"])

        # The directory PEFT writes: what vLLM's LoRA route reads, checked the same way.
        model.save_pretrained(str(tmp_path / "math"))
        config, data = read_peft_directory(str(tmp_path / "math"), 1 << 30)
        check_adapter(AdapterRequest(name="math", config=config, tensors=data), checkpoint_spec(str(model_dir)), max_rank=8, served_name="model")
        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, AdapterRequest(name="math", config=config, tensors=data)), 10)
        assert outcome.committed and outcome.version == 2 and served(a) == served(b) == {"math": 2}


# ---- a restarted coordinator learns the adapters back from the replicas -------------------


async def restarted(coordinator, model_dir, agents: list[SyncAgent]):
    """A new coordinator in place of ``coordinator`` (its state gone, as after a restart):
    the agents' next poll reaches it, is told to register again, and does."""
    fresh = coordinator_for(model_dir)
    for agent in agents:
        agent.coordinator._handle.coordinator = fresh  # the handle now reaches the new one
    coordinator.membership.wake_all()  # end the long polls waiting on the old one
    async with asyncio.timeout(10):
        while set(fresh.membership.replicas) != {agent.replica_id for agent in agents}:
            await asyncio.sleep(0.02)
    return fresh


async def test_a_restarted_coordinator_learns_the_adapters_back_and_never_reuses_a_version(model_dir):
    from rollout.config import SyncConfig
    from rollout.contracts.sync_protocol import UnloadAdapter
    from rollout.engine.sync_gate import SyncGate
    from rollout.errors import NotServingError

    coordinator = coordinator_for(model_dir)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        for seed, name in ((0, "math"), (1, "math"), (2, "code")):
            assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, seed, name=name)), 10)).committed
        assert (await asyncio.wait_for(coordinator.drive(None, UnloadAdapter("code")), 10)).committed
        assert served(a) == served(b) == {"math": 2}

        fresh = await restarted(coordinator, model_dir, [a, b])
        status = await fresh.status()
        assert status["adapters"] == {"math": 2} and status["adapters_without_copy"] == ["math"], status
        assert served(a) == served(b) == {"math": 2}, "what the replicas serve is as it was"

        # A replica that starts now cannot load it (no copy here): it serves the rest and
        # refuses requests naming it, retryably, while the replicas that hold it serve them.
        late = await started(fresh, model_dir, "late")
        try:
            assert served(late) == {} and late.adapters.unavailable == {"math": 2}
            with pytest.raises(NotServingError, match="'math' version 2 is committed but not loaded here"):
                SyncGate.over(late, SyncConfig(), "late").adapter("math")
            assert SyncGate.over(a, SyncConfig(), "a").adapter("math").lora_request().lora_name == "math@2"
            with pytest.raises(InvalidRequestError, match="not a published LoRA adapter"):
                SyncGate.over(late, SyncConfig(), "late").adapter("code")

            # The next publish continues after the versions the replicas held: "math@1" and
            # "math@2" (and the unloaded "code@1") name other weights in their prefix caches.
            with pytest.raises(InvalidRequestError, match="greater than adapter 'math'"):
                await fresh.publish_adapter(None, request(model_dir, 3, version=2))
            outcome = await asyncio.wait_for(fresh.publish_adapter(None, request(model_dir, 3)), 10)
            assert outcome.committed and outcome.version == 3, outcome
            assert served(a) == served(b) == served(late) == {"math": 3} and late.adapters.unavailable == {}
            assert SyncGate.over(late, SyncConfig(), "late").adapter("math").lora_request().lora_name == "math@3"
            outcome = await asyncio.wait_for(fresh.publish_adapter(None, request(model_dir, 4, name="code")), 10)
            assert outcome.committed and outcome.version == 2, outcome
            status = await fresh.status()
            assert status["adapters"] == {"math": 3, "code": 2} and status["adapters_without_copy"] == [], status
        finally:
            late.stop()


async def test_a_restarted_coordinator_can_unload_a_learned_adapter(model_dir):
    from rollout.contracts.sync_protocol import UnloadAdapter

    coordinator = coordinator_for(model_dir)
    async with replicas(coordinator, model_dir, "a") as (a,):
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
        fresh = await restarted(coordinator, model_dir, [a])
        outcome = await asyncio.wait_for(fresh.drive(None, UnloadAdapter("math")), 10)
        assert outcome.committed and served(a) == {} and (await fresh.status())["adapters"] == {}
        assert fresh.store.last_adapter_version("math") == 1


def test_what_replicas_report_is_learned_whatever_order_they_register_in(model_dir):
    from rollout.contracts.sync_protocol import HeldAdapter
    from rollout.sync.store import CommittedWeights

    reports = [
        ("a", (HeldAdapter("math", 2), HeldAdapter("code", 1))),
        ("b", (HeldAdapter("math", 1),)),  # lagging: it loads version 2 at catch-up... where a copy exists
        ("c", (HeldAdapter("code", 3, served=False),)),  # an unload removed code at 3 (a missed it)
    ]
    for order in (reports, reports[::-1]):
        store = CommittedWeights("nccl", str(model_dir), 5, None)
        for replica_id, held in order:
            store.learn_adapters(replica_id, held)
        assert store.adapter_versions() == {"math": 2}, order
        assert store.committed_adapters().without_copy == (HeldAdapter("math", 2),)
        assert (store.last_adapter_version("math"), store.last_adapter_version("code")) == (2, 3)


# ---- a replica that missed rounds serves exactly the committed adapters once back ---------


def silent(coordinator, agent: SyncAgent) -> None:
    """``agent`` stops polling and the coordinator's silence horizon has passed for it: the
    next round drops it from membership (as a replica whose node stalled)."""
    agent.stop()
    coordinator.membership.replicas[agent.replica_id].last_seen -= 3600


async def back(agent: SyncAgent, want: dict[str, int]) -> None:
    """``agent`` polls again: told to register again (it was dropped), it does and catches up."""
    agent._task = asyncio.get_running_loop().create_task(agent._poll_forever())
    async with asyncio.timeout(10):
        while served(agent) != want:
            await asyncio.sleep(0.02)


async def test_a_replica_that_missed_an_unload_unloads_it_when_it_registers_again(model_dir, caplog):
    from rollout.config import SyncConfig
    from rollout.contracts.sync_protocol import HeldAdapter, UnloadAdapter
    from rollout.engine.sync_gate import SyncGate

    coordinator = coordinator_for(model_dir)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        for seed, name in ((0, "math"), (1, "code")):
            assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, seed, name=name)), 10)).committed
        math_id = b.adapters.get("math").lora_id
        seen: list[tuple[str, object]] = []
        b.adapters.listen(lambda name, adapter: seen.append((name, adapter and adapter.version)))
        silent(coordinator, b)
        outcome = await asyncio.wait_for(coordinator.drive(None, UnloadAdapter("math")), 10)
        assert outcome.committed and set(coordinator.membership.replicas) == {"a"}, outcome
        assert served(a) == {"code": 1} and served(b) == {"math": 1, "code": 1}, "b missed the unload"

        with caplog.at_level("WARNING", logger="rollout.sync.agent"):
            await back(b, {"code": 1})
        assert math_id not in b.engine.loaded and seen[-1] == ("math", None), "out of the engine and vLLM's OpenAI map"
        assert any("unloaded adapter math version 1: not committed" in r.getMessage() for r in caplog.records)
        with pytest.raises(InvalidRequestError, match="not a published LoRA adapter"):
            SyncGate.over(b, SyncConfig(), "b").adapter("math")
        # A restarted coordinator learns from it that math was removed at 1, as from a.
        assert HeldAdapter("math", 1, served=False) in b.adapters.held()
        outcome = await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 2)), 10)
        assert outcome.version == 2 and served(a) == served(b) == {"code": 1, "math": 2}


async def test_a_replica_behind_a_learned_adapter_it_cannot_load_stops_serving_its_older_version(model_dir):
    from rollout.config import SyncConfig
    from rollout.engine.sync_gate import SyncGate
    from rollout.errors import NotServingError

    coordinator = coordinator_for(model_dir)
    async with replicas(coordinator, model_dir, "a", "b") as (a, b):
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 0)), 10)).committed
        old_id = b.adapters.get("math").lora_id
        silent(coordinator, b)
        assert (await asyncio.wait_for(coordinator.publish_adapter(None, request(model_dir, 1)), 10)).version == 2
        assert served(a) == {"math": 2} and served(b) == {"math": 1}, "b missed version 2"

        # The coordinator restarts; a registers (math@2 learned, no copy), then b comes back.
        fresh = await restarted(coordinator, model_dir, [a])
        b.coordinator._handle.coordinator = fresh
        await back(b, {})
        assert b.adapters.unavailable == {"math": 2} and old_id not in b.engine.loaded
        with pytest.raises(NotServingError, match="'math' version 2 is committed but not loaded here"):
            SyncGate.over(b, SyncConfig(), "b").adapter("math")
        outcome = await asyncio.wait_for(fresh.publish_adapter(None, request(model_dir, 2)), 10)
        assert outcome.version == 3 and served(a) == served(b) == {"math": 3} and b.adapters.unavailable == {}
