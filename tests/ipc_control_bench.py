"""A steady ``ipc`` publish's control plane on CPU (issue 41): no GPU, no Ray, no vLLM engine.

What runs for real: ``WeightPublisher.publish`` (its own thread, as a trainer), the
``WeightSyncCoordinator`` (an event loop in another thread, as Serve's user-code thread),
a ``SyncAgent`` (on that loop) and ``IpcSender`` with its CUDA calls replaced by stand-ins
(CPU tensors; 64-byte fake IPC handles of the shape torch's ``reduce_tensor`` returns).
Every call between the three is pickled and unpickled both ways (what Serve does), and its
message sizes are recorded. Not real: the Serve legs themselves (no network, no Ray), and the
engine core: a stand-in that answers each utility call after ``ONE_WAY_S`` there, its work in
arrival order (one at a time), and ``ONE_WAY_S`` back; ``update_weights`` works ``COPY_S``
(the H200's 1.7 ms copy), every other call ``SERVICE_S``.

    PYTHONPATH=platform:. python tests/ipc_control_bench.py [rounds] [params] [wait]

Runs against any tree (the issue-41 commit and the one before it), so the two compare.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ONE_WAY_S = 0.0004
SERVICE_S = 0.0001
COPY_S = 0.0017


class FifoEngine:
    """vLLM's AsyncLLM as far as the agent calls it, with an engine core that runs utility
    calls in arrival order: each call's message takes ONE_WAY_S to arrive, its work runs after
    the calls before it, and its answer takes ONE_WAY_S back."""

    def __init__(self) -> None:
        self.calls: list[str] = []  # in the order the engine core ran them
        self.update_infos: list[dict] = []
        self._core = asyncio.Lock()

    async def _utility(self, name: str, work_s: float) -> None:
        arrival = asyncio.get_running_loop().time() + ONE_WAY_S
        ticket = asyncio.ensure_future(self._run(name, arrival, work_s))
        await ticket
        await asyncio.sleep(ONE_WAY_S)

    async def _run(self, name: str, arrival: float, work_s: float) -> None:
        await self._core.acquire()  # FIFO: calls queue in the order they were sent
        try:
            wait = arrival - asyncio.get_running_loop().time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.calls.append(name)
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:  # the engine core's own work
                await asyncio.sleep(0)
        finally:
            self._core.release()

    async def get_weight_version(self):
        return "0"

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            if name == "update_weights":
                self.update_infos.append(args[0].update_info)
            await self._utility(name, COPY_S if name == "update_weights" else SERVICE_S)

        return call


SIZES: dict[str, list[int]] = {}


def _wire(what: str, obj):
    data = pickle.dumps(obj)
    SIZES.setdefault(what, []).append(len(data))
    return pickle.loads(data)


class PicklingLink:
    """A Serve handle in-process: every argument and answer pickled both ways."""

    def __init__(self, coordinator, loop=None) -> None:
        self.coordinator, self.loop = coordinator, loop

    def __getattr__(self, name):
        method = getattr(self.coordinator, name)

        async def remote(*args):
            return _wire(f"{name}.answer", await method(*_wire(f"{name}.call", args)))

        return type("Method", (), {"remote": staticmethod(remote)})


class PublisherLink:
    """The publisher's CoordinatorClient: calls into the coordinator's loop from its thread."""

    host = "127.0.0.1"

    def __init__(self, coordinator, loop) -> None:
        self.coordinator, self.loop = coordinator, loop

    def _call(self, name, *args):
        async def run():
            return _wire(f"{name}.answer", await getattr(self.coordinator, name)(*_wire(f"{name}.call", args)))

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(60)

    def begin_round(self, token, request):
        return self._call("begin_round", token, request)

    def finish(self, token, round_id, error, timeout_s=None, digests=None, wait=None):
        return self._call("finish", token, round_id, error, digests, *([wait] if wait else []))

    def status(self, timeout_s=None):
        return self._call("status")


def no_cuda(setattr=setattr) -> None:
    """IpcSender's CUDA calls replaced (``setattr``: a test's monkeypatch.setattr)."""
    import torch.multiprocessing.reductions as reductions

    from rollout.sync.backends import ipc

    setattr(ipc, "sending_device", lambda tensors, name: torch.device("cpu"))
    setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-00000000-0000-0000-0000-000000000000"))
    setattr(torch.cuda, "synchronize", lambda device=None: None)
    # rebuild_cuda_tensor's arguments with 64-byte handles, as torch's reduce_tensor gives them.
    setattr(reductions, "reduce_tensor", lambda t: (None, (type(t), tuple(t.shape), t.stride(), 0, None, t.dtype, 0, b"h" * 64, 1 << 20, 0, b"r" * 64, 0, b"e" * 64, True)))


def write_model(path: Path, params: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors = {f"model.layers.{i // 12}.p{i % 12}.weight": torch.zeros(8, 8) for i in range(params)}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return tensors


def stage(workdir: Path, loop: asyncio.AbstractEventLoop, timeout_s: float):
    """A coordinator (ipc) and replica "a" (a :class:`FifoEngine`) started on ``loop`` (as
    Serve's user-code thread runs them), and a publisher calling them from the caller's
    thread; every call pickled both ways. Returns (coordinator, engine, agent, publisher)."""
    from rollout.sync.agent import SyncAgent
    from rollout.sync.coordinator import WeightSyncCoordinator
    from rollout.sync.publisher import WeightPublisher

    import vllm.distributed.weight_transfer.base  # noqa: F401 - the agent's first round imports it: seconds on a loaded box, not in the round

    async def setup():
        coordinator = WeightSyncCoordinator({"model": {"path": str(workdir)}, "metrics": {"enabled": False}, "sync": {"timeout_s": timeout_s, "require_token": False}}, "ipc")
        engine = FifoEngine()
        agent = SyncAgent(engine=engine, coordinator=PicklingLink(coordinator), replica_id="a", ranks=1, model_path=str(workdir))
        await agent.start()
        return coordinator, engine, agent

    coordinator, engine, agent = asyncio.run_coroutine_threadsafe(setup(), loop).result(60)
    return coordinator, engine, agent, WeightPublisher(PublisherLink(coordinator, loop), "ipc", None)


def run(rounds: int, params: int, wait: str = "") -> dict:
    """``wait``: publish's ``wait`` where given (trees before issue 41 have none)."""
    no_cuda()
    workdir = Path(tempfile.mkdtemp())
    tensors = write_model(workdir, params)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    coordinator, engine, agent, publisher = stage(workdir, loop, timeout_s=30)
    seconds, phases = [], []
    for _ in range(rounds):
        SIZES.clear()
        t0 = time.perf_counter()
        publisher.publish(tensors, **({"wait": wait} if wait else {}))
        seconds.append(time.perf_counter() - t0)
        phases.append({"trainer": dict(publisher.last_phases), "replica": dict(publisher.last_outcome.phases.get("a", {}))})
    steady = seconds[1:]
    calls_per_round = engine.calls[-(len(engine.calls) // rounds) :]
    agent.stop()
    return {
        "wait": wait or "serving",
        "params": params,
        "rounds": rounds,
        "model": {"one_way_s": ONE_WAY_S, "service_s": SERVICE_S, "copy_s": COPY_S},
        "steady_median_ms": round(statistics.median(steady) * 1000, 2),
        "steady_ms": [round(s * 1000, 2) for s in steady],
        "first_ms": round(seconds[0] * 1000, 2),
        "last_round_bytes": {k: max(v) for k, v in SIZES.items()},
        "last_round_engine_calls": calls_per_round,
        "last_phases_ms": {side: {k: round(v * 1000, 2) for k, v in ph.items()} for side, ph in phases[-1].items()},
    }


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    p = int(sys.argv[2]) if len(sys.argv) > 2 else 339
    print(json.dumps(run(n, p, sys.argv[3] if len(sys.argv) > 3 else ""), indent=1))
