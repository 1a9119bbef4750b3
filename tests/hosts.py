"""Several hosts on one machine: Linux network namespaces joined by veth pairs.

    head     eth0 10.231.1.1 ────────── eth1 10.231.1.2   trainer
                                         eth0 10.231.2.1 ────── eth0 10.231.2.2   side

- ``head``: the Ray head and ``rollout serve`` (its HTTP ingress on 0.0.0.0);
- ``trainer``: outside the Ray cluster. Its first interface leads to ``side``, a peer
  with nothing behind it that the head has no route to, so a publisher that picks an
  address by interface order, or is told to use that one, advertises an address the
  replicas cannot reach; its route to the head goes through its second interface.

Every host's hostname resolves to 127.0.0.1 (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts``), as on machines whose ``/etc/hosts`` maps
it to loopback: anything that advertises the hostname's address to another host fails.
No namespace has a default route, so nothing here can send traffic anywhere but to the
addresses above; the machine's own namespace gets no address and no route.

Everything a test starts runs inside these namespaces, so teardown finds each process by
its namespace (``ip netns pids``) and ends it by id, then deletes the namespaces; it runs
when a test fails too. Namespaces a killed run left behind (named after a pid that is
gone) are removed the next time.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "rollouthosts"
HEAD_ADDRESS, TRAINER_ADDRESS = "10.231.1.1", "10.231.1.2"
SIDE_TRAINER_ADDRESS, SIDE_ADDRESS = "10.231.2.1", "10.231.2.2"
RAY_PORT, HTTP_PORT = 6379, 8000


class CannotMakeHosts(Exception):
    """This machine (or this user) cannot make network namespaces; the reason says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Host:
    name: str  # its role: head, trainer, side
    ns: str
    addresses: list[str] = field(default_factory=list)

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        done = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def stop_everything(self, grace_s: float = 10.0) -> list[int]:
        """End every process in this namespace (all started by the harness): SIGTERM,
        then SIGKILL to those still there after ``grace_s``. Returns the ones killed."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = self.pids()
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        return killed


class Logged:
    """A process in a host's namespace, its output in a file (read when a test fails)."""

    def __init__(self, host: Host, argv: list[str], log: Path, env: dict[str, str]):
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(host.argv(*argv), stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.text():
                return True
            if self.proc.poll() is not None:
                return text in self.text()
            time.sleep(0.5)
        return False

    def stop(self, grace_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


class Trainer:
    """``tests/host_trainer.py`` on the trainer host: one JSON command, one JSON answer."""

    def __init__(self, host: Host, url: str, api_key: str, model_dir: Path, log: Path, env: dict[str, str]):
        self.log = log
        self._err = open(log, "w")
        argv = host.argv(sys.executable, "-u", "-m", "tests.host_trainer", url, api_key, str(model_dir))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env, cwd=ROOT)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def answer(self, timeout_s: float) -> dict:
        try:
            return json.loads(self._lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"the trainer did not answer within {timeout_s:.0f}s:\n{self.tail()}") from None

    def call(self, timeout_s: float = 120.0, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout_s)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


class Hosts:
    """The three namespaces above; :meth:`create` and :meth:`destroy` (idempotent)."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.head = Host("head", f"{tag}-head", [HEAD_ADDRESS])
        self.trainer = Host("trainer", f"{tag}-trainer", [SIDE_TRAINER_ADDRESS, TRAINER_ADDRESS])
        self.side = Host("side", f"{tag}-side", [SIDE_ADDRESS])
        self.all = [self.head, self.trainer, self.side]
        # Short: Ray's socket paths under it must stay within the 107 bytes a Unix socket allows.
        self.dir = Path(tempfile.mkdtemp(prefix="rh", dir="/tmp"))
        self.ray_token = secrets.token_hex(32)

    @staticmethod
    def check_possible() -> None:
        if sys.platform != "linux":
            raise CannotMakeHosts("network namespaces are Linux's")
        if shutil.which("ip") is None:
            raise CannotMakeHosts("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise CannotMakeHosts("making network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)")

    @staticmethod
    def remove_leftovers() -> None:
        """Namespaces of earlier runs that were killed before their teardown."""
        listed = _ip("netns", "list", check=False).stdout
        for name in re.findall(rf"^({PREFIX}(\d+)-\w+)", listed, flags=re.M):
            ns, pid = name
            if not _alive(int(pid)):
                Host("leftover", ns).stop_everything(grace_s=5)
                _ip("netns", "del", ns, check=False)
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def create(self) -> None:
        self.check_possible()
        self.remove_leftovers()
        try:
            for h in self.all:
                _ip("netns", "add", h.ns)
                # The hostname resolves to loopback on every host (see the module's docstring).
                etc = Path("/etc/netns") / h.ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.0.1\t{socket.gethostname()}\n::1\tlocalhost\n")
                _ip("-n", h.ns, "link", "set", "lo", "up")
        except RuntimeError as e:
            self.destroy()
            raise CannotMakeHosts(f"cannot make network namespaces here: {e}") from None
        t, hd, s = self.trainer.ns, self.head.ns, self.side.ns
        # The trainer's side link first: it becomes eth0, the first interface in any list.
        _ip("link", "add", "eth0", "netns", t, "type", "veth", "peer", "name", "eth0", "netns", s)
        _ip("link", "add", "eth1", "netns", t, "type", "veth", "peer", "name", "eth0", "netns", hd)
        for ns, dev, address in ((t, "eth0", SIDE_TRAINER_ADDRESS), (s, "eth0", SIDE_ADDRESS), (t, "eth1", TRAINER_ADDRESS), (hd, "eth0", HEAD_ADDRESS)):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every process started on these hosts."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ROLLOUT_", "GLOO_", "VLLM_HOST_IP"))}
        env.update(
            # Nothing leaves these namespaces: no model hub, no usage reports.
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def cluster_env(self, **extra: str) -> dict[str, str]:
        """:meth:`env`, plus the Ray cluster's own token: Ray enables token authentication
        wherever ``~/.ray/auth_token`` exists, and this cluster must depend on no file of the
        machine's (nor write one)."""
        return self.env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.ray_token, **extra)

    def start_ray_head(self, env: dict[str, str], num_cpus: int = 4) -> Logged:
        argv = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
            f"--node-ip-address={HEAD_ADDRESS}", f"--port={RAY_PORT}", f"--num-cpus={num_cpus}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.dir / 'ray'}",
        ]  # fmt: skip
        return Logged(self.head, argv, self.dir / "ray-head.log", env)

    def serve(self, config_path: Path, env: dict[str, str]) -> Logged:
        argv = [sys.executable, "-m", "rollout.cli", "serve", "--config", str(config_path), "--address", f"{HEAD_ADDRESS}:{RAY_PORT}"]
        return Logged(self.head, argv, self.dir / "rollout-serve.log", env)

    def trainer_process(self, api_key: str, model_dir: Path, env: dict[str, str]) -> Trainer:
        return Trainer(self.trainer, f"http://{HEAD_ADDRESS}:{HTTP_PORT}", api_key, model_dir, self.dir / "trainer.log", env)

    def destroy(self) -> None:
        for h in self.all:
            h.stop_everything()
        for h in self.all:
            _ip("netns", "del", h.ns, check=False)
            shutil.rmtree(f"/etc/netns/{h.ns}", ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()  # only when empty: nobody else's
        except OSError:
            pass

    def logs(self) -> str:
        """Every log's tail, for a failing test's report."""
        parts = []
        for f in sorted(self.dir.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()
            parts.append(f"---- {f.name} (last 40 lines) ----\n" + "\n".join(lines[-40:]))
        return "\n".join(parts)

    def remove_files(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
