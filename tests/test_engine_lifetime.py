"""An engine core dies with the process that built it (rollout.engine.lifetime, loaded by
vLLM as a general plugin): a real AsyncLLM in a child process, which is then killed hard,
as `ray stop --force` or the OOM killer would kill a replica. In both of vLLM's CPU executor
modes: the worker in a process of its own ("mp", vLLM's default and production's) and in
the engine core ("uni", what tests/conftest.py sets for the test suite)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.engines import ENFORCE_EAGER

BUILD = """
import asyncio, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from rollout.engine.args import engine_kwargs
from rollout.local import cpu_config

cfg = cpu_config(sys.argv[1], model={"max_model_len": 256, "kv_cache_memory_bytes": 64 << 20, "enforce_eager": sys.argv[2] == "True"})

async def main():
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(cfg.model, "cpu")))
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


# VLLM_ENABLE_V1_MULTIPROCESSING: the engine's processes (by title, which psutil reads from
# the command line that vLLM's setproctitle writes).
MODES = {
    "mp": ("1", {"VLLM::EngineCore", "VLLM::Worker"}),
    "uni": ("0", {"VLLM::EngineCore"}),
}


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_core_and_its_workers_die_with_the_process_that_built_them(model_dir, mode):
    multiprocessing, titles = MODES[mode]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    proc = subprocess.Popen([sys.executable, "-c", BUILD, str(model_dir), str(ENFORCE_EAGER)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, env=env)
    engine_procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while proc.stdout.readline().strip() != "ready":
            assert proc.poll() is None and time.monotonic() < deadline, "the engine did not start"
        engine_procs = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("VLLM::")]
        assert engine_procs, "the engine core runs in a process of its own"
        assert {p.name().split("_")[0] for p in engine_procs} == titles, f"{mode}: {[(p.pid, p.name()) for p in engine_procs]}"
        proc.kill()  # SIGKILL: nothing in the builder runs, no shutdown is sent
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(engine_procs, timeout=20)
        assert alive == [], f"engine processes outlived their parent: {[(p.pid, p.name()) for p in alive]}"
    finally:
        for p in engine_procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
