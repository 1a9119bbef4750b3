"""A dead engine is the platform's typed retryable error on every path, and its death is
reported where the operator looks (issue 40): over a fake engine that dies as vLLM's did,
with the error reaching the request before vLLM marks the engine dead."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from rollout import wire_errors as wire
from rollout.api import RolloutRequest
from rollout.config import load_config
from rollout.engine import deaths
from rollout.engine.adapter import EngineAdapter
from rollout.engine.replica import RolloutEngine
from rollout.engine.stats import SchedulerSnapshot
from rollout.engine.sync_gate import SyncGate
from rollout.engine.validation import ModelLimits
from rollout.errors import EngineUnavailableError
from rollout.rewards import RewardScorer


class DyingEngine:
    """Dies under its first request: the request gets ``error`` (vLLM's dying engine handed
    an AttributeError to its requests), and only ``marked_after_s`` later does ``errored``
    say so, as vLLM's output handler and monitor thread mark it in their own time."""

    dead_error = "EngineCore encountered an issue. See stack trace (above) for the root cause."

    def __init__(self, error: BaseException, marked_after_s: float = 0.2, dies: bool = True):
        self.error = error
        self.marked_after_s = marked_after_s
        self.dies = dies
        self.died_at = None

    @property
    def errored(self) -> bool:
        return self.died_at is not None and time.monotonic() - self.died_at >= self.marked_after_s

    def _die(self) -> None:
        if self.dies and self.died_at is None:
            self.died_at = time.monotonic()
        raise self.error

    async def generate(self, prompt, params, request_id):
        await asyncio.sleep(0)
        self._die()
        yield  # an async generator, as vLLM's

    async def get_weight_version(self):
        if self.errored:
            raise RuntimeError("EngineDeadError")
        return "default"

    async def check_health(self):
        if self.errored:
            raise RuntimeError("EngineDeadError")

    def get_num_unfinished_requests(self) -> int:
        return 0

    def shutdown(self):
        pass


def replica(engine) -> RolloutEngine:
    r = object.__new__(RolloutEngine)  # the parts only: a fake engine behind them
    cfg = load_config({"model": {"path": "/models/x"}}, environ={})
    adapter = EngineAdapter(engine, None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), SchedulerSnapshot())
    r._assemble(cfg, "r1", adapter, SyncGate.over(None, cfg.sync, "r1"), RewardScorer.from_config(cfg.rewards))
    return r


def request() -> RolloutRequest:
    return RolloutRequest(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 3})


def answer(err: BaseException) -> tuple[int, str, bool]:
    a = wire.encode(err)
    return a.status, a.body["error"]["type"], wire.retryable(err)


@pytest.fixture
def recorded(monkeypatch):
    out = []
    monkeypatch.setattr(deaths, "record", lambda death: out.append(death) or True)
    return out


async def test_an_engine_that_dies_under_the_first_request_is_a_503_for_the_first_caller_too(recorded):
    # The first caller got 500 `internal error (AttributeError)`: the error came
    # before vLLM marked the engine dead, and passed as the platform's own fault.
    r = replica(DyingEngine(AttributeError("'NoneType' object has no attribute 'send_multipart'")))
    with pytest.raises(EngineUnavailableError) as exc:
        await r.generate([request()])
    assert answer(exc.value) == (503, "engine_unavailable", True)
    assert "engine is dead" in str(exc.value) and "AttributeError" in str(exc.value)
    # Later callers: the same answer, before any work.
    with pytest.raises(EngineUnavailableError):
        await r.generate([request()])
    (death,) = recorded  # once, however many paths saw it
    assert death.replica_id == "r1" and death.served == 0 and "on its first request" in death.line()


async def test_a_stream_and_an_episode_turn_and_stats_and_the_probe_of_a_dead_engine_are_typed(recorded):
    r = replica(DyingEngine(AttributeError("x")))
    stream = r.generate_stream(request())
    with pytest.raises(EngineUnavailableError):
        await stream.__anext__()
    for call in (r.stats, r.check_health, lambda: r._sample_in_episode(request(), None)):
        with pytest.raises(EngineUnavailableError) as exc:
            await call()
        assert answer(exc.value)[0] == 503
    assert len(recorded) == 1


