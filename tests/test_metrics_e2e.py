"""Metrics end to end: a real Prometheus (Debian's package, loopback only) scraping the
real platform through Ray's metrics agent. Runs after the weight-sync module."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time

import pytest

from rollout.api import RolloutRequest, SamplingConfig
from rollout.episodes import replica_of
from rollout.monitoring import RULES_PATHS, all_queries
from rollout.sync import WeightPublisher
from tests.conftest import METRICS_PORT, SYNC_TOKEN, free_port
from tests.prometheus_server import PrometheusServer
from tests.test_tools_e2e import call as forced_call
from tests.test_weight_sync_e2e import perturbed_policy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prometheus(platform, tmp_path_factory):
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), METRICS_PORT, free_port(), [RULES_PATHS[0]])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def publisher(platform):
    return WeightPublisher.connect(app_name=platform.app_name, token=SYNC_TOKEN)


async def settled(prom: PrometheusServer, expr: str, seconds: float | None = None, timeout_s: float = 90.0) -> float:
    """The value of ``expr`` once it has stopped changing for ``seconds`` (two scrapes unless
    told)."""
    seconds = max(seconds or 0.0, prom.settle_s)
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(prom.value, expr)
        value = 0.0 if math.isnan(value) else value
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"{expr} did not settle (last {last}); targets: {await asyncio.to_thread(prom.targets)}")


async def until(prom: PrometheusServer, expr: str, predicate, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        result = await asyncio.to_thread(prom.query, expr)
        if result and predicate(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{expr}: {result}; targets: {await asyncio.to_thread(prom.targets)}")
        await asyncio.sleep(0.5)


GENERATED = "sum(ray_rollout_generated_tokens_total)"


async def test_token_counters_match_the_tokens_the_client_received(prometheus, handle_client, http_client):
    # The counter exists once a replica served a request (run alone, this test is the first).
    await handle_client.generate([RolloutRequest(prompt="first", sampling=SamplingConfig(max_tokens=2))])
    await until(prometheus, GENERATED, lambda r: True)  # scraped at least once
    before = await settled(prometheus, GENERATED)
    reqs = [RolloutRequest(prompt=f"step {i} of the policy", n=2, sampling=SamplingConfig(max_tokens=8 + i, temperature=1.0)) for i in range(12)]
    results = await handle_client.generate(reqs) + await http_client.generate(reqs[:5])
    received = sum(len(s.token_ids) for r in results for s in r.samples)
    await until(prometheus, GENERATED, lambda r: float(r[0]["value"][1]) >= before + received)
    assert await settled(prometheus, GENERATED) == before + received


async def test_vllm_metrics_come_through_ray_less_the_per_token_histogram(prometheus, handle_client):
    from rollout.metrics import VLLM_METRICS_LEFT_OUT

    await handle_client.generate([RolloutRequest(prompt="per request, not per token", sampling=SamplingConfig(max_tokens=6))])
    # The same latency per finished request is exported; the per-token histogram is not.
    await until(prometheus, "sum(ray_vllm_request_time_per_output_token_seconds_count)", lambda r: float(r[0]["value"][1]) > 0)
    await until(prometheus, "sum(ray_vllm_generation_tokens_total)", lambda r: float(r[0]["value"][1]) > 0)
    for name in VLLM_METRICS_LEFT_OUT:
        expr = "ray_" + name.replace(":", "_") + "_count"
        assert await asyncio.to_thread(prometheus.query, expr) == [], f"{expr} is exported"


async def test_kv_cache_usage_is_a_fraction_for_every_replica(prometheus, handle_client):
    await handle_client.generate([RolloutRequest(prompt="kv", sampling=SamplingConfig(max_tokens=4))])
    for expr in ("ray_rollout_kv_cache_usage", "ray_vllm_kv_cache_usage_perc"):
        series = await until(prometheus, expr, lambda r: len(r) >= 1)
        assert all(0.0 <= float(s["value"][1]) <= 1.0 for s in series), series


async def test_a_publish_shows_the_committed_version_and_a_sync_duration_sample(prometheus, publisher, model_dir):
    count_before = await settled(prometheus, "sum(ray_rollout_weight_sync_duration_seconds_count)")
    version = await asyncio.to_thread(publisher.publish, perturbed_policy(model_dir, seed=7).named_parameters())
    await until(prometheus, "max(ray_rollout_committed_weight_version)", lambda r: float(r[0]["value"][1]) == version)
    await until(prometheus, "sum(ray_rollout_weight_sync_duration_seconds_count)", lambda r: float(r[0]["value"][1]) > count_before)
    await until(prometheus, "max(ray_rollout_weight_version_lag)", lambda r: float(r[0]["value"][1]) == 0)
    series = await until(prometheus, "ray_rollout_replica_weight_version", lambda r: all(float(s["value"][1]) == version for s in r))
    assert series


async def test_every_dashboard_and_alert_expression_returns_data(prometheus, publisher, handle_client, model_dir, platform):
    from rollout.contracts.net import free_port as _free_port, own_address as _own_address
    from rollout.contracts.sync_protocol import ParamSpec, RoundRequest

    # Traffic for the rate() windows, and one failed round for the failure counter.
    await handle_client.generate([RolloutRequest(prompt="the policy model", n=4, sampling=SamplingConfig(max_tokens=16)) for _ in range(8)])
    coord = publisher._coordinator
    model = perturbed_policy(model_dir, seed=8)
    plan = await asyncio.to_thread(coord.begin_round, SYNC_TOKEN, RoundRequest(tuple([ParamSpec.of(n, p) for n, p in model.named_parameters()]), _own_address(), _free_port()))
    await asyncio.to_thread(coord.finish, SYNC_TOKEN, plan.round_id, "trainer gave up")
    await handle_client.generate([RolloutRequest(prompt="after the failed round", sampling=SamplingConfig(max_tokens=8))])
    # Tool calls, for the tool panels (forced: the random model calls none by itself). A
    # counter's series starts at its first increment, and rate() needs an increase between
    # two scrapes: so one call, its series seen, then another on the same replica.
    episode = await handle_client.start_episode([{"role": "user", "content": "6*7?"}], tools=["calculator"])
    replica = replica_of(episode.episode_id)
    (call,) = (await episode.turn(sampling=forced_call("calculator", expression="6*7"))).tool_calls
    assert call.output == "42"
    await until(prometheus, f'ray_rollout_tool_call_seconds_count{{replica="{replica}",tool="calculator"}}', lambda r: float(r[0]["value"][1]) >= 1)
    (call,) = (await episode.turn(sampling=forced_call("calculator", expression="6*8"))).tool_calls
    assert call.output == "48"
    await episode.end()
    missing = []
    for where, expr in all_queries():
        try:
            result = await until(prometheus, expr, lambda r: all(not math.isnan(float(s["value"][1])) for s in r), timeout_s=60)
        except AssertionError as e:
            missing.append(f"{where}: {expr} -> {e}")
            continue
        assert result
    assert not missing, "\n".join(missing)


async def test_series_count_does_not_grow_with_request_ids_and_prompts(prometheus, handle_client):
    expr = 'count({__name__=~"ray_rollout_.*|ray_vllm_.*"})'
    selector = '{__name__=~"ray_rollout_.*|ray_vllm_.*"}'
    size = 60

    def batch(tag: str):
        # ignore_eos: every request ends the same way, so no finish reason shows up first here.
        sampling = SamplingConfig(max_tokens=2, ignore_eos=True)
        return [
            RolloutRequest(prompt=f"unique prompt {tag} {i * 7919}", request_id=f"{tag}-{i}-{time.time_ns()}", session_id=f"{tag}-session-{i}", sampling=sampling)
            for i in range(size)
        ]

    async def series_set() -> set[frozenset]:
        return {frozenset(s["metric"].items()) for s in await asyncio.to_thread(prometheus.query, selector)}

    # The first batches create every series this kind of traffic touches (on every replica:
    # one that joined lately may still be creating its own, and series of earlier tests
    # may still be arriving); then a batch of new ids, sessions and prompts.
    for warm_up in ("a1", "a2", "b"):
        await handle_client.generate(batch(warm_up))
        await settled(prometheus, GENERATED)
    await settled(prometheus, expr, seconds=8.0)
    before = await series_set()
    await handle_client.generate(batch("c"))
    await settled(prometheus, GENERATED)
    await settled(prometheus, expr, seconds=8.0)
    new = (await series_set()) - before
    # A label holding an id, a session or a prompt adds a series per request of the batch to
    # every metric that carries it; a series of a bounded label seen for the first time (or
    # one of an earlier test arriving late) adds a few, and names no request.
    marks = ("c-session", "unique prompt", "c-0-", "b-0-")
    leaked = [dict(s) for s in new if any(mark in str(v) for _, v in s for mark in marks)]
    assert not leaked, leaked[:3]
    assert len(new) < size, sorted(dict(s).get("__name__", "") for s in new)[:20]
    # And no label anywhere holds a request id, a session or a prompt.
    # Read once a scrape has answered: a scrape slower than its 1 s interval (on 2 loaded
    # cores) fails, and Prometheus marks every series of the target stale until the next.
    series = await until(prometheus, selector, lambda result: True)
    leaked = [s["metric"] for s in series if any(mark in str(v) for v in s["metric"].values() for mark in marks)]
    assert series and not leaked, leaked[:3]


def test_rollout_status_prints_replicas_versions_and_throughput(platform, publisher):
    out = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "status", "--metrics-url", f"http://127.0.0.1:{METRICS_PORT}/metrics", "--interval", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    committed = publisher.status()["committed_version"]
    assert f"committed weight version  {committed}" in out.stdout
    assert "replicas" in out.stdout and "KV use" in out.stdout
