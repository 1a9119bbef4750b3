"""``make soak``: the platform under mixed load while weights are published every few
seconds and faults are injected, for a set time; a JSON report is the evidence.

Load (all at once, each call with a deadline): batched rollouts through a Serve handle,
NDJSON streams over HTTP (every third one cancelled after its first chunks), OpenAI
completions through the stock ``openai`` SDK. A trainer process publishes perturbed
weights back to back. Faults, in turn: an engine replica killed mid-batch, the trainer
killed mid-publish, the coordinator killed while idle and during a round, the ingress
killed, the queue overfilled.

The report counts every call by path and outcome (``ok``, a typed retryable error by
name, or ``untyped`` with the error), calls that never answered (``hung``) or answered
short (``lost``), publishes committed and failed, versions seen in any token's span that
were never committed, each fault's time to serving again and to full strength, and each
process role's memory at the start and the end.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from rollout.api import RolloutRequest, SamplingConfig
from rollout.errors import EngineUnavailableError

logger = logging.getLogger(__name__)

API_KEY = "soak-key"  # `make soak`'s own platform's credentials
SYNC_TOKEN = "soak-sync-token"
CALL_TIMEOUT_S = 60.0  # the clients' own deadline: past it a call ends with a typed error
HUNG_AFTER_S = CALL_TIMEOUT_S + 30  # no answer at all by then: hung
SERVING_AGAIN_BOUND_S = 60.0  # after any fault, a request is served again within this
FULL_STRENGTH_BOUND_S = 240.0  # ... and every deployment is back to full strength within this
# Per process alive from the warm-up to the end. An engine's KV cache (256 MiB here) is
# first touched block by block as requests use it, so a worker may still grow by up to that.
MEMORY_GROWTH_BOUND_MB = 320.0
# In turn. The engine replica first: its replacement's start (a minute or two on two busy
# cores) outlasts a period, and the faults after it then come back to back, which keeps a
# short soak (CI's: each kind once) short.
FAULTS = ("kill_engine_replica", "overfill_queue", "kill_coordinator_in_round", "kill_ingress", "kill_coordinator_idle", "kill_trainer")
KILLS_A_REPLICA = {"kill_engine_replica", "kill_coordinator_idle", "kill_coordinator_in_round", "kill_ingress"}
# Per replica, and waiting at each caller: small, so the overfill fault's burst exceeds them.
MAX_ONGOING, MAX_QUEUED = 16, 16
OVERFILL_CALLS = 2 * (2 * MAX_ONGOING + MAX_QUEUED)
# The engine deployment's settings under soak (all applied by Serve itself: changing them on
# a running app restarts nothing, so they can be put on a platform that is already up).
SOAK_DEPLOYMENT = {"replicas": 2, "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED, "health_check_period_s": 2}
NOTICE_WITHIN_S = 20.0  # Serve's health check (2 s period, 10 s timeout here) notices a killed replica by then


@dataclass(frozen=True)
class SoakRun:
    """What to soak (a deployed platform and its credentials) and for how long."""

    cfg: Any  # the platform's PlatformConfig, deployed with SOAK_DEPLOYMENT
    model_dir: Path
    api_key: str
    sync_token: str
    duration_s: float = 600.0
    fault_period_s: float = 40.0  # faults at half a period, then every period, while before duration_s
    seed: int = 0


@dataclass
class Tally:
    outcomes: dict[str, collections.Counter] = field(default_factory=lambda: collections.defaultdict(collections.Counter))
    untyped: list[str] = field(default_factory=list)
    hung: int = 0
    lost: int = 0
    versions_seen: set[int] = field(default_factory=set)

    def record(self, path: str, error: Optional[BaseException], n: int = 1) -> None:
        if error is None:
            self.outcomes[path]["ok"] += n
        elif _typed_retryable(error):
            self.outcomes[path][type(error).__name__] += n
        else:
            self.outcomes[path]["untyped"] += n
            self.untyped.append(f"{path}: {type(error).__name__}: {str(error)[:200]}")


def _typed_retryable(error: BaseException) -> bool:
    if isinstance(error, EngineUnavailableError):
        return True
    # The openai SDK's own retry rule (what it retries when max_retries allows): a
    # connection error, 408, 409, 429 and every 5xx.
    import openai

    if isinstance(error, openai.APIConnectionError):
        return True
    status = getattr(error, "status_code", None)
    return isinstance(error, openai.APIStatusError) and (status in (408, 409, 429) or status >= 500)


async def _call(tally: Tally, path: str, n: int, fn: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await asyncio.wait_for(fn(), HUNG_AFTER_S)
    except asyncio.TimeoutError:
        tally.hung += n
    except asyncio.CancelledError:
        raise
    except Exception as e:
        tally.record(path, e, n)
    return None


def _spans(samples) -> set[int]:
    return {sp.version for s in samples for sp in s.weight_versions}


async def _batches(tally: Tally, client, stop: asyncio.Event, rng: random.Random) -> None:
    while not stop.is_set():
        n = rng.randint(4, 12)
        reqs = [RolloutRequest(prompt_token_ids=[rng.randint(5, 900) for _ in range(rng.randint(4, 24))], sampling=SamplingConfig(max_tokens=rng.randint(8, 32))) for _ in range(n)]
        results = await _call(tally, "batch", n, lambda: client.generate(reqs))
        if results is not None:
            tally.lost += n - len(results)
            tally.record("batch", None, len(results))
            for r in results:
                tally.versions_seen |= _spans(r.samples)


async def _streams(tally: Tally, client, stop: asyncio.Event, rng: random.Random) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        cancel_after = 2 if k % 3 == 0 else None
        req = RolloutRequest(prompt_token_ids=[rng.randint(5, 900) for _ in range(8)], sampling=SamplingConfig(max_tokens=24))

        async def one() -> str:
            got = 0
            async for chunk in client.stream(req):
                got += 1
                tally.versions_seen |= {sp.version for sp in chunk.weight_versions}
                if cancel_after is not None and got >= cancel_after:
                    return "cancelled"
            return "ok"

        outcome = await _call(tally, "stream", 1, one)
        if outcome == "cancelled":
            tally.outcomes["stream"]["cancelled (by the client)"] += 1
        elif outcome == "ok":
            tally.record("stream", None)


async def _openai(tally: Tally, base_url: str, api_key: str, model: str, stop: asyncio.Event, rng: random.Random) -> None:
    import openai

    # No retries: the soak counts every failure the SDK would see (and would retry by default).
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=CALL_TIMEOUT_S, max_retries=0)
    try:
        while not stop.is_set():
            prompt = " ".join(rng.choice("the policy model answer question value action state".split()) for _ in range(6))
            done = await _call(tally, "openai", 1, lambda: client.completions.create(model=model, prompt=prompt, max_tokens=16))
            if done is not None:
                tally.record("openai", None)
    finally:
        await client.close()


class Trainer:
    """The publishing process, its stdout read on a thread: committed versions and failures."""

    def __init__(self, model_dir: Path, app_name: str, sync_token: str, period_s: float):
        self.args = [sys.executable, "-m", "rollout.soak.trainer", str(model_dir), app_name, str(period_s)]
        self.sync_token = sync_token
        self.committed: list[int] = []
        self.failed: list[str] = []
        self.in_round = threading.Event()
        self.idle = threading.Event()
        self.proc: Optional[subprocess.Popen] = None
        self.crashes: list[str] = []  # exits the soak did not cause: an error publish() did not type
        self._killing = False

    def start(self) -> None:
        import ray
        import tempfile

        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "ROLLOUT_SYNC_TOKEN": self.sync_token}
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc, self._stderr), daemon=True).start()

    def _read(self, proc: subprocess.Popen, stderr) -> None:
        self._follow(proc)
        if proc.wait(timeout=30) != 0 and not self._killing:  # its stdout ended: it is exiting
            stderr.seek(0)
            self.crashes.append(stderr.read()[-1500:])
            logger.error("soak: the trainer crashed (%d so far)", len(self.crashes))
            if len(self.crashes) < 5:
                self.start()

    def _follow(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "PUBLISHING":
                self.idle.clear()
                self.in_round.set()
            elif word in ("COMMITTED", "FAILED"):
                self.in_round.clear()
                self.idle.set()
                (self.committed.append(int(rest)) if word == "COMMITTED" else self.failed.append(rest))

    def kill(self) -> None:
        if self.proc is not None:
            self._killing = True
            self.proc.kill()
            self.proc.wait(30)
            self.in_round.clear()
            self.idle.clear()
            time.sleep(0.5)  # its reader thread sees the exit as ours
            self._killing = False


def _serve_actor(deployment: str, rng: random.Random):
    """One replica actor of ``deployment``, picked with the soak's seeded ``rng``."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve" and f"#{deployment}#" in a["name"])
    if not names:
        raise RuntimeError(f"soak: no live replica of {deployment} to kill")
    return ray.get_actor(rng.choice(names), namespace="serve")


