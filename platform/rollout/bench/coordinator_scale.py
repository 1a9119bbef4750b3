"""The weight-sync coordinator at 10, 100 and 1,000 replicas, by simulation.

A cluster of hundreds of replicas cannot run on this machine, but the coordinator's side
of it can. Per population:

* the **coordinator** is the real :class:`~rollout.sync.coordinator.WeightSyncCoordinator`
  (gloo: the backend that keeps a weight copy, so catch-up goes through it), alone in a
  process of its own as the Serve replica is, answering calls over a local socket. Every
  argument and answer is pickled both ways, as a Serve handle does (the coordinator pays
  for pickling what it sends). Only its weight copy's byte movers are stubbed
  (:class:`_NoBytesKeeper`): receiving, sending, joining a group.
* every **replica** is the real :class:`~rollout.sync.agent.SyncAgent` (register, the
  ``next_round`` long poll at the platform's ``sync.poll_s``, report, applied, restore/catch-up)
  over a stub engine (:class:`_StubEngine`: vLLM's calls return at once; no bytes) and a
  handle whose ``.method.remote(...)`` is that socket. The rendezvous probe (a TCP connect
  to the publisher) is skipped: no transfer group ever forms.
* the **publisher** is the real :class:`~rollout.sync.publisher.WeightPublisher` (its own
  thread, as a trainer is another process) with a stub sender (:class:`_NoBytesSender`):
  its ``send`` returns once every member's engine has been through ``update_weights``,
  the way a broadcast ends once every rank received, and ``send_copy`` sends nothing.

So a round's wall time here is coordination alone: the plan, its fan-out to every
member's long poll, the members' reports, the decision and every member's "applied".

Measured per round, at each population in turn (the populations take turns, the order
rotated every round, so drift of the machine hits all of them): the publish (the
publisher's open / send / commit steps), the coordinator process's CPU seconds and the
bytes it sent; after each commit 5% of the replicas restart (their engine back at the
initial weights, registering again) and catch up through restore rounds, timed until the
last one serves the committed version. Once per population: the coordinator's CPU while
idle (long polls alone), its peak memory growth, and a **stall**: 5% of the replicas stop
mid-round (after taking the plan they neither poll, report nor receive again, as a lost
host), timed until the round is decided, then until a round commits without them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import math
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from rollout.bench.machine import machine
from rollout.contracts.backend import CopyOffer, CopySender
from rollout.stats_summary import median_interval

POPULATIONS = (10, 100, 1000)
ROUNDS = 7
# sync.timeout_s of the simulated platform (the real default is 60): long enough that 1,000
# simulated replicas, all in this one process on a loaded 2-core machine, finish a round.
TIMEOUT_S = 30.0
LATE_SHARE = 0.05  # replicas restarting after each commit
STALL_SHARE = 0.05  # replicas stalling mid-round
PARAMS = 291  # tensors of the model: as many as Qwen2.5-0.5B (24 layers × 12, embeddings, norm, head)
GOAL_S = 1.0  # coordination per round at 1,000 replicas (issue 27)

logger = logging.getLogger(__name__)


# ---- the coordinator's process ------------------------------------------------------------


def _rss_kb() -> dict[str, int]:
    """The process's resident memory now and at its peak (kB)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


class _Rpc:
    """Frames of ``pickle``, length-prefixed, over one stream: ``(call_id, method, args)``
    out, ``(call_id, ok, result_or_exception)`` back."""

    @staticmethod
    def frame(obj: Any) -> bytes:
        data = pickle.dumps(obj, protocol=5)
        return len(data).to_bytes(4, "little") + data

    @staticmethod
    async def read(reader: asyncio.StreamReader) -> Any:
        n = int.from_bytes(await reader.readexactly(4), "little")
        return pickle.loads(await reader.readexactly(n))


def _coordinator_main(sock_path: str, timeout_s: float, poll_s: float, log_path: str, ready) -> None:
    """The coordinator process (spawned): the real coordinator, answering calls on ``sock_path``."""
    # Its log (INFO, as a Serve replica's) goes to a file: written, so paid for, but not
    # interleaved with the benchmark's output.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    asyncio.run(_serve(sock_path, timeout_s, poll_s, ready))


