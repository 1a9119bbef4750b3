"""Publish time with the trainer on its own host, beside the same trainer on the replicas' host.

Two hosts on this machine (``rollout.bench.netns``): ``head`` runs the Ray head and
``rollout serve`` (one replica, the ``medium`` model), ``trainer`` nothing else. Two
identical trainer processes publish over HTTP (``WeightPublisher.http``, gloo) to the
ingress at the head's address: one in the head's namespace ("one host"), one in the
trainer's ("two hosts", every byte over a veth pair and the trainer's own TCP stack).
They take turns, the order rotated every round, so drift of the machine moves both.

Each trainer keeps its publisher, as a training loop does, but the two alternate: the
replica's group is the other trainer's when a turn starts, so a turn's first publish
forms a group (rendezvous and full mesh: ``first_s``) and its second reuses it
(``kept_s``, what a trainer publishing every step sees). The coordinator's copy, sent
after each commit, is let finish between publishes, untimed (a training step is longer).
Both are reported; the ratio is paired round by round.

    python -m rollout.bench.hosts_publish URL API_KEY MODEL_DIR   # a trainer (internal)
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from rollout.bench.machine import machine
from rollout.bench.netns import Namespace, link, why_not
from rollout.processes import end
from rollout.modelbuild import build_model, is_built
from rollout.stats_summary import median_interval, paired_ratios

ROUNDS = 8
HEAD_ADDRESS, TRAINER_ADDRESS = "10.232.1.1", "10.232.1.2"
RAY_PORT, HTTP_PORT = 6379, 8000
START_TIMEOUT_S = 600
API_KEY = "bench-hosts-key-0123456789"
SYNC_TOKEN = "bench-hosts-sync-0123456789"


class _Process:
    """A process in a namespace, its output in a file."""

    def __init__(self, ns: Namespace, argv: list[str], log: Path, env: dict[str, str], stdin: Any = subprocess.DEVNULL, stdout: Any = None):
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(ns.argv(*argv), stdin=stdin, stdout=stdout or self._out, stderr=self._out if stdout else subprocess.STDOUT, env=env, text=True)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log.read_text(errors="replace"):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        end(self.proc, 60)
        self._out.close()


class _Trainer(_Process):
    """This module's trainer in a namespace: a JSON command per line, a JSON answer."""

    def __init__(self, ns: Namespace, model_dir: Path, log: Path, env: dict[str, str]):
        argv = [sys.executable, "-u", "-m", "rollout.bench.hosts_publish", f"http://{HEAD_ADDRESS}:{HTTP_PORT}", API_KEY, str(model_dir)]
        super().__init__(ns, argv, log, env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._lines.put(line) for line in self.proc.stdout], daemon=True).start()

    def answer(self, timeout_s: float = 300) -> dict:
        try:
            out = json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise RuntimeError(f"the trainer ({self.log.name}) did not answer within {timeout_s:.0f}s:\n{self.tail()}") from None
        if "error" in out:
            raise RuntimeError(f"the trainer ({self.log.name}) failed: {out['error']}\n{self.tail()}")
        return out

    def turn(self, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self.answer()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ROLLOUT_", "GLOO_", "NCCL_", "VLLM_HOST_IP"))}
    pythonpath = str(Path(__file__).resolve().parents[2])  # platform/: the source root
    env.update(PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", ROLLOUT_SYNC_TOKEN=SYNC_TOKEN)
    env.update(extra)
    return env


def _summary(values: list[float]) -> dict[str, Any]:
    low, high = median_interval(values)
    return {"median_s": statistics.median(values), "interval_90_s": [low, high], "rounds_s": values}


def _ratio(paths: list[float], baseline: list[float]) -> dict[str, Any]:
    ratios = paired_ratios(paths, baseline)
    low, high = median_interval(ratios)
    return {"median": round(statistics.median(ratios), 3), "interval_90": [round(low, 3), round(high, 3)], "rounds": [round(r, 3) for r in ratios]}


def run(out_root: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    reason = why_not()
    if reason is not None:
        # Recorded, not faked: the report says the comparison did not run and why.
        return {"benchmark": "hosts_publish", "skipped": reason, "machine": machine()}
    import yaml

    model_dir = out_root / "model-medium"
    if not is_built(model_dir):
        build_model(model_dir, size="medium")
    tag = f"rbench{os.getpid()}"
    head, trainer = Namespace(f"{tag}-head"), Namespace(f"{tag}-trainer")
    work = Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))  # short: Ray's socket paths live under it
    processes: list[_Process] = []
    try:
        hosts_file = f"127.0.0.1\tlocalhost\n127.0.0.1\t{socket.gethostname()}\n"
        for ns in (head, trainer):
            ns.create(hosts_file)
        link(head, HEAD_ADDRESS, trainer, TRAINER_ADDRESS)
        (work / "api-key").write_text(API_KEY + "\n")
        config = {
            "model": {"path": str(model_dir), "device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20},
            "http": {"host": "0.0.0.0", "port": HTTP_PORT, "api_key_file": str(work / "api-key")},
            "sync": {"timeout_s": 120},
            "metrics": {"enabled": False},
            "tools": {"python": {"enabled": False}},
        }
        (work / "rollout.yaml").write_text(yaml.safe_dump(config))
        cluster = _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        ray_bin = str(Path(sys.executable).with_name("ray"))
        ray_head = _Process(head, [ray_bin, "start", "--head", "--block", f"--node-ip-address={HEAD_ADDRESS}", f"--port={RAY_PORT}", "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={work / 'ray'}"], work / "ray-head.log", cluster)  # fmt: skip
        processes.append(ray_head)
        if not ray_head.wait_for("Ray runtime started", 120):
            raise RuntimeError(f"the Ray head did not start:\n{ray_head.tail()}")
        serve = _Process(head, [sys.executable, "-m", "rollout.cli", "serve", "--config", str(work / "rollout.yaml"), "--address", f"{HEAD_ADDRESS}:{RAY_PORT}"], work / "serve.log", cluster)
        processes.append(serve)
        trainers = {"one_host": _Trainer(head, model_dir, work / "trainer-one-host.log", _env()), "two_hosts": _Trainer(trainer, model_dir, work / "trainer-two-hosts.log", _env())}
        processes.extend(trainers.values())
        if not serve.wait_for("serving ", START_TIMEOUT_S):
            raise RuntimeError(f"rollout serve did not start:\n{serve.tail()}")
        for t in trainers.values():
            t.answer()  # ready
        # One unmeasured turn each: first publishes load code paths and allocate buffers.
        for i, t in enumerate(trainers.values()):
            t.turn(seed=100 + i)
        measured: dict[str, dict[str, list[float]]] = {name: {"first_s": [], "kept_s": []} for name in trainers}
        names = list(trainers)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                out = trainers[name].turn(seed=r + 1)
                measured[name]["first_s"].append(out["first_s"])
                measured[name]["kept_s"].append(out["kept_s"])
        nbytes = trainers["one_host"].turn(seed=0)["bytes"]
    finally:
        for p in reversed(processes):
            p.close()
        for ns in (trainer, head):
            ns.destroy()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "hosts_publish",
        "model": str(model_dir),
        "bytes": nbytes,
        "backend": "gloo",
        "replicas": 1,
        "rounds": rounds,
        "order": "interleaved: the one-host and the two-host trainer take turns, the order rotated every round; a turn is two publishes (the first forms the group, the second reuses it)",
        "links": f"head {HEAD_ADDRESS} and trainer {TRAINER_ADDRESS}: network namespaces joined by a veth pair",
        "one_host": {k: _summary(v) for k, v in measured["one_host"].items()},
        "two_hosts": {k: _summary(v) for k, v in measured["two_hosts"].items()},
        "two_hosts_vs_one_host": {k: _ratio(measured["two_hosts"][k], measured["one_host"][k]) for k in ("first_s", "kept_s")},
        "machine": machine(),
    }


def _trainer_main(url: str, api_key: str, model_dir: str) -> None:
    """A trainer: for each ``{"seed": k}``, two publishes of weights perturbed by ``k``
    (seed 0: the checkpoint's own) through one kept publisher; their seconds."""
    import torch
    from safetensors.torch import load_file

    from rollout.sync import WeightPublisher

    checkpoint: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(str(f)))
    nbytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
    publisher: Optional[WeightPublisher] = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        seed = json.loads(line)["seed"]
        try:
            g = torch.Generator().manual_seed(seed)
            tensors = {n: (t + torch.randn(t.shape, generator=g).to(t.dtype) * 0.01 if seed and t.is_floating_point() else t) for n, t in checkpoint.items()}
            if publisher is None:
                publisher = WeightPublisher.http(url, api_key=api_key, backend="gloo")
            seconds = []
            for _ in range(2):
                t0 = time.perf_counter()
                publisher.publish(tensors)
                seconds.append(time.perf_counter() - t0)
                # The coordinator's copy goes out after the commit, while a trainer computes
                # its next step; the next publish would wait for it, so it is let finish
                # here, untimed, as a training step longer than the copy would.
                publisher.flush()
            answer: dict[str, Any] = {"first_s": seconds[0], "kept_s": seconds[1], "bytes": nbytes}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
    if publisher is not None:
        publisher.close()


if __name__ == "__main__":
    _trainer_main(*sys.argv[1:4])