def full_strength(app_name: str, replicas: int) -> bool:
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or app.status != "RUNNING":
        return False
    return all(sum(d.replica_states.values()) == d.replica_states.get("RUNNING", 0) for d in app.deployments.values()) and (
        sum(d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items() if name == "RolloutEngine") >= replicas
    )


def _memory_by_process() -> dict[int, tuple[str, float]]:
    """pid -> (role, resident MiB) of every process on the machine."""
    import psutil

    from rollout.bench.cpu import _role

    out = {}
    own = os.getpid()
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            rss = p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[p.pid] = (_role(" ".join(p.info["cmdline"] or [p.info["name"] or ""]), own, p.pid), rss / 2**20)
    return out


def _memory_growth(start: dict[int, tuple[str, float]], end: dict[int, tuple[str, float]]) -> dict[str, dict[str, float]]:
    """By role: resident MiB at both ends, and the largest growth of one process alive at
    both (a process the soak killed and Serve replaced starts over; it is not growth)."""
    roles: dict[str, dict[str, float]] = {}
    for snapshot, key in ((start, "start_mb"), (end, "end_mb")):
        for role, mb in snapshot.values():
            roles.setdefault(role, {"start_mb": 0.0, "end_mb": 0.0, "max_process_growth_mb": 0.0})[key] += mb
    for pid in start.keys() & end.keys():
        role = end[pid][0]
        roles[role]["max_process_growth_mb"] = max(roles[role]["max_process_growth_mb"], end[pid][1] - start[pid][1])
    return {role: {k: round(v) for k, v in m.items()} for role, m in sorted(roles.items())}


