"""Sleep and wake over every replica (issue 42, rollout.sync.sleep), on CPU: the rules, one
replica's engine converging to the fleet's sleep (a recording engine stands in for vLLM's,
in the unit test of that one module), the coordinator's coordination with the replicas'
side played by the calls their agents make, a replica refusing requests while asleep, the
autoscaler, and the HTTP contract (status codes, error bodies naming fields and the
platform). The GPU check (tests/gpu/test_gpu_sleep.py) measures the real thing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout.contracts.sync_protocol import (
    SLEEP_TAGS,
    Control,
    FleetAsleepError,
    FleetQuery,
    OpenSession,
    ReloadRound,
    RoundRequest,
    Sleep,
    SleepFleet,
    SleepUnavailableError,
    WakeFleet,
)
from rollout.errors import InvalidRequestError
from rollout.sync import sleep as rules
from rollout.sync.coordinator import WeightSyncCoordinator
from tests.test_sync_coordinator import SPECS, commit

GPU_MODEL = {"path": "/m", "device": "cuda", "enable_sleep_mode": True}


def coordinator(model=GPU_MODEL, backend: str = "nccl") -> WeightSyncCoordinator:
    return WeightSyncCoordinator({"model": model, "metrics": {"enabled": False}, "sync": {"timeout_s": 2, "require_token": False, "poll_s": 0.05, "silent_polls": 100}}, backend)


# ---- the rules -----------------------------------------------------------------------------


def test_the_fleets_sleep_follows_sleep_and_partial_wakes_and_refuses_what_it_cannot_do():
    s = rules.after_sleep(None, 2, "wait")
    assert s == Sleep(2, "wait", SLEEP_TAGS) and rules.after_sleep(s, 2, "abort") is s, "the same sleep again is accepted"
    with pytest.raises(FleetAsleepError, match="asleep at level 2 .* /wake_up before a /sleep at level 1") as e:
        rules.after_sleep(s, 1, "abort")
    assert e.value.state == "asleep at level 2 (kv_cache, weights asleep)"
    for level in (0, 3):
        with pytest.raises(InvalidRequestError, match="level 0 is /pause here") as bad:
            rules.after_sleep(None, level, "abort")
        assert bad.value.field == "level"
    with pytest.raises(InvalidRequestError, match="level 2 discards") as bad:
        rules.after_sleep(None, 2, "keep")
    assert bad.value.field == "mode"
    assert rules.after_sleep(None, 1, "keep") == Sleep(1, "keep")

    weights_up = rules.after_wake(s, ["weights"])
    assert weights_up == Sleep(2, "wait", ("kv_cache",))
    assert rules.after_wake(weights_up, ["weights"]) == weights_up, "a tag already awake stays so"
    assert rules.after_wake(weights_up, ["kv_cache"]) is None and rules.after_wake(s, None) is None and rules.after_wake(None, None) is None
    for tags in (["scheduling"], [], ["weights", "gpu"]):
        with pytest.raises(InvalidRequestError) as bad:
            rules.after_wake(s, tags)
        assert bad.value.field == "tags"


def test_rounds_are_refused_while_the_weights_sleep_and_run_while_only_the_kv_cache_does():
    with pytest.raises(FleetAsleepError, match="a publish refused: the replicas are asleep at level 1 .* weights offloaded to host memory"):
        rules.refuse_round(Sleep(1), "a publish")
    with pytest.raises(FleetAsleepError, match="weights discarded; /wake_up"):
        rules.refuse_round(Sleep(2), "a publish")
    rules.refuse_round(Sleep(2, asleep=("kv_cache",)), "a publish")  # weights awake: a trainer publishes before waking the KV cache
    rules.refuse_round(None, "a publish")


def test_sleep_mode_is_unavailable_on_cpu_naming_the_platform_and_off_until_enabled():
    from rollout.config import ModelConfig

    on_cpu = rules.unavailable(ModelConfig(path="/m", device="cpu"))
    assert "its replicas run on CPU (model.device: cpu)" in on_cpu and "CPU platform has no sleep mode" in on_cpu
    assert "model.enable_sleep_mode: true" in rules.unavailable(ModelConfig(path="/m", device="cuda"))
    assert rules.unavailable(ModelConfig(path="/m", device="cuda", enable_sleep_mode=True)) is None


def test_config_and_engine_arguments_refuse_sleep_mode_on_cpu_and_pass_it_to_vllm_on_gpus():
    from pydantic import ValidationError

    from rollout.config import ModelConfig
    from rollout.engine.args import engine_kwargs
    from rollout.engine.memory import EngineStartError

    with pytest.raises(ValidationError, match="enable_sleep_mode: vLLM's CPU platform has no sleep mode"):
        ModelConfig(path="/m", device="cpu", enable_sleep_mode=True)
    auto = ModelConfig(path="/m", enable_sleep_mode=True)  # "auto": decided where the app is built
    with pytest.raises(EngineStartError, match="run on cpu") as e:
        engine_kwargs(auto, "cpu")
    assert e.value.field == "model.enable_sleep_mode"
    assert engine_kwargs(ModelConfig(path="/m", device="cuda", enable_sleep_mode=True, gpu_memory_utilization=0.5), "cuda")["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine_kwargs(ModelConfig(path="/m", device="cuda", gpu_memory_utilization=0.5), "cuda")


def test_an_app_built_for_cpu_refuses_sleep_mode_and_records_the_device_auto_resolved_to():
    from rollout.app import build_application
    from rollout.config import PlatformConfig

    with pytest.raises(ValueError, match="model.enable_sleep_mode: true, but the replicas run on cpu .model.device: auto.: vLLM's CPU platform"):
        build_application(PlatformConfig.model_validate({"model": {"path": "/m", "enable_sleep_mode": True}}))
    ingress = build_application(PlatformConfig.model_validate({"model": {"path": "/m"}}))._bound_deployment
    _, config, coordinator_ = ingress._replica_config.init_args
    assert config["model"]["device"] == "cpu" and coordinator_._bound_deployment._replica_config.init_args[0]["model"]["device"] == "cpu"


# ---- one replica's engine (rollout.sync.sleep.ReplicaSleep), a recording engine -----------


class SleepingEngine:
    """Records vLLM's sleep calls, as AsyncLLM takes them."""

    def __init__(self):
        self.calls = []

    async def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level, mode))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags is not None else None))
        return True


