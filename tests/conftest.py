"""Shared fixtures: one Ray cluster, one Serve app and one reference engine per test session."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from rollout.engine.args import CPU_ENGINE_ENV
from rollout.local import ray_worker_environment
from tests.engines import KV_BYTES, MAX_MODEL_LEN, TEST_MODEL
from tests.hosts import SYNC_POLLING

# Test engines run eager (tests/engines.py); an engine a test starts on the platform's
# defaults (tests/test_cli_serve.py) compiles, and gets the replicas' environment for it
# (rollout.engine.args.prepare_engine_environment).
for _key, _value in CPU_ENGINE_ENV.items():
    os.environ.setdefault(_key, _value)
# Ray starts its workers (replicas, engines, reference engines) at nice 15. `make test`
# runs two lanes side by side on two cores: at 15 one lane's engines got a small share of
# a core the other lane's tests (nice 0) also wanted (weight 36 to 1024), so the shared
# lane, the longer, waited on the other's work. At 0 every process shares the cores evenly,
# as in the platform's own clusters (rollout.local.RAY_WORKER_ENV). (The Ray clusters
# started here inherit it; tests/hosts.py's set it for theirs.)
ray_worker_environment()
# vLLM's CPU engines bind their worker's OpenMP threads by default (VLLM_CPU_OMP_THREADS_BIND
# "auto"): one engine per host, one thread per core of the first NUMA node less one core kept
# for the scheduler. On the 2-core machine that is one thread pinned to core 0, for every
# engine of every lane: the replicas, the reference engines and `vllm serve` all computed on
# core 0 while core 1 ran the rest. Unbound with one thread each, as many as the binding gave
# (so greedy outputs stay those of one thread), the kernel spreads them over both cores.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's CPU platform runs an engine's worker in a process of its own ("mp" executor)
# unless VLLM_ENABLE_V1_MULTIPROCESSING is "0" (vllm/platforms/cpu.py): that process spawns
# and imports torch and vLLM once more, and `make test` starts ~40 engines. At "0" an
# AsyncLLM (replicas, `vllm serve`) runs its worker inside its engine-core process ("uni"),
# and a `vllm.LLM` (the reference engines) its whole engine in the caller. Measured on the
# 2-core machine, an AsyncLLM as a replica builds it, 3 starts each: 15.6 s and 15.5 CPU-s
# to ready against 21.4 s and 22.0 CPU-s, the same greedy tokens. A test-only setting, not
# the platform's: vLLM keeps the worker apart so that its executor can set up the worker's
# OpenMP threads (the binding above, "auto" in production, and their count) before torch
# starts; in the engine core that cannot be done and nothing does it. With no binding and
# one thread, as here, there is nothing to set up. (tests/test_engine_lifetime.py runs an
# engine in both modes.)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "build" / "model"
API_KEY = "test-key-0123456789"
SYNC_TOKEN = "sync-token-0123456789"
MAX_N = 8
MAX_BODY_BYTES = 1 << 20  # http.max_body_bytes of the session platform


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ok(url: str, timeout_s: float, poll_s: float, exited=lambda: False) -> bool:
    """GET ``url`` until it answers 200 (True), or until ``timeout_s`` pass or the server
    ``exited()`` (False): a server's readiness check, each try bounded to 2 s."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exited():
            return False
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


METRICS_PORT = free_port()

# End-to-end modules share one app and run in this order: later ones change its state
# (weights, replica count) that earlier ones assume.
E2E_ORDER = ["test_generation_e2e", "test_rollout_stream_e2e", "test_rewards_e2e", "test_episodes_e2e", "test_tools_e2e", "test_sandbox_e2e", "test_bad_input_e2e", "test_api_schema_e2e", "test_overload_e2e", "test_openai_e2e", "test_weight_sync_e2e", "test_vllm_routes_e2e", "test_metrics_e2e", "test_agent_env_e2e", "test_weight_delta_e2e", "test_lora_e2e", "test_scaling_e2e"]


def pytest_collection_modifyitems(config, items):
    def key(item):
        module = item.module.__name__.rsplit(".", 1)[-1]
        return (E2E_ORDER.index(module) + 1) if module in E2E_ORDER else 0

    items.sort(key=key)  # stable: unit tests first, in their own order


def pytest_collection_finish(session):
    # The Dockerfile's install resolve waits on the package index for about two minutes:
    # start it now, beside the tests that run before it.
    for item in session.items:
        if "image_install" in getattr(item, "fixturenames", ()):
            item.module.start_image_resolve()
            break


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from rollout.modelbuild import build_model, is_built

    if not is_built(MODEL_DIR):
        build_model(MODEL_DIR)
    return MODEL_DIR