async def _inject(kind: str, trainer: Trainer, base_url: str, api_key: str, tally: Tally, rng: random.Random) -> float:
    """Inject ``kind``; return when it happened (some faults first wait for their moment)."""
    import ray

    if kind == "kill_engine_replica":
        at = time.monotonic()
        ray.kill(_serve_actor("RolloutEngine", rng), no_restart=True)
        return at
    elif kind == "kill_trainer":
        await asyncio.to_thread(trainer.in_round.wait, 60)  # mid-publish
        at = time.monotonic()
        trainer.kill()
        trainer.start()
        return at
    elif kind in ("kill_coordinator_idle", "kill_coordinator_in_round"):
        await asyncio.to_thread((trainer.idle if kind.endswith("idle") else trainer.in_round).wait, 60)
        at = time.monotonic()
        ray.kill(_serve_actor("WeightSyncCoordinator", rng), no_restart=True)
        return at
    elif kind == "kill_ingress":
        at = time.monotonic()
        ray.kill(_serve_actor("RolloutIngress", rng), no_restart=True)
        return at
    elif kind == "overfill_queue":
        import httpx

        body = {"requests": [{"prompt_token_ids": [7, 8, 9], "sampling": {"max_tokens": 32}}]}
        # More calls at once than every replica admits plus the ingress's queue holds (the
        # rest of the load is running too), over as many connections: some must get 429.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=CALL_TIMEOUT_S, limits=limits) as c:
            answers = await asyncio.gather(*(c.post("/v1/rollouts", json=body) for _ in range(OVERFILL_CALLS)), return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException):
                tally.outcomes["overfill"]["untyped"] += 1
                tally.untyped.append(f"overfill: {type(a).__name__}: {a}")
            else:
                tally.outcomes["overfill"][{200: "ok", 429: "OverloadedError (429)", 503: "EngineUnavailableError (503)"}.get(a.status_code, f"untyped {a.status_code}")] += 1
    else:
        raise ValueError(f"unknown fault {kind!r}; choose from {FAULTS}")
    return time.monotonic()