class _NoBytesKeeper:
    """The coordinator's weight copy with its byte movers stubbed; its bookkeeping (staged
    copies by round, the committed version) is the real :class:`WeightKeeper`'s."""

    @staticmethod
    def make(model_path: str):
        from rollout.sync.keeper import WeightKeeper

        class NoBytesKeeper(WeightKeeper):
            def join(self, rendezvous, rank) -> None:
                pass

            def receive(self, plan, rank) -> None:
                self._staging[plan.round_id] = (plan.version, {})

            def receive_copy(self, plan) -> dict:
                return {}

            def send(self, plan) -> None:
                pass

        return NoBytesKeeper(model_path)


async def _serve(sock_path: str, timeout_s: float, poll_s: float, ready) -> None:
    from rollout.sync.coordinator import WeightSyncCoordinator

    # poll_s: the long poll's bound; silent for sync.silent_polls of them, a replica is dropped.
    config = {"model": {"path": "/simulated"}, "metrics": {"enabled": False}, "sync": {"timeout_s": timeout_s, "require_token": False, "poll_s": poll_s}}
    coordinator = WeightSyncCoordinator(config, "gloo")
    coordinator.store.keeper = _NoBytesKeeper.make(config["model"]["path"])
    baseline = _rss_kb()["VmRSS"]
    sent = [0]
    profile: list = [None]
    tasks: set[asyncio.Task] = set()

    def stats() -> dict[str, Any]:
        mem = _rss_kb()
        return {"cpu_s": time.process_time(), "sent_bytes": sent[0], "rss_kb": mem["VmRSS"], "peak_kb": mem["VmHWM"], "baseline_kb": baseline}

    def profile_start() -> None:
        import cProfile

        profile[0] = cProfile.Profile()
        profile[0].enable()

    def profile_stop(path: str) -> None:
        profile[0].disable()
        profile[0].dump_stats(path)

    local = {"_stats": stats, "_profile_start": profile_start, "_profile_stop": profile_stop}

    async def answer(writer: asyncio.StreamWriter, call_id: int, method: str, args: tuple) -> None:
        try:
            result = local[method](*args) if method in local else await getattr(coordinator, method)(*args)
            data = _Rpc.frame((call_id, True, result))
        except Exception as e:
            try:
                data = _Rpc.frame((call_id, False, e))
            except Exception:
                data = _Rpc.frame((call_id, False, RuntimeError(f"{type(e).__name__}: {e}")))
        sent[0] += len(data)
        writer.write(data)
        await writer.drain()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                call_id, method, args = await _Rpc.read(reader)
                task = asyncio.get_running_loop().create_task(answer(writer, call_id, method, args))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    server = await asyncio.start_unix_server(connection, sock_path, limit=1 << 26)
    ready.set()
    async with server:
        await server.serve_forever()