async def test_the_engine_dead_after_the_error_is_waited_for_but_an_error_of_a_live_engine_stays_its_own(recorded, monkeypatch):
    import rollout.engine.adapter as adapter_module

    monkeypatch.setattr(adapter_module, "DEATH_GRACE_S", 0.3)
    r = replica(DyingEngine(RuntimeError("one request failed"), dies=False))
    with pytest.raises(RuntimeError, match="one request failed"):
        await r.generate([request()])
    assert recorded == []
    # Marked dead later than the grace: not its death (then the next call is refused typed).
    r = replica(DyingEngine(RuntimeError("late"), marked_after_s=0.6))
    with pytest.raises(RuntimeError, match="late"):
        await r.generate([request()])
    await asyncio.sleep(0.7)
    with pytest.raises(EngineUnavailableError):
        await r.generate([request()])


def death(at: float, replica_id: str, served: int = 0) -> deaths.EngineDeath:
    return deaths.EngineDeath(app="rollout", replica_id=replica_id, reason="vLLM process 7: Fatal Python error: Illegal instruction", at=at, uptime_s=9, served=served)


def test_three_deaths_within_ten_minutes_are_a_crash_loop_named_with_the_last_error():
    now = 10_000.0
    assert deaths.crash_loop([death(now - 700, "a"), death(now - 30, "b"), death(now - 10, "c")], now) is None
    loop = deaths.crash_loop([death(now - 300, "a"), death(now - 30, "b", served=4), death(now - 10, "c")], now)
    assert loop is not None and "died 3 times" in loop and "2 on their first request" in loop
    assert "replica c" in loop and "Illegal instruction" in loop


def test_rollout_serve_prints_each_engine_death_once_and_the_crash_loop(monkeypatch):
    from rollout.cli import DeathWatch

    record: list[deaths.EngineDeath] = []
    monkeypatch.setattr(deaths, "read", lambda app: list(record))
    out = io.StringIO()
    watch = DeathWatch("rollout", period_s=0, out=out)
    now = time.time()
    for i in range(3):
        record.append(death(now - 30 + i, f"r{i}"))
        watch.poll()
        watch.poll()
    lines = out.getvalue().splitlines()
    assert [line.split("replica ")[1].split()[0] for line in lines if "the engine of replica" in line and "crash loop" not in line] == ["r0", "r1", "r2"]
    assert "3 engine deaths since start" in lines[-2]
    assert lines[-1].startswith("rollout serve: crash loop: ") and "Illegal instruction" in lines[-1]
    assert sum("crash loop" in line for line in lines) == 1


def test_a_fatal_signal_of_an_engine_process_is_in_the_replicas_death_reason(tmp_path, monkeypatch):
    from rollout.engine import lifetime

    monkeypatch.setenv(lifetime.FAULT_DIR_ENV, str(tmp_path))
    # A process as vLLM starts one (its plugin logs fatal signals), then killed as the CPU worker was.
    child = "from rollout.engine.lifetime import log_fatal_signals; import os, signal; log_fatal_signals(); os.kill(os.getpid(), signal.SIGILL)"
    proc = subprocess.run([sys.executable, "-c", child], env={**os.environ, lifetime.FAULT_DIR_ENV: str(tmp_path)}, timeout=60)
    assert proc.returncode == -signal.SIGILL
    (line,) = lifetime.fatal_errors()
    assert "Fatal Python error: Illegal instruction" in line and line.startswith("vLLM process ")
    engine = DyingEngine(AttributeError("x"))
    engine.died_at = time.monotonic() - 1
    adapter = EngineAdapter(engine, None, ModelLimits(vocab_size=100, max_model_len=64, max_n=4), SchedulerSnapshot())
    assert "Illegal instruction" in adapter.death_reason() and "See stack trace" in adapter.death_reason()