# Serve's queue-length probe: its first deadline and its longest (Ray's settings).
PROBE_DEADLINES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2", "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5"}


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Serve replicas inherit the environment of the cluster started here.
    os.environ["ROLLOUT_SYNC_TOKEN"] = SYNC_TOKEN
    # Serve's router asks the replica it ranked first for its queue length and, with no
    # answer within 0.1 s (Serve's default), sends the call to the next one. Beside the
    # other lane on 2 cores a replica's answer can take longer, and tests that place
    # calls by session or prefix then saw all of them on one replica. They test where the
    # router sends calls, not how Serve treats a slow replica: a deadline a loaded machine meets.
    for name, seconds in PROBE_DEADLINES.items():
        os.environ.setdefault(name, seconds)
    ray.init(
        num_cpus=8,
        namespace="rollout-tests",
        log_to_driver=False,
        _metrics_export_port=METRICS_PORT,
        # Report metrics every second (default 10 s) so scrapes see test traffic quickly.
        _system_config={"metrics_report_interval_ms": 1000},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def reference(ray_cluster, model_dir):
    """The base model's reference. Started as soon as it is requested; its engine loads while
    the Serve app deploys."""
    from tests.reference import reference_engine

    return reference_engine(model_dir, MAX_MODEL_LEN, KV_BYTES)


@pytest.fixture(scope="session")
def policy_v2(model_dir, tmp_path_factory):
    """The policy of perturbation seed 2 and its checkpoint: published by the weight-sync
    and the RL-routes modules alike."""
    from tests.test_weight_sync_e2e import saved_policy

    return saved_policy(model_dir, tmp_path_factory, seed=2)


@pytest.fixture(scope="session")
def reference_v2(ray_cluster, policy_v2):
    """The reference on :func:`policy_v2`, for both modules (the session's one engine,
    tests/reference.py)."""
    from tests.test_weight_sync_e2e import reference_engine

    return reference_engine(policy_v2[1])


@pytest.fixture(scope="session")
def platform_config(model_dir, tmp_path_factory):
    from rollout.local import cpu_config

    key_file = tmp_path_factory.mktemp("secrets") / "api-key"
    key_file.write_text(API_KEY + "\n")
    return cpu_config(
        model_dir,
        model=TEST_MODEL,
        http={"port": free_port(), "api_key_file": str(key_file), "host": "127.0.0.1", "max_body_bytes": MAX_BODY_BYTES},
        metrics={"port": METRICS_PORT},
        limits={"max_n": MAX_N},
        # vLLM parses tool calls (named tool_choice included) only with auto tool choice on; the reference `vllm serve` gets the same.
        openai={"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
        # Short deadline so fault tests end quickly; and a replica that went away (killed,
        # or a test's ghost member) dropped after 6 s of silence, not the default 15 s.
        sync={"timeout_s": 10, "bucket_bytes": 1 << 16, **SYNC_POLLING},
        # Two reward functions every replica can import: one scores, one raises on most text.
        rewards={"functions": {"length": "builtins:len", "json": "json:loads"}},
        # A tool by import path with no arguments (a forced call is then fully determined),
        # and the python tool's limits small enough for tests to reach quickly. The wall
        # time is twenty times the CPU time: a busy loop given a twentieth of a core still
        # meets its CPU limit first (at 6 s and 2 s it once met the wall first under a load
        # of 6; at 10 s and 1 s once under a load of 13: two suite lanes, the image build and
        # other work on two cores). Only the busy loop reaches a time limit here.
        tools={"functions": {"python_version": "platform:python_version"}, "output_chars": 300, "python": {"wall_time_s": 20, "cpu_time_s": 1, "memory_mb": 256}},
    )


@pytest.fixture(scope="session")
def platform(ray_cluster, platform_config, reference):
    from ray import serve

    from rollout.app import deploy

    deploy(platform_config)
    yield platform_config
    serve.shutdown()


@pytest.fixture(scope="session")
def base_url(platform) -> str:
    return f"http://127.0.0.1:{platform.http.port}"


@pytest.fixture(scope="session")
def handle_client(platform):
    from rollout.client import RolloutClient

    c = RolloutClient.connect(app_name=platform.app_name)
    yield c
    c.close()


@pytest.fixture(scope="session")
def http_client(base_url):
    from rollout.client import RolloutClient

    c = RolloutClient.http(base_url, api_key=API_KEY)
    yield c
    c.close()


@pytest.fixture(params=["handle", "http"])
def any_client(request, handle_client, http_client):
    return handle_client if request.param == "handle" else http_client


async def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Poll an async predicate; return its last value once truthy, fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s (last value {value!r})")
        await asyncio.sleep(interval_s)