class CoordinatorProcess:
    """A coordinator in a process of its own and the client end of its socket (one per
    population: each has its own coordinator, as each cluster would)."""

    def __init__(self, timeout_s: float, poll_s: float, workdir: str, name: str):
        self.sock_path = os.path.join(workdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"{name}.log")
        ctx = multiprocessing.get_context("spawn")
        self._ready = ctx.Event()
        self.process = ctx.Process(target=_coordinator_main, args=(self.sock_path, timeout_s, poll_s, self.log_path, self._ready), daemon=True)
        self._calls: dict[int, asyncio.Future] = {}
        self._next = 0
        self._reader_task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        self.process.start()
        if not await asyncio.to_thread(self._ready.wait, 120):
            raise RuntimeError(f"the simulated coordinator did not start within 120s (log: {self.log_path})")
        self._reader, self._writer = await asyncio.open_unix_connection(self.sock_path, limit=1 << 26)
        self.loop = asyncio.get_running_loop()
        self._reader_task = self.loop.create_task(self._read_answers())

    async def _read_answers(self) -> None:
        try:
            while True:
                call_id, ok, result = await _Rpc.read(self._reader)
                fut = self._calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(result) if ok else fut.set_exception(result)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"the simulated coordinator went away: {e}"))

    async def call(self, method: str, *args: Any) -> Any:
        self._next += 1
        fut = self.loop.create_future()
        self._calls[self._next] = fut
        self._writer.write(_Rpc.frame((self._next, method, args)))
        await self._writer.drain()
        return await fut

    def call_from_thread(self, method: str, *args: Any, timeout_s: float = 600.0) -> Any:
        """A blocking call (the publisher's side); past ``timeout_s``, the error the real
        clients raise for a coordinator that does not answer in time."""
        import concurrent.futures

        from rollout.contracts.sync_protocol import CoordinatorUnreachableError

        future = asyncio.run_coroutine_threadsafe(self.call(method, *args), self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CoordinatorUnreachableError(f"the coordinator did not answer {method} within {timeout_s:g}s") from None

    async def stop(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            self._writer.close()
        self.process.kill()
        await asyncio.to_thread(self.process.join, 10)


# ---- the replicas' side -------------------------------------------------------------------


class _Transfers:
    """Who went through ``update_weights`` in which round: what a broadcast's end waits for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._received: dict[str, set[str]] = {}

    def received(self, round_id: str, replica_id: str) -> None:
        with self._cond:
            self._received.setdefault(round_id, set()).add(replica_id)
            self._cond.notify_all()

    def wait_all(self, round_id: str, members: set[str], timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: members <= self._received.get(round_id, set()), timeout_s)


class _StubEngine:
    """vLLM's engine calls that the agent makes, returning at once; a stalled one never returns."""

    def __init__(self, replica_id: str, transfers: _Transfers):
        self.replica_id = replica_id
        self.transfers = transfers
        self.label = "default"  # vLLM's weight version before any update
        self.round_id = ""  # the round whose plan the agent took last
        self.stalled = False

    async def _step(self) -> None:
        if self.stalled:
            await asyncio.Event().wait()

    async def get_weight_version(self) -> str:
        return self.label

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        await self._step()

    async def resume_generation(self) -> None:
        await self._step()

    async def init_weight_transfer_engine(self, request) -> None:
        await self._step()

    async def start_weight_update(self) -> None:
        await self._step()

    async def update_weights(self, request) -> None:
        await self._step()
        self.transfers.received(self.round_id, self.replica_id)

    async def finish_weight_update(self) -> None:
        await self._step()

    async def update_weight_version(self, label: str) -> None:
        await self._step()
        self.label = label

    async def collective_rpc(self, method: str, kwargs: Optional[dict] = None) -> None:
        await self._step()

    async def reset_prefix_cache(self) -> bool:
        await self._step()
        return True


class _Remote:
    def __init__(self, link: "_Link", method: str):
        self.link, self.method = link, method

    def remote(self, *args: Any):
        return self.link.call(self.method, *args)


class _Link:
    """One replica's handle on the coordinator (``handle.method.remote(...)``), over the
    coordinator process's socket. Armed with ``stall_next``, it stalls the replica once
    the plan of a publish round arrives: no call of it reaches the coordinator again, and
    its engine blocks (a host lost mid-round)."""

    def __init__(self, coordinator: CoordinatorProcess, engine: _StubEngine):
        self.coordinator = coordinator
        self.engine = engine
        self.stall_next = False
        self.stalled = False

    def __getattr__(self, method: str) -> _Remote:
        return _Remote(self, method)

    async def call(self, method: str, *args: Any) -> Any:
        from rollout.contracts.sync_protocol import RESTORE_ROUNDS, PullRound, PushRound, ReloadRound, SessionRound

        if self.stalled:
            await asyncio.Event().wait()
        result = await self.coordinator.call(method, *args)
        if isinstance(result, (PushRound, PullRound, ReloadRound, SessionRound)):
            self.engine.round_id = result.round_id
            if self.stall_next and not isinstance(result, RESTORE_ROUNDS):
                self.stalled = self.engine.stalled = True
        return result


class _NoBytesSender(CopySender):
    """The publisher's transfer end, minus the bytes: a round's send ends once every member
    went through ``update_weights`` (as a broadcast ends once every rank received), and the
    group is kept for the next round as gloo's sender keeps it."""

    group_name: Optional[str] = None  # set per round (the base class's is read-only)

    def __init__(self, transfers: _Transfers):
        super().__init__()
        self.transfers = transfers

    def offer(self, tensors) -> None:
        return None

    def copy_offer(self, *args: Any, **kwargs: Any) -> CopyOffer:
        # A name and a port the publisher's copy group would use (nothing listens on it).
        return CopyOffer(f"copy-{os.urandom(4).hex()}", 1)

    def send(self, plan, tensors) -> None:
        self.group_name = None
        if not self.transfers.wait_all(plan.round_id, {m.replica_id for m in plan.members}, 2 * plan.timeout_s + 1):
            raise TimeoutError(f"{plan.round_id}: not every member received within {2 * plan.timeout_s:.0f}s")
        self.group_name = plan.group

    def send_copy(self, plan) -> None:
        pass

    def drop_kept(self) -> None:
        pass

    def close(self) -> None:
        self.group_name = None


class _PublisherLink:
    """The publisher's :class:`~rollout.sync.remote.CoordinatorClient`, over the same socket."""

    host = None  # inside the cluster, as WeightPublisher.connect

    def __init__(self, coordinator: CoordinatorProcess):
        self.coordinator = coordinator

    def begin_round(self, token, request, timeout_s: Optional[float] = None):
        return self.coordinator.call_from_thread("begin_round", token, request, timeout_s=timeout_s or 600.0)

    def finish(self, token, round_id, error, timeout_s: Optional[float] = None):
        return self.coordinator.call_from_thread("finish", token, round_id, error, timeout_s=timeout_s or 600.0)

    def status(self, timeout_s: Optional[float] = None) -> dict:
        return self.coordinator.call_from_thread("status", timeout_s=timeout_s or 600.0)


@contextlib.contextmanager
def _simulated_transport():
    """No transfer group forms here: the publisher's sender (what the backend makes for it)
    moves no bytes, the agents' rendezvous probe (a TCP connect to the publisher) is
    skipped, and the agents' per-round log lines (a replica's, not the coordinator's) are
    kept quiet. All restored on exit; yields the transfers every stub sender waits on."""
    import rollout.sync.agent as agent_module
    import rollout.sync.publisher as publisher_module

    async def reachable(where: Optional[tuple[str, int]], timeout_s: float) -> None:
        return None

    def make_sender(backend: str) -> _NoBytesSender:
        return _NoBytesSender(transfers)

    transfers = _Transfers()  # one for every population: round ids are unique
    probe, agent_module.check_reachable = agent_module.check_reachable, reachable
    made, publisher_module.make_sender = publisher_module.make_sender, make_sender
    quiet = logging.getLogger("rollout.sync.agent")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield transfers
    finally:
        agent_module.check_reachable = probe
        publisher_module.make_sender = made
        quiet.setLevel(level)


def write_model(path: Path, tensors: int = PARAMS) -> None:
    """A checkpoint whose safetensors header names ``tensors`` parameters (each tiny: their
    names, dtypes and shapes are what the coordinator's plans carry)."""
    import torch
    from safetensors.torch import save_file

    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "o_proj.weight"]
    per_layer = [f"self_attn.{n}" for n in per_layer] + ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    layer = 0
    while len(names) < tensors:
        names += [f"model.layers.{layer}.{n}" for n in per_layer]
        layer += 1
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.zeros(2) for n in names[:tensors]}, str(path / "model.safetensors"))