async def test_a_replica_sleeps_once_and_restores_the_committed_weights_when_they_wake_after_level_2():
    engine = SleepingEngine()
    s = rules.ReplicaSleep(engine, "r")
    refusals = []

    async def restore():
        refusals.append(s.refusal)  # what a request meets while the weights reload

    assert await s.converge(Sleep(2), restore) is False
    assert await s.converge(Sleep(2), restore) is False, "applied once"
    assert engine.calls == [("sleep", 2, "abort")] and s.level == 2 and "asleep at level 2" in s.refusal
    # The trainer wakes the weights first: they reload before the KV cache wakes.
    assert await s.converge(Sleep(2, asleep=("kv_cache",)), restore) is False
    assert engine.calls[-1] == ("wake_up", ("weights",)) and len(refusals) == 1 and "kv_cache asleep" in refusals[0]
    assert await s.converge(None, restore) is True, "fully awake: the caller re-applies a trainer's /pause"
    assert engine.calls[-1] == ("wake_up", ("kv_cache",)) and len(refusals) == 1 and s.refusal is None and s.level == 0


async def test_a_level_1_wake_restores_nothing_and_a_replica_that_missed_a_wake_converges():
    engine = SleepingEngine()
    s = rules.ReplicaSleep(engine, "r")
    restored = []

    async def restore():
        restored.append(s.refusal)

    await s.converge(Sleep(1), restore)
    assert await s.converge(None, restore) is True and restored == []
    assert engine.calls == [("sleep", 1, "abort"), ("wake_up", ("kv_cache", "weights"))]
    # Asleep at level 2 while the fleet woke and slept again at level 1 (its polls were lost):
    # it wakes (restoring the discarded weights), then sleeps as the fleet does.
    engine.calls.clear()
    await s.converge(Sleep(2), restore)
    await s.converge(Sleep(1), restore)
    assert engine.calls == [("sleep", 2, "abort"), ("wake_up", ("kv_cache", "weights")), ("sleep", 1, "abort")]
    assert len(restored) == 1 and "reloading the committed weights after a level-2 sleep" in restored[0] and s.level == 1


# ---- the coordinator: sleep and wake over every replica -----------------------------------


async def poll(c, rid: str, control: Control):
    return await c.next_round(rid, c.membership.replicas[rid].version, control)