def test_eager_on_cpu_runs_unbound_and_a_binding_that_killed_it_is_refused_naming_the_field(monkeypatch, tmp_path):
    from rollout.engine.args import prepare_engine_environment
    from rollout.engine.lifetime import FAULT_DIR_ENV
    from rollout.engine.memory import EngineStartError

    # What it sets in this process's environment is undone after (clusters started later inherit it).
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")

    eager = load_config({"model": {"path": "/models/x", "enforce_eager": True}}, environ={}).model
    compiled = load_config({"model": {"path": "/models/x"}}, environ={}).model
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    prepare_engine_environment("cpu", compiled)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # compiled: vLLM's own binding
    prepare_engine_environment("cpu", eager)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    with pytest.raises(EngineStartError) as exc:
        prepare_engine_environment("cpu", eager)
    assert exc.value.field == "model.enforce_eager" and "SIGILL" in str(exc.value)


async def test_the_health_check_reports_engine_deaths_and_a_crash_loop_and_rollout_status_shows_them(monkeypatch):
    import httpx

    from rollout import status
    from rollout.http.ingress import HttpIngress

    now = time.time()
    died = [death(now - 60, "a"), death(now - 30, "b"), death(now - 5, "c")]

    class Engine:
        alive = True

        async def stats(self):
            if not self.alive:
                raise EngineUnavailableError("engine is dead")

    ingress = SimpleNamespace(engine=Engine(), _engine_deaths=lambda: died)
    healthz = getattr(HttpIngress.healthz, "__wrapped__", HttpIngress.healthz)
    body = await healthz(ingress)
    assert body["status"] == "ok" and body["engine_deaths"]["count"] == 3 and "replica c" in body["engine_deaths"]["last"]
    assert "crash loop" in body["crash_loop"] and "Illegal instruction" in body["crash_loop"]
    ingress.engine.alive = False
    with pytest.raises(EngineUnavailableError, match="no healthy engine replica.*crash loop"):
        await healthz(ingress)
    ingress.engine.alive, ingress._engine_deaths = True, lambda: []
    assert await healthz(ingress) == {"status": "ok"}

    monkeypatch.setattr(status.httpx, "get", lambda url, timeout: httpx.Response(200, json={"status": "ok", **body}))
    shown = status.engine_health("http://platform:8000")
    assert "engine deaths             3; last: the engine of replica c" in shown and "CRASH LOOP" in shown
    monkeypatch.setattr(status.httpx, "get", lambda url, timeout: httpx.Response(200, json={"status": "ok"}))
    assert status.engine_health("http://platform:8000") == ""


# A real engine (tests/engines.py's settings, the executor tests/conftest.py picks) whose
# engine core is killed by SIGILL under a request, as vLLM's CPU worker was.
REAL_DEATH = """
import asyncio, os, signal, sys
import psutil
from rollout.api import RolloutRequest
from rollout.engine.adapter import EngineAdapter
from rollout.engine.startup import StartPhases
from rollout.engine.stats import SchedulerSnapshot
from rollout.errors import EngineUnavailableError
from rollout.local import cpu_config
from tests.engines import TEST_MODEL

async def main():
    adapter = EngineAdapter.start(cpu_config(sys.argv[1], model=TEST_MODEL), "cpu", None, SchedulerSnapshot(), [], StartPhases("death"))
    req = RolloutRequest(prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 500, "ignore_eos": True}).with_id()
    task = asyncio.create_task(adapter.generate(req, [5, 6, 7]))
    await asyncio.sleep(0.5)
    (core,) = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::EngineCore")]
    os.kill(core.pid, signal.SIGILL)
    try:
        await task
        print("RESULT not raised", flush=True)
    except EngineUnavailableError as e:
        print("RESULT typed", adapter.dead(), e, flush=True)
    except BaseException as e:
        print("RESULT raw", type(e).__name__, e, flush=True)
    os._exit(0)

asyncio.run(main())
"""


def test_a_real_engine_killed_by_sigill_under_a_request_is_the_typed_error_naming_the_signal(model_dir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "platform"), os.environ.get("PYTHONPATH", "")])}
    env.pop("ROLLOUT_ENGINE_FAULT_DIR", None)  # the engine's own, as a replica makes it
    proc = subprocess.run([sys.executable, "-c", REAL_DEATH, str(model_dir)], capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert result[0].startswith("RESULT typed True engine is dead"), result[0]
    assert "killed by SIGILL" in result[0] and "Fatal Python error: Illegal instruction" in result[0], result[0]
