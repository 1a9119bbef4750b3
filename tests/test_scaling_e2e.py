"""Autoscaling and routing end to end: real Serve autoscaling on the engines' own load,
the affinity router, health-based replacement. Runs last: it removes the shared app to
give the machine's two cores to one app of its own, which each test reconfigures in
place (replica count, autoscaling and router are applied by Serve without restarting
replicas), in file order."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from ray import serve

from rollout.api import RolloutRequest, SamplingConfig
from rollout.app import deploy
from rollout.bench.scaling import group_prompts, grouped_workload
from rollout.client import RolloutClient
from rollout.config import PlatformConfig
from rollout.local import cpu_config
from rollout.sync import WeightPublisher
from tests.conftest import METRICS_PORT, SYNC_TOKEN, wait_until
from tests.engines import TEST_MODEL
from tests.test_weight_sync_e2e import perturbed_policy

pytestmark = pytest.mark.e2e

ENGINE = "RolloutEngine"
APP = "rollout-scaling"
ELASTIC = {"min_replicas": 0, "max_replicas": 2, "target_ongoing_requests": 8, "look_back_period_s": 2, "upscale_delay_s": 2, "downscale_delay_s": 10}


def replica_count(app: str = APP) -> int:
    status = serve.status().applications.get(app)
    if status is None or ENGINE not in status.deployments:
        return 0
    return status.deployments[ENGINE].replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def scaling_app(platform, model_dir):
    """Replaces the shared app with this module's app; yields a function that
    (re)deploys it with other deployment settings and returns the config."""
    serve.delete(platform.app_name)
    base = cpu_config(
        model_dir,
        app_name=APP,
        model=TEST_MODEL,
        # Serve runs one HTTP proxy per cluster: this app shares the shared app's port.
        http={"port": platform.http.port, "host": "127.0.0.1"},
        metrics={"port": METRICS_PORT},
        sync={"timeout_s": 10},
        deployment={"health_check_period_s": 2, "health_check_timeout_s": 10, "stuck_timeout_s": 5},
    )

    def redeploy(**deployment) -> PlatformConfig:
        data = base.model_dump(mode="json")
        data["deployment"].update(deployment)
        cfg = PlatformConfig.model_validate(data)
        deploy(cfg)
        return cfg

    yield redeploy
    serve.delete(APP)


def long_request(tokens: int = 200, **kw) -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=[11, 12, 13, 14], sampling=SamplingConfig(max_tokens=tokens, ignore_eos=True), **kw)


async def test_a_burst_scales_out_new_replicas_hold_the_newest_version_and_the_count_returns_to_the_minimum(scaling_app, model_dir):
    cfg = await asyncio.to_thread(scaling_app, autoscaling=ELASTIC)
    client = RolloutClient.connect(app_name=cfg.app_name, batch_size=8)
    publisher = WeightPublisher.connect(app_name=cfg.app_name, token=SYNC_TOKEN)
    version = await asyncio.to_thread(publisher.publish, perturbed_policy(model_dir, seed=11).named_parameters())
    assert replica_count(cfg.app_name) == 1
    stop = asyncio.Event()
    versions_seen: set[int] = set()

    async def burst():
        while not stop.is_set():
            results = await client.generate([long_request() for _ in range(48)])
            versions_seen.update(sp.version for r in results for s in r.samples for sp in s.weight_versions)

    task = asyncio.create_task(burst())
    t0 = time.monotonic()

    async def two_replicas_serving():
        status = await asyncio.to_thread(publisher.status)
        return replica_count(cfg.app_name) == 2 and len(status["replicas"]) == 2

    await wait_until(two_replicas_serving, timeout_s=240, interval_s=1)
    scale_out_s = time.monotonic() - t0
    status = await asyncio.to_thread(publisher.status)
    assert all(r["version"] == version for r in status["replicas"].values()), status
    await asyncio.sleep(5)  # let the new replica take part of the burst
    stop.set()
    await task
    assert versions_seen == {version}, "every token came from the committed version"

    # Burst over: back to the minimum (zero) after the downscale delay...
    await wait_until(lambda: asyncio.to_thread(lambda: replica_count(cfg.app_name) == 0), timeout_s=180, interval_s=1)
    # ...and the first request after zero waits for a replica instead of failing,
    # which catches up to the committed version before serving it.
    (res,) = await asyncio.wait_for(client.generate([long_request(8)]), timeout=300)
    assert [sp.version for sp in res.samples[0].weight_versions] == [version]
    print(f"scale-out took {scale_out_s:.0f}s")


async def test_a_steady_load_keeps_a_steady_replica_count(scaling_app):
    # New bounds on the running app: Serve applies them without restarting the replica.
    cfg = await asyncio.to_thread(
        scaling_app,
        autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8, "look_back_period_s": 2, "upscale_delay_s": 2, "downscale_delay_s": 4},
    )
    await wait_until(lambda: asyncio.to_thread(replica_count), timeout_s=240, interval_s=1)
    client = RolloutClient.connect(app_name=cfg.app_name, batch_size=8)
    stop = asyncio.Event()

    async def steady():
        while not stop.is_set():
            await client.generate([long_request(64) for _ in range(6)])  # below the target of 8

    task = asyncio.create_task(steady())
    counts = []
    for _ in range(16):  # eight look-back windows
        await asyncio.sleep(1)
        counts.append(replica_count(cfg.app_name))
    stop.set()
    await task
    assert set(counts) == {1}, counts


async def test_prefix_affinity_gets_a_clearly_higher_hit_rate_than_the_default_router(scaling_app):
    # The same two replicas, first behind Serve's default router, then behind ours.
    rates = {}
    for seed, policy in enumerate(("default", "affinity")):
        cfg = await asyncio.to_thread(scaling_app, autoscaling=None, replicas=2, routing={"policy": policy})
        await wait_until(lambda: asyncio.to_thread(lambda: replica_count() == 2), timeout_s=240, interval_s=1)
        # Through the HTTP ingress, which a router change restarts: a handle in this
        # process would keep the router it was created with (Serve caches handles).
        client = RolloutClient.http(f"http://127.0.0.1:{cfg.http.port}")
        result = await grouped_workload(client, APP, f"http://127.0.0.1:{METRICS_PORT}/metrics", group_prompts(12, seed), calls=4, n=1, max_tokens=4)
        client.close()
        rates[policy] = result["follow_up_prefix_cache_hit_rate"]
    print(f"prefix-cache hit rate: {rates}")
    assert rates["affinity"] > rates["default"] + 0.1, rates


async def test_turns_of_a_session_stay_on_one_replica(scaling_app):
    await asyncio.to_thread(scaling_app, autoscaling=None, replicas=2)  # affinity: the default policy
    client = RolloutClient.connect(app_name=APP)
    placement: dict[str, set[str]] = {}
    for turn in range(4):
        results = await asyncio.gather(
            *(client.generate([RolloutRequest(prompt=f"turn {turn} of episode {s}", session_id=f"episode-{s}", sampling=SamplingConfig(max_tokens=4))]) for s in range(16))
        )
        for s, (r,) in enumerate(results):
            placement.setdefault(f"episode-{s}", set()).add(r.replica_id)
    assert all(len(replicas) == 1 for replicas in placement.values()), placement
    assert len(set().union(*placement.values())) == 2, "sessions spread over both replicas"


def _cluster() -> str:
    """This session's cluster, named: the state API otherwise looks for the one Ray
    instance on the machine, and a cluster of another test beside this one (`rollout
    serve`'s own) makes that fail with "Found multiple active Ray instances"."""
    import ray

    return ray.get_runtime_context().gcs_address


def _engine_processes_of(replica_id: str) -> list[psutil.Process]:
    """The replica's child processes: vLLM's engine core and its workers. (All of them: a
    child's title, "VLLM::EngineCore", is not always visible by the time it is asked.)"""
    from ray.util.state import list_actors

    (actor,) = [a for a in list_actors(address=_cluster(), filters=[("state", "=", "ALIVE")], limit=1000) if a.name and a.name.endswith(f"#{replica_id}")]
    children = psutil.Process(actor.pid).children(recursive=True)
    assert children, f"replica {replica_id} (pid {actor.pid}) has no engine processes"
    return children


async def test_a_stuck_replica_is_removed_from_routing_and_replaced(scaling_app):
    await asyncio.to_thread(scaling_app, autoscaling=None, replicas=2)
    client = RolloutClient.connect(app_name=APP)
    results = await asyncio.gather(*(client.generate([RolloutRequest(prompt=f"probe {i}", session_id=f"s{i}", sampling=SamplingConfig(max_tokens=2))]) for i in range(8)))
    victim = sorted({r.replica_id for (r,) in results})[0]
    engine = await asyncio.to_thread(_engine_processes_of, victim)
    for p in engine:
        os.kill(p.pid, signal.SIGSTOP)  # the engine hangs; its processes stay alive
    try:
        # Requests in flight on the victim make it "stuck" (no engine step for stuck_timeout_s).
        inflight = [asyncio.create_task(client.generate([long_request(50, session_id=f"s{i}")])) for i in range(8)]

        async def replaced():
            status = serve.status().applications[APP].deployments[ENGINE]
            return status.replica_states.get("RUNNING", 0) == 2 and victim not in await asyncio.to_thread(_replica_ids, APP)

        await wait_until(replaced, timeout_s=300, interval_s=1)
        for t in inflight:
            t.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)
    finally:
        for p in engine:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    after = await asyncio.gather(*(client.generate([RolloutRequest(prompt=f"after {i}", session_id=f"s{i}", sampling=SamplingConfig(max_tokens=2))]) for i in range(16)))
    assert victim not in {r.replica_id for (r,) in after}


def _replica_ids(app: str) -> set[str]:
    from ray.util.state import list_actors

    prefix = f"SERVE_REPLICA::{app}#{ENGINE}#"
    return {a.name.split("#")[-1] for a in list_actors(address=_cluster(), filters=[("state", "=", "ALIVE")], limit=1000) if a.name and a.name.startswith(prefix)}