async def test_sleep_returns_once_every_replica_slept_and_rounds_are_refused_naming_the_state_until_the_weights_wake():
    c = coordinator()
    for rid in ("a", "b"):
        await c.register(rid, 1, 0, SPECS)
    assert await c.drive(None, FleetQuery.IS_SLEEPING) is False
    sleep = asyncio.create_task(c.drive(None, SleepFleet(2, "wait")))
    asleep = Control(sleep=Sleep(2, "wait"))
    assert [await poll(c, rid, Control()) for rid in ("a", "b")] == [asleep, asleep], "each replica is told to sleep"
    await asyncio.sleep(0.1)
    assert not sleep.done(), "b has not slept yet"
    await poll(c, "a", asleep)
    await poll(c, "b", asleep)
    await asyncio.wait_for(sleep, 2)
    assert await c.drive(None, FleetQuery.IS_SLEEPING) is True and (await c.status())["sleep"] == "asleep at level 2 (kv_cache, weights asleep)"

    # Every kind of round a trainer opens is refused, naming the sleep; nothing opened.
    with pytest.raises(FleetAsleepError, match="a publish refused: the replicas are asleep at level 2") as e:
        await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1))
    assert e.value.state == "asleep at level 2 (kv_cache, weights asleep)" and c.rounds.current is None
    with pytest.raises(FleetAsleepError, match="/init_weight_transfer_engine refused"):
        await c.drive(None, OpenSession({"master_address": "127.0.0.1", "master_port": 29500, "world_size": 3}))
    with pytest.raises(FleetAsleepError, match="/start_weight_update refused"):
        await c.drive(None, FleetQuery.START_UPDATE)
    with pytest.raises(FleetAsleepError, match="/wake_up before a /sleep at level 1"):
        await c.drive(None, SleepFleet(1))

    # The weights wake (a replica's restore opens a round of its own meanwhile: allowed);
    # with only the KV cache asleep a publish opens.
    wake = asyncio.create_task(c.drive(None, WakeFleet(("weights",))))
    half = Control(sleep=Sleep(2, "wait", ("kv_cache",)))
    for rid in ("a", "b"):
        assert await poll(c, rid, asleep) == half
        plan = await c.restore(rid)  # version 0, nothing published: the model directory itself
        assert isinstance(plan, ReloadRound) and plan.checkpoint == "/m" and plan.version == 0
        assert (await c.report(plan.round_id, rid, None)).committed
        await c.applied(plan.round_id, rid, 0)
        await poll(c, rid, half)
    assert await asyncio.wait_for(wake, 2) is False, "not fully awake"
    assert await c.drive(None, FleetQuery.IS_SLEEPING) is True
    plan = await c.begin_round(None, RoundRequest(tuple(SPECS), "127.0.0.1", 1, checkpoint="/ckpt/v1"))
    await commit(c, plan, members=("a", "b"))

    wake = asyncio.create_task(c.drive(None, WakeFleet()))
    for rid in ("a", "b"):
        assert await poll(c, rid, half) == Control()
        await poll(c, rid, Control())
    assert await asyncio.wait_for(wake, 2) is True and await c.drive(None, FleetQuery.IS_SLEEPING) is False
    assert (await c.status())["sleep"] is None


async def test_a_replica_that_starts_while_the_fleet_sleeps_is_told_to_sleep_and_one_behind_does_not_fail_the_call():
    c = coordinator()
    await c.register("a", 1, 0, SPECS)
    sleep = asyncio.create_task(c.drive(None, SleepFleet(1)))
    await poll(c, "a", Control(sleep=Sleep(1)))
    await asyncio.wait_for(sleep, 2)
    await c.register("late", 1, 0, SPECS)
    assert await poll(c, "late", Control()) == Control(sleep=Sleep(1))


async def test_sleep_and_wake_are_refused_where_sleep_mode_is_off_naming_the_platform():
    for model, says in (({"path": "/m", "device": "cpu"}, "its replicas run on CPU"), ({"path": "/m", "device": "cuda"}, "set model.enable_sleep_mode: true")):
        c = coordinator(model)
        await c.register("a", 1, 0, SPECS)
        for command in (SleepFleet(1), WakeFleet(), FleetQuery.IS_SLEEPING):
            with pytest.raises(SleepUnavailableError, match=says):
                await c.drive(None, command)
        assert c.membership.control == Control(), "nothing changed"


# ---- a replica while asleep; the autoscaler -------------------------------------------------