async def _watch_commits(app_name: str, sync_token: str, seen: set[int], stop: asyncio.Event) -> None:
    from rollout.sync import WeightPublisher

    publisher = WeightPublisher.connect(app_name=app_name, token=sync_token, timeout_s=10)
    while not stop.is_set():
        try:
            status = await asyncio.to_thread(publisher.status)
            seen.add(status["committed_version"])
            seen.update(o["version"] for o in status["recent_rounds"] if o["committed"])
        except Exception:  # the coordinator restarting: the next poll sees its successor
            pass
        await asyncio.sleep(0.5)


async def _recovery(probe, app_name: str, replicas: int, since: float, kills_a_replica: bool) -> dict[str, Optional[float]]:
    serving = full = None
    # Serve reports the killed replica only after a health check: until it has, "full
    # strength" would be read off a status that has not seen the fault yet.
    noticed = not kills_a_replica
    while time.monotonic() - since < FULL_STRENGTH_BOUND_S and (serving is None or full is None):
        if serving is None:
            try:
                await asyncio.wait_for(probe.generate([RolloutRequest(prompt_token_ids=[3, 4, 5], sampling=SamplingConfig(max_tokens=4))]), 30)
                serving = time.monotonic() - since
            except Exception:
                pass
        strong = await asyncio.to_thread(full_strength, app_name, replicas)
        noticed = noticed or not strong or time.monotonic() - since > NOTICE_WITHIN_S
        if full is None and noticed and strong:
            full = time.monotonic() - since
        await asyncio.sleep(1.0)
    return {"serving_again_s": None if serving is None else round(serving, 1), "full_strength_s": None if full is None else round(full, 1)}