class Population:
    """``n`` simulated replicas, their coordinator and a publisher."""

    def __init__(self, n: int, model_path: str, timeout_s: float, workdir: str, transfers: _Transfers, poll_s: float):
        from rollout.sync.checkpoint import checkpoint_spec

        self.n = n
        self.model_path = model_path
        self.timeout_s = timeout_s
        self.params = checkpoint_spec(model_path)
        self.coordinator = CoordinatorProcess(timeout_s, poll_s, workdir, f"coordinator-{n}")
        self.transfers = transfers
        self.agents: dict[str, Any] = {}
        self.links: dict[str, _Link] = {}
        self.publisher = None
        self._tensors = None

    async def start(self) -> None:
        # What the agent imports in its first round (vLLM's request types): imported here,
        # not on the event loop mid-round, where it would stall every simulated replica.
        import vllm.distributed.weight_transfer.base  # noqa: F401

        await self.coordinator.start()
        await asyncio.gather(*(self.start_agent(f"replica-{i:05d}") for i in range(self.n)))
        from rollout.sync.publisher import WeightPublisher
        import torch

        self.publisher = WeightPublisher(_PublisherLink(self.coordinator), "gloo", None)
        self._tensors = {p.name: torch.zeros(p.shape, dtype=p.torch_dtype) for p in self.params}

    async def start_agent(self, replica_id: str) -> None:
        """A replica starting (or restarting): its engine at the initial weights, registering
        and catching up before it polls, as SyncAgent.start does."""
        from rollout.sync.agent import SyncAgent

        old = self.agents.pop(replica_id, None)
        if old is not None:
            old.stop()
        engine = _StubEngine(replica_id, self.transfers)
        link = _Link(self.coordinator, engine)
        agent = SyncAgent(engine, link, replica_id, 1, self.model_path)
        self.links[replica_id] = link
        await agent.start()
        self.agents[replica_id] = agent

    async def stats(self) -> dict[str, Any]:
        return await self.coordinator.call("_stats")

    async def publish(self) -> dict[str, Any]:
        """One publish round, timed by the publisher, with the coordinator's CPU and bytes."""
        before = await self.stats()
        t0, c0 = time.perf_counter(), time.process_time()
        error = None
        try:
            version = await asyncio.to_thread(self.publisher.publish, self._tensors)
        except Exception as e:
            version, error = None, f"{type(e).__name__}: {e}"
        wall, replicas_cpu = time.perf_counter() - t0, time.process_time() - c0
        after = await self.stats()
        outcome = self.publisher.last_outcome
        return {
            "version": version,
            "error": error,
            "wall_s": wall,
            "phases_s": dict(self.publisher.last_phases),
            "members": len(outcome.phases) if outcome is not None and outcome.committed else None,
            "cpu_s": after["cpu_s"] - before["cpu_s"],
            # This process's: every simulated replica and the publisher (in a cluster, each
            # replica's share runs on its own host, in parallel).
            "replicas_cpu_s": replicas_cpu,
            "sent_bytes": after["sent_bytes"] - before["sent_bytes"],
        }

    async def catch_up(self, share: float) -> dict[str, Any]:
        """``share`` of the replicas restart after a commit; timed until all serve it again."""
        committed = (await self.coordinator.call("status"))["committed_version"]
        late = sorted(self.agents)[: max(1, math.ceil(share * self.n))]
        before = await self.stats()
        t0 = time.perf_counter()
        await asyncio.gather(*(self.start_agent(rid) for rid in late))
        wall = time.perf_counter() - t0
        after = await self.stats()
        behind = [rid for rid in late if self.agents[rid].version != committed or self.agents[rid].broken]
        return {"replicas": len(late), "wall_s": wall, "cpu_s": after["cpu_s"] - before["cpu_s"], "behind": behind}

    async def idle_cpu(self, seconds: float) -> float:
        """The coordinator's CPU share while only the long polls run."""
        before = await self.stats()
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        after = await self.stats()
        return (after["cpu_s"] - before["cpu_s"]) / (time.perf_counter() - t0)

    async def stall(self, share: float, give_up_s: float) -> dict[str, Any]:
        """``share`` of the replicas stall as the next round's plan reaches them: how that
        round ends and when one commits without them."""
        stalled = sorted(self.agents)[-max(1, math.ceil(share * self.n)):]
        for rid in stalled:
            self.links[rid].stall_next = True
        t0 = time.perf_counter()
        first = await self.publish()
        decided_s = time.perf_counter() - t0
        outcome = self.publisher.last_outcome
        attempts = [{"at_s": round(decided_s, 2), "committed": first["error"] is None, "error": (first["error"] or "")[:240]}]
        committed_at = decided_s if first["error"] is None else None
        while committed_at is None and time.perf_counter() - t0 < give_up_s:
            r = await self.publish()
            at = time.perf_counter() - t0
            attempts.append({"at_s": round(at, 2), "committed": r["error"] is None, "error": (r["error"] or "")[:240]})
            if r["error"] is None:
                committed_at = at
        status = await self.coordinator.call("status")
        healthy = [rid for rid in self.agents if rid not in stalled]
        broken = [rid for rid in healthy if self.agents[rid].broken]
        return {
            "stalled": len(stalled),
            "first_round": {
                "committed": first["error"] is None,
                "decided_s": round(decided_s, 2),
                "error": (first["error"] or "")[:400],
                "silent_named": sum(rid in (outcome.error if outcome else "") for rid in stalled),
            },
            "commit_without_them_s": round(committed_at, 2) if committed_at is not None else None,
            "attempts": attempts,
            "members_at_end": len(status["replicas"]),
            "healthy_broken_at_end": len(broken),
            "healthy_behind_at_end": sum(self.agents[rid].version != status["committed_version"] for rid in healthy),
        }

    async def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        await self.coordinator.stop()