async def test_an_asleep_replica_refuses_requests_retryably_passes_its_health_check_and_reports_its_level():
    from rollout.engine.sync_gate import NoSync
    from rollout.errors import NotServingError
    from tests.test_replica_parts import replica, request

    asleep = NoSync()
    asleep.asleep, asleep.sleep_level = "replica r is asleep at level 1 (kv_cache, weights asleep) (a trainer's /sleep; /wake_up wakes it)", 1
    r = replica(agent=asleep)
    with pytest.raises(NotServingError, match="asleep at level 1 .* retry once the trainer wakes the replicas") as e:
        await r.generate([request()])
    assert e.value.replica_id == "r" and r.admission.inflight.count == 0
    # Requests a level-1 sleep keeps (mode keep) make no engine step until the wake: not stuck.
    r.config.deployment.stuck_timeout_s = 0.01
    with r.admission.inflight.counted(2):
        await asyncio.sleep(0.05)
        await r.check_health()
    assert r._load().sleep_level == 1 and r.record_autoscaling_stats()["engine_sleep_level"] == 1.0


def test_the_autoscaler_keeps_the_replica_count_while_replicas_sleep():
    from rollout.scaling import engine_load_policy

    def ctx(metrics):
        return SimpleNamespace(
            current_num_replicas=3, target_num_replicas=3, running_replicas=["a", "b", "c"], aggregated_metrics=metrics,
            config=SimpleNamespace(get_target_ongoing_requests=lambda: 64),
        )

    idle = {"engine_running": {r: 0.0 for r in "abc"}, "engine_waiting": {r: 0.0 for r in "abc"}}
    assert engine_load_policy(ctx({**idle, "engine_sleep_level": {r: 0.0 for r in "abc"}}))[0] == 0.0, "idle and awake: scale down"
    assert engine_load_policy(ctx({**idle, "engine_sleep_level": {"a": 0.0, "b": 0.5, "c": 2.0}}))[0] == 3, "asleep: keep"


# ---- the HTTP contract ----------------------------------------------------------------------


@pytest.fixture
def ingress_over():
    """The ingress's app in this process over a real coordinator (no replica registered:
    a sleep or wake applies at once), with vLLM's routes served by the ingress's own code."""
    from fastapi.testclient import TestClient
    from ray import serve

    from rollout.config import load_config
    from rollout.http.ingress import app
    from rollout.http.rl_routes import VllmRlRoutes
    from rollout.sync.auth import AccessPolicy, SyncAuth
    from rollout.sync.coordinator_client import CoordinatorHandle
    from tests.inprocess import InProcess

    class Routes(VllmRlRoutes):
        """What Serve hands each route: the ingress, here only its vLLM-route part."""

        def __init__(self, coordinator, config):
            self.coordinator, self.config = coordinator, config

    patch = pytest.MonkeyPatch()
    clients = []

    def make(model: dict):
        config = load_config({"model": model, "sync": {"require_token": False, "timeout_s": 2}}, environ={})
        c = WeightSyncCoordinator(config.model_dump(mode="json"), "nccl")
        app.state.auth = AccessPolicy(None, SyncAuth.of(config.sync))
        app.state.max_body_bytes = 1 << 20
        routes = Routes(CoordinatorHandle(InProcess(c)), config)
        patch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=routes))
        client = TestClient(app, raise_server_exceptions=False)
        clients.append(client)
        return client, c

    try:
        yield make
    finally:
        for client in clients:
            client.close()
        patch.undo()


def test_on_cpu_the_sleep_routes_answer_409_naming_the_platform(ingress_over):
    client, _ = ingress_over({"path": "/m", "device": "cpu"})
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        r = client.request(method, path)
        assert r.status_code == 409, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "sleep_unavailable" and "its replicas run on CPU (model.device: cpu)" in error["message"], error
        assert "CPU platform has no sleep mode" in error["message"]


def test_the_sleep_routes_answer_as_vllms_and_name_the_field_of_a_bad_parameter(ingress_over):
    client, c = ingress_over(GPU_MODEL)
    for path, field in (("/sleep?level=0", "level"), ("/sleep?level=3", "level"), ("/sleep?mode=later", "mode"), ("/wake_up?tags=scheduling", "tags"), ("/sleep?levle=1", "levle")):
        r = client.post(path)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
        assert r.json()["error"]["field"].split(".")[-1].split("[")[0] == field, (path, r.json())
    r = client.post("/sleep?level=2&mode=keep")
    assert r.status_code == 400 and r.json()["error"]["field"] == "mode" and "level 2 discards" in r.json()["error"]["message"]
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}

    assert client.post("/sleep?level=2").json() == {"status": "sleeping", "level": 2}
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    r = client.post("/start_weight_update")
    assert r.status_code == 409 and r.json()["error"]["type"] == "fleet_asleep" and "asleep at level 2" in r.json()["error"]["message"]
    r = client.post("/sleep?level=1")
    assert r.status_code == 409 and r.json()["error"]["type"] == "fleet_asleep"
    assert client.post("/wake_up?tags=weights").json() == {"status": "sleeping", "tags": ["weights"]}
    assert client.post("/wake_up?tags=kv_cache&tags=weights").json() == {"status": "awake", "tags": ["kv_cache", "weights"]}
    assert client.get("/is_sleeping").json() == {"is_sleeping": False} and c.membership.control == Control()