async def soak(run: SoakRun) -> dict[str, Any]:
    """Soak the deployed platform ``run.cfg``; the report (see the module's docstring)."""
    from rollout.client import RolloutClient
    from rollout.sync import WeightPublisher

    cfg = run.cfg
    rng = random.Random(run.seed)
    base_url = f"http://127.0.0.1:{cfg.http.port}"
    replicas = cfg.deployment.replicas
    tally = Tally()
    handle = RolloutClient.connect(app_name=cfg.app_name, batch_size=4, timeout_s=CALL_TIMEOUT_S)
    http = RolloutClient.http(base_url, api_key=run.api_key, timeout_s=CALL_TIMEOUT_S)
    probe = RolloutClient.connect(app_name=cfg.app_name, batch_size=1, timeout_s=30)
    trainer = Trainer(run.model_dir, cfg.app_name, run.sync_token, period_s=1.0)
    trainer.start()
    await asyncio.to_thread(trainer.idle.wait, 180)  # the first publish committed (or failed)
    stop = asyncio.Event()
    committed_seen: set[int] = set()
    load = [
        asyncio.create_task(_watch_commits(cfg.app_name, run.sync_token, committed_seen, stop)),
        asyncio.create_task(_batches(tally, handle, stop, random.Random(rng.random()))),
        asyncio.create_task(_batches(tally, handle, stop, random.Random(rng.random()))),
        asyncio.create_task(_streams(tally, http, stop, random.Random(rng.random()))),
        asyncio.create_task(_openai(tally, base_url, run.api_key, cfg.model.name, stop, random.Random(rng.random()))),
    ]
    faults = []
    t0 = time.monotonic()
    # Warm-up (the engines' caches and every path in use) for half a period; then a fault at
    # every period's mark before the end. A recovery longer than a period delays the next
    # fault; the last one's recovery may run past the end (the load goes on until it is over).
    await asyncio.sleep(run.fault_period_s / 2)
    memory_start = _memory_by_process()
    k = 0
    while (mark := run.fault_period_s / 2 + k * run.fault_period_s) < run.duration_s:
        await asyncio.sleep(max(0.0, t0 + mark - time.monotonic()))
        kind = FAULTS[k % len(FAULTS)]
        k += 1
        logger.info("soak: injecting %s at %.0fs", kind, time.monotonic() - t0)
        at = await _inject(kind, trainer, base_url, run.api_key, tally, rng)
        faults.append({"fault": kind, "at_s": round(at - t0, 1), **await _recovery(probe, cfg.app_name, replicas, at, kind in KILLS_A_REPLICA)})
    await asyncio.sleep(max(0.0, t0 + run.duration_s - time.monotonic()))
    stop.set()
    await asyncio.gather(*load)
    trainer.kill()
    memory_end = _memory_by_process()
    status = await asyncio.to_thread(WeightPublisher.connect(app_name=cfg.app_name, token=run.sync_token).status)
    # What the trainer saw committed, and what the coordinator said it committed (a round it
    # decided just before it was killed commits without the trainer hearing of it).
    committed = set(trainer.committed) | committed_seen | {0, status["committed_version"]}
    uncommitted = sorted(v for v in tally.versions_seen if v not in committed)
    for c in (handle, http, probe):
        c.close()
    memory = _memory_growth(memory_start, memory_end)
    checks = {
        "the trainer never crashed (every publish error typed)": not trainer.crashes,
        "no call hung": tally.hung == 0,
        "no call lost": tally.lost == 0,
        "every failure a typed retryable error": not tally.untyped,
        "no replica served an uncommitted version": not uncommitted,
        f"serving again within {SERVING_AGAIN_BOUND_S:.0f}s of every fault": all(f["serving_again_s"] is not None and f["serving_again_s"] <= SERVING_AGAIN_BOUND_S for f in faults),
        f"full strength within {FULL_STRENGTH_BOUND_S:.0f}s of every fault": all(f["full_strength_s"] is not None for f in faults),
        f"no process grew by more than {MEMORY_GROWTH_BOUND_MB:.0f} MiB": all(m["max_process_growth_mb"] <= MEMORY_GROWTH_BOUND_MB for m in memory.values()),
        "weights were published": len(trainer.committed) > 0,
    }
    if k >= len(FAULTS):  # the run had a mark for each kind
        checks["every kind of fault was injected"] = {f["fault"] for f in faults} == set(FAULTS)
    if "overfill" in tally.outcomes:
        checks["the overfilled queue refused calls with 429"] = tally.outcomes["overfill"].get("OverloadedError (429)", 0) > 0
    return {
        "benchmark": "soak",
        "duration_s": run.duration_s,
        "fault_period_s": run.fault_period_s,
        "replicas": replicas,
        "calls": {path: dict(c) for path, c in sorted(tally.outcomes.items())},
        "untyped_failures": tally.untyped[:50],
        "hung": tally.hung,
        "lost": tally.lost,
        "publishes": {"committed": len(trainer.committed), "failed": len(trainer.failed), "failures": trainer.failed[:20], "trainer_crashes": trainer.crashes[:5]},
        "versions_seen": sorted(tally.versions_seen),
        "uncommitted_versions_seen": uncommitted,
        "faults": faults,
        "memory_by_role": memory,
        "checks": checks,
        "passed": all(checks.values()),
    }


def run_soak(model_dir: Path, out: Path, duration_s: float = 600.0, fault_period_s: float = 40.0, seed: int = 0) -> int:
    """Run the soak on a local platform (2 engine replicas); write the JSON; 0 when every check held."""
    import ray

    from rollout.local import cpu_config, local_platform

    os.environ["ROLLOUT_API_KEY"] = API_KEY
    os.environ["ROLLOUT_SYNC_TOKEN"] = SYNC_TOKEN
    cfg = cpu_config(
        model_dir,
        app_name="rollout-soak",
        model={"max_model_len": 512, "kv_cache_memory_bytes": 256 << 20},
        http={"port": 8790, "host": "127.0.0.1"},
        deployment={**SOAK_DEPLOYMENT, "health_check_timeout_s": 10, "stuck_timeout_s": 20},
        sync={"timeout_s": 10},
    )
    run = SoakRun(cfg, model_dir, API_KEY, SYNC_TOKEN, duration_s=duration_s, fault_period_s=fault_period_s, seed=seed)
    ray.init(num_cpus=8, namespace="rollout-soak", log_to_driver=False)
    try:
        with local_platform(cfg):
            report = asyncio.run(soak(run))
    finally:
        ray.shutdown()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}: {'passed' if report['passed'] else 'FAILED: ' + ', '.join(k for k, ok in report['checks'].items() if not ok)}")
    return 0 if report["passed"] else 1