def _summary(values: list[float], digits: int = 4) -> dict[str, Any]:
    lo, hi = median_interval(values)
    return {"median": round(statistics.median(values), digits), "interval_90": [round(lo, digits), round(hi, digits)]}


def _linearity(points: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per-replica growth between consecutive populations: ``(y2/y1) / (n2/n1)``; about 1
    is linear, below it better, well above it super-linear."""
    out = {}
    for a, b in zip(points, points[1:]):
        ya, yb = a[key]["median"], b[key]["median"]
        out[f"{a['replicas']}->{b['replicas']}"] = round((yb / ya) / (b["replicas"] / a["replicas"]), 2) if ya > 0 else None
    return out


async def simulate(
    populations: tuple[int, ...] = POPULATIONS,
    rounds: int = ROUNDS,
    timeout_s: float = TIMEOUT_S,
    late_share: float = LATE_SHARE,
    stall_share: float = STALL_SHARE,
    params: int = PARAMS,
    idle_s: float = 5.0,
    stall: bool = True,
    profile_at: Optional[int] = None,
    profile_path: Optional[str] = None,
    poll_s: Optional[float] = None,
) -> dict[str, Any]:
    """``poll_s``: the coordinator's long-poll bound (default: the platform's ``sync.poll_s``);
    shorter only to make tests quick, since a stalled replica is dropped after 3 of them."""
    poll_s = poll_s or _poll_s()
    with tempfile.TemporaryDirectory(prefix="rollout-coordinator-scale-") as workdir, _simulated_transport() as transfers:
        model = Path(workdir) / "model"
        write_model(model, params)
        pops = {n: Population(n, str(model), timeout_s, workdir, transfers, poll_s) for n in populations}
        try:
            for pop in pops.values():  # one at a time: 1,000 registrations are a burst of their own
                await pop.start()
            # Every replica lives in this one process (each has a process of its own in a
            # cluster): the imports' millions of objects are frozen out of the garbage
            # collector, whose full passes over them would stall all replicas at once.
            gc.collect()
            gc.freeze()
            for pop in pops.values():  # warm-up: the first round forms the publisher's group
                r = await pop.publish()
                if r["error"]:
                    raise RuntimeError(f"{pop.n} replicas: the warm-up round failed: {r['error']}")
            samples: dict[int, dict[str, list]] = {n: {"publish": [], "catch_up": []} for n in populations}
            order = list(populations)
            for i in range(rounds):
                for n in order[i % len(order):] + order[: i % len(order)]:
                    pop = pops[n]
                    if profile_at == n and i == rounds - 1:
                        await pop.coordinator.call("_profile_start")
                    r = await pop.publish()
                    print(f"coordinator_scale: {n} replicas, round {i}: {r['wall_s']:.3f} s, coordinator CPU {r['cpu_s']:.3f} s", file=sys.stderr)
                    if r["error"]:
                        raise RuntimeError(f"{n} replicas, round {i}: {r['error']}")
                    samples[n]["publish"].append(r)
                    c = await pop.catch_up(late_share)
                    if c["behind"]:
                        raise RuntimeError(f"{n} replicas, round {i}: {len(c['behind'])} late replicas did not catch up: {c['behind'][:3]}")
                    samples[n]["catch_up"].append(c)
                    if profile_at == n and i == rounds - 1:
                        await pop.coordinator.call("_profile_stop", profile_path)
            idle = {n: share for n, share in zip(pops, await asyncio.gather(*(p.idle_cpu(idle_s) for p in pops.values())))}
            memory = {n: await p.stats() for n, p in pops.items()}
            stalls = {}
            if stall:  # last, as it leaves replicas behind; all at once (each waits out deadlines)
                found = await asyncio.gather(*(pop.stall(stall_share, give_up_s=60 + 6 * timeout_s) for pop in pops.values()))
                stalls = dict(zip(pops, found))
        finally:
            gc.unfreeze()
            for pop in pops.values():
                await pop.stop()
    points = []
    for n in populations:
        pub, cu = samples[n]["publish"], samples[n]["catch_up"]
        point = {
            "replicas": n,
            "round_s": _summary([r["wall_s"] for r in pub]),
            "round_phases_s": {k: round(statistics.median(r["phases_s"][k] for r in pub), 4) for k in ("open", "send", "commit")},
            "coordinator_cpu_s": _summary([r["cpu_s"] for r in pub]),
            "replicas_cpu_s": _summary([r["replicas_cpu_s"] for r in pub]),
            "coordinator_sent_kb": round(statistics.median(r["sent_bytes"] for r in pub) / 1024, 1),
            "late_replicas": cu[0]["replicas"],
            "catch_up_s": _summary([c["wall_s"] for c in cu]),
            "catch_up_cpu_s": _summary([c["cpu_s"] for c in cu]),
            "idle_cpu_share": round(idle[n], 4),
            "peak_memory_growth_mb": round((memory[n]["peak_kb"] - memory[n]["baseline_kb"]) / 1024, 1),
            "rounds": {"round_s": [round(r["wall_s"], 4) for r in pub], "coordinator_cpu_s": [round(r["cpu_s"], 4) for r in pub]},
        }
        if n in stalls:
            point["stall"] = stalls[n]
        points.append(point)
    biggest = points[-1]
    return {
        "benchmark": "coordinator_scale",
        "rounds": rounds,
        "order": "interleaved: the populations take turns, the order rotated every round",
        "interval": "interval_90 is a bootstrap 90% interval of the median",
        "timeout_s": timeout_s,
        "poll_s": poll_s,
        "params": params,
        "late_share": late_share,
        "stall_share": stall_share,
        "simulated": (
            "real coordinator (own process, pickled calls), real SyncAgent per replica over a stub engine, real WeightPublisher "
            "over a stub sender; no transfer group forms and no tensor bytes move"
        ),
        # Coordination: the coordinator process's CPU seconds per round. It is one event
        # loop, busy for that long in every round; the rest of a round's wall time here is
        # the simulated replicas, which share this machine's cores (in a cluster each has
        # its own host).
        "goal": f"coordinator CPU per round linear or better in the replicas (growth per replica <= 1.5x), under {GOAL_S:g} s at {biggest['replicas']:,}",
        "goal_met": bool(
            biggest["coordinator_cpu_s"]["median"] < GOAL_S and all(v is None or v <= 1.5 for v in _linearity(points, "coordinator_cpu_s").values())
        ),
        "per_replica_growth": {"round_s": _linearity(points, "round_s"), "coordinator_cpu_s": _linearity(points, "coordinator_cpu_s")},
        "machine": machine(packages=False),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "points": points,
    }


def _poll_s() -> float:
    from rollout.config import SyncConfig

    return SyncConfig().poll_s


def run(**kwargs: Any) -> dict[str, Any]:
    return asyncio.run(simulate(**kwargs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--populations", type=int, nargs="*", default=list(POPULATIONS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--no-stall", action="store_true")
    parser.add_argument("--profile-at", type=int, help="cProfile the coordinator process in the last round at this population")
    parser.add_argument("--profile-out", default="build/coordinator.prof")
    parser.add_argument("--out", help="write the JSON here")
    args = parser.parse_args()
    result = run(
        populations=tuple(args.populations), rounds=args.rounds, timeout_s=args.timeout, stall=not args.no_stall,
        profile_at=args.profile_at, profile_path=os.path.abspath(args.profile_out),
    )
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