def test_the_schema_documents_the_sleep_routes_parameters():
    from rollout.http.ingress import app

    paths = app.openapi()["paths"]
    level = next(p for p in paths["/sleep"]["post"]["parameters"] if p["name"] == "level")["schema"]
    assert (level["minimum"], level["maximum"], level["default"]) == (1, 2, 1)
    tags = next(p for p in paths["/wake_up"]["post"]["parameters"] if p["name"] == "tags")
    assert "weights" in str(tags["schema"]) and "kv_cache" in str(tags["schema"])
    assert "409" in paths["/is_sleeping"]["get"]["responses"]


# ---- a replica's sync agent with the coordinator, in one process ----------------------------


async def test_an_agent_sleeps_with_the_fleet_and_after_level_2_reloads_the_committed_checkpoint_before_it_serves(model_dir):
    """The real coordinator and a replica's real agent (vLLM's engine recorded, as the agent
    tests record it): the agent applies the fleet's sleep from its polls, refuses requests
    while any tag sleeps, and when the weights wake after level 2 reloads the committed
    checkpoint (version 1, not the model it started from) before the KV cache wakes."""
    from rollout.config import SyncConfig
    from rollout.engine.sync_gate import SyncGate
    from rollout.errors import NotServingError
    from rollout.sync.agent import SyncAgent
    from rollout.sync.checkpoint import checkpoint_spec
    from tests.inprocess import InProcess, RecordingEngine

    sync = {"timeout_s": 5, "require_token": False, "poll_s": 0.05}
    c = WeightSyncCoordinator({"model": {**GPU_MODEL, "path": str(model_dir)}, "metrics": {"enabled": False}, "sync": sync}, "nccl")
    specs = checkpoint_spec(str(model_dir))
    await c.register("a", 1, 0, specs)  # played: it commits version 1, then goes away (dropped as silent)
    await commit(c, await c.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1, checkpoint="/shared/policy-v1")))
    engine = RecordingEngine()
    agent = SyncAgent(engine=engine, coordinator=InProcess(c), replica_id="b", ranks=1, model_path=str(model_dir), sync=SyncConfig(**sync))
    gate = SyncGate.over(agent, SyncConfig(**sync), "b")
    await agent.start()  # behind: reloads version 1 first
    reload_v1 = ("collective_rpc", "reload_weights", {"weights_path": "/shared/policy-v1"})
    try:
        assert agent.version == 1 and engine.calls.count(reload_v1) == 1
        engine.calls.clear()
        await asyncio.wait_for(c.drive(None, SleepFleet(2)), 5)
        assert engine.calls == [("sleep", 2, "abort")] and agent.sleep_level == 2
        with pytest.raises(NotServingError, match="replica b is asleep at level 2"):
            gate.raise_if_awaiting_publish()
        with pytest.raises(FleetAsleepError):
            await c.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1))

        assert await asyncio.wait_for(c.drive(None, WakeFleet(("weights",))), 5) is False
        woke = [call[0] for call in engine.calls[1:]]
        assert woke == ["wake_up", "pause_generation", "collective_rpc", "update_weight_version"], engine.calls
        assert engine.calls[1] == ("wake_up", ["weights"]) and engine.calls[3] == reload_v1 and engine.calls[4] == ("update_weight_version", "1")
        assert "resume_generation" not in woke, "the KV cache still sleeps: vLLM resumes its scheduler once it wakes"
        with pytest.raises(NotServingError, match="kv_cache asleep"):
            gate.raise_if_awaiting_publish()

        engine.calls.clear()
        assert await asyncio.wait_for(c.drive(None, WakeFleet()), 5) is True
        assert engine.calls == [("wake_up", ["kv_cache"])] and agent.version == 1 and agent.asleep is None and not agent.broken
        gate.raise_if_awaiting_publish()  # serving again
    finally:
        agent.stop()
