"""Several hosts on one machine: Linux network namespaces joined by veth pairs.

    head     eth0 10.231.1.1 ────────── eth1 10.231.1.2   trainer
                                         eth0 10.231.2.1 ────── eth0 10.231.2.2   side

- ``head``: the Ray head and ``rollout serve`` (its HTTP ingress on 0.0.0.0);
- ``trainer``: outside the Ray cluster. Its first interface leads to ``side``, a peer
  with nothing behind it that the head has no route to, so a publisher that picks an
  address by interface order, or is told to use that one, advertises an address the
  replicas cannot reach; its route to the head goes through its second interface.

With ``Hosts(worker=True)`` the Ray hosts and the trainer meet at a switch instead (a Linux
bridge in a namespace of its own, ``net``, with no address), as machines on one network
segment do; the trainer's first interface still leads to ``side``:

    head     eth0 10.231.1.1 ──┐
    worker   eth0 10.231.1.3 ──┤ br0 (in ``net``)
    trainer  eth1 10.231.1.2 ──┘
             eth0 10.231.2.1 ────── eth0 10.231.2.2   side

- ``worker``: a Ray worker node (``ray start --address=10.231.1.1:6379``), one replica.

Every replica asks for ``ENGINE_CPUS`` Ray CPUs (``deployment.num_cpus``, its default) and
each Ray host offers exactly that many (``start_ray_head``/``start_ray_worker``), so a host
holds at most one replica: with two replicas and both hosts up, one runs on each, whatever
the order they start in; with the worker not (yet) up, the second replica waits for it.

:meth:`Hosts.cut` pulls a host's cable: its port on the switch goes down, so the host's
interface loses carrier (``NO-CARRIER``); its address and routes stay, and every packet to
or from it is dropped, not refused (no RST, no ICMP): peers see timeouts.
:meth:`Hosts.mend` plugs it back in.

Every host's hostname resolves to 127.0.0.1 (``ip netns exec`` mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts``), as on machines whose ``/etc/hosts`` maps
it to loopback: anything that advertises the hostname's address to another host fails.
No namespace has a default route, so nothing here can send traffic anywhere but to the
addresses above; the machine's own namespace gets no address and no route.

The hosts share one PID and mount namespace: only the network is theirs. A Ray driver
finds its raylet by listing the machine's processes, so one started on the trainer host
attaches to the head's raylet over its Unix socket, as no pod could: run Ray drivers on
the head (as :meth:`Hosts.replica_nodes` and :meth:`Hosts.deploy` do), or in a pod of their
host (:func:`pod_argv`: PID and mount namespaces of its own) beside a Ray node started there.

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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rollout.local import RAY_WORKER_ENV
from rollout.processes import end

from tests.engines import TEST_MODEL

ROOT = Path(__file__).resolve().parents[1]
# sync.poll_s and sync.silent_polls of every test platform (these hosts' and
# tests/conftest.py's): a replica that stopped polling (killed, its host lost, a test's
# ghost member) is dropped after 6 s; the defaults (5 s x 3) took 15 s, which tests that
# remove a replica waited out. Members of an undecided round are never dropped, and a
# replica stops vouching for the committed version only after as long without an answer:
# a live but busy one keeps about 5 s of slack.
SYNC_POLLING = {"poll_s": 1.0, "silent_polls": 6}
PREFIX = "rollouthosts"
HEAD_ADDRESS, TRAINER_ADDRESS, WORKER_ADDRESS = "10.231.1.1", "10.231.1.2", "10.231.1.3"
SIDE_TRAINER_ADDRESS, SIDE_ADDRESS = "10.231.2.1", "10.231.2.2"
RAY_PORT, HTTP_PORT = 6379, 8000
# Ray CPUs each replica asks for (deployment.num_cpus's default) and each Ray host offers:
# one replica per host (see the module's docstring). Nothing else of the platform reserves
# CPUs (the ingress, the coordinator, Serve's actors and tool workers ask for none).
ENGINE_CPUS = 1
# Ray's own processes, by their command lines (a worker's is its proctitle, ``ray::...``).
RAY_PROCESS = re.compile(r"^ray::|raylet|gcs_server|/ray/(_private|dashboard|autoscaler|core|util)/|default_worker\.py|bin/ray start")
# vLLM's engine core and workers (vllm.utils.system_utils.set_process_title).
ENGINE_PROCESS = re.compile(r"^VLLM::")
# For every ``ray start --block`` here: on SIGTERM, Ray first drains the node and waits up
# to RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (30 s) for it to go idle, which a node holding
# Serve's controller or proxy never does (ray/_private/node.py, _drain_node_before_shutdown).
# Every module's teardown waited that out for each Ray host, then killed ``ray start`` and
# waited again for the agents it left. Nothing here needs the drain (the hosts are torn
# down next): 0 turns it off, and ``ray start`` ends its processes at once.
# Ray's workers at nice 0, as in every platform and test cluster (rollout.local.RAY_WORKER_ENV).
RAY_START_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **RAY_WORKER_ENV}


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


def cmdline(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pod_argv(*argv: str) -> list[str]:
    """``argv`` run as in a pod of its host: in a PID namespace of its own (``argv``'s shell
    is its PID 1; ``ps`` and /proc list only its processes) and a mount namespace with
    private tmpfs on ``/tmp`` and ``/dev/shm`` (a pod's emptyDirs), so a Ray driver there
    finds only a raylet started in the same pod, by its processes and by the files of
    /tmp/ray, as in a pod; its network stays its host's. ``argv`` is a shell command line
    (``sh -c``) and its arguments. When ``unshare`` ends, however (``--kill-child`` is the
    PID 1's parent-death signal, SIGKILL), the PID 1 dies, and with it, by the kernel, every
    other process of the namespace; teardown also finds them by the host's network
    namespace (``ip netns pids``). A checkout under /tmp (a CI clone there) is moved onto the
    pod's /tmp, so its virtualenv is still where the pod's commands name it."""
    mounts = "mount -t tmpfs pod-tmp /tmp && mount -t tmpfs pod-shm /dev/shm && exec sh -c \"$@\""
    if CHECKOUT.startswith("/tmp/"):
        keep = f"mount --bind {CHECKOUT} /mnt && "
        back = f"mkdir -p {CHECKOUT} && mount --move /mnt {CHECKOUT} && "
        mounts = keep + mounts.replace("mount -t tmpfs pod-shm", back + "mount -t tmpfs pod-shm", 1)
    return ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation=private", "sh", "-c", mounts, "pod", *argv]


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Host:
    name: str  # its role: head, worker, trainer, side (net: the switch)
    ns: str
    addresses: list[str] = field(default_factory=list)

    def argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def pids(self) -> list[int]:
        done = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def processes(self, pattern: re.Pattern) -> list[int]:
        """This namespace's processes whose command line matches ``pattern``."""
        return [pid for pid in self.pids() if pattern.search(cmdline(pid))]

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


def last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


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
        end(self.proc, grace_s)
        self._out.close()

    def kill(self) -> None:
        """SIGKILL, for a teardown that needs nothing of the process's own shutdown: a
        module's ``rollout serve``, whose SIGTERM deletes the app and waits out every
        replica's graceful shutdown (about 12 s a module), when the Ray hosts it runs on
        are stopped next and :meth:`Hosts.destroy` then ends whatever is left."""
        self.stop(grace_s=0)


class Trainer:
    """``tests/host_trainer.py`` on the trainer host: one JSON command, one JSON answer."""

    def __init__(self, host: Host, url: str, api_key: str, model_dir: Path, log: Path, env: dict[str, str], argv: list[str] | None = None):
        """``argv``: another command of the same protocol (default tests/host_trainer.py's)."""
        self.log = log
        self._err = open(log, "w")
        argv = host.argv(*(argv or [sys.executable, "-u", "-m", "tests.host_trainer", url, api_key, str(model_dir)]))
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
    """The namespaces above; :meth:`create` and :meth:`destroy` (idempotent).

    ``worker``: also a Ray worker host, and every host on the switch (else the trainer and
    the head are joined directly, as they were first)."""

    def __init__(self, worker: bool = False) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.head = Host("head", f"{tag}-head", [HEAD_ADDRESS])
        self.trainer = Host("trainer", f"{tag}-trainer", [SIDE_TRAINER_ADDRESS, TRAINER_ADDRESS])
        self.side = Host("side", f"{tag}-side", [SIDE_ADDRESS])
        self.worker: Host | None = Host("worker", f"{tag}-worker", [WORKER_ADDRESS]) if worker else None
        self.net: Host | None = Host("net", f"{tag}-net") if worker else None
        self.all = [self.head, self.trainer, self.side] + ([self.worker, self.net] if worker else [])
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
        links = [(t, "eth0", SIDE_TRAINER_ADDRESS), (s, "eth0", SIDE_ADDRESS), (t, "eth1", TRAINER_ADDRESS), (hd, "eth0", HEAD_ADDRESS)]
        if self.net is None:
            _ip("link", "add", "eth1", "netns", t, "type", "veth", "peer", "name", "eth0", "netns", hd)
        else:
            # The switch: a bridge with one port per host, each port named after its host.
            net = self.net.ns
            _ip("-n", net, "link", "add", "br0", "type", "bridge")
            _ip("-n", net, "link", "set", "br0", "up")
            for host, dev in ((self.trainer, "eth1"), (self.head, "eth0"), (self.worker, "eth0")):
                _ip("link", "add", dev, "netns", host.ns, "type", "veth", "peer", "name", host.name, "netns", net)
                _ip("-n", net, "link", "set", host.name, "master", "br0")
                _ip("-n", net, "link", "set", host.name, "up")
            links.append((self.worker.ns, "eth0", WORKER_ADDRESS))
        for ns, dev, address in links:
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def _switch_port(self, host: Host) -> str:
        if self.net is None or host not in (self.head, self.worker, self.trainer):
            raise ValueError(f"{host.name} has no port on a switch (only Hosts(worker=True)'s head, worker and trainer do)")
        return host.name

    def cut(self, host: Host) -> None:
        """Pull ``host``'s cable to the switch: its switch port goes down, the host's
        interface loses carrier and every packet between it and the others is dropped
        (connections time out; nothing is refused). The trainer keeps its side link."""
        _ip("-n", self.net.ns, "link", "set", self._switch_port(host), "down")

    def mend(self, host: Host, within_s: float = 15.0) -> None:
        """Plug ``host``'s cable back in (the bridge forwards at once: no STP), and return
        once ``host`` reaches the others again. Neighbour entries that failed while the
        cable was out would otherwise answer the first connections after it with "No
        route to host" (seen in CI right after a mend): they are flushed on every host, and
        a connection from ``host`` must get through (refused counts: it was answered)."""
        _ip("-n", self.net.ns, "link", "set", self._switch_port(host), "up")
        for h in (self.head, self.worker, self.trainer):
            _ip("-n", h.ns, "neigh", "flush", "all", check=False)
        peer = TRAINER_ADDRESS if host is self.head else HEAD_ADDRESS
        probe = (
            "import socket, sys\n"
            "s = socket.socket(); s.settimeout(1)\n"
            f"try: s.connect(({peer!r}, 9))\n"
            "except ConnectionRefusedError: pass\n"
            "except OSError as e: sys.exit(str(e))\n"
        )
        deadline = time.monotonic() + within_s
        while True:
            done = subprocess.run(host.argv(sys.executable, "-c", probe), capture_output=True, text=True)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.name} does not reach {peer} {within_s:.0f}s after its cable was plugged back in: {done.stderr.strip()[-300:]}")
            time.sleep(0.2)

    def kill_ray(self, host: Host, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every Ray process of ``host`` (raylet, GCS, agents, workers and
        ``ray start``), found by its namespace, until none is left (SIGKILL) or once (any
        other signal): a host's Ray dying, as in a node crash or an OOM kill. vLLM's engine
        processes are left alone: whether they die with their replica is what a test
        checks (:meth:`engine_processes`). Never ``ray stop``: that ends every Ray process
        of the machine, other clusters' included. Returns the pids signalled."""
        signalled: list[int] = []
        deadline = time.monotonic() + 30
        while True:
            pids = [p for p in host.processes(RAY_PROCESS) if not ENGINE_PROCESS.search(cmdline(p))]
            if not pids or (signalled and sig != signal.SIGKILL) or time.monotonic() > deadline:
                return signalled
            for pid in pids:
                try:
                    os.kill(pid, sig)
                    signalled.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def engine_processes(self, host: Host) -> list[int]:
        """vLLM engine core and worker processes running on ``host`` (``VLLM::...``)."""
        return host.processes(ENGINE_PROCESS)

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

    def start_ray_head(self, env: dict[str, str], num_cpus: int = ENGINE_CPUS) -> Logged:
        env = {**env, **RAY_START_ENV}
        argv = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
            f"--node-ip-address={HEAD_ADDRESS}", f"--port={RAY_PORT}", f"--num-cpus={num_cpus}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.dir / 'ray'}",
        ]  # fmt: skip
        return Logged(self.head, argv, self.dir / "ray-head.log", env)

    def start_ray_worker(self, env: dict[str, str], num_cpus: int = ENGINE_CPUS, name: str = "ray-worker") -> Logged:
        """A Ray worker node on the worker host, joining the head by its address with the
        cluster's token (``env``: :meth:`cluster_env`). ``name`` names its log and temp dir
        (a restarted node gets new ones)."""
        if self.worker is None:
            raise ValueError("Hosts(worker=True) has a worker host; these hosts have none")
        env = {**env, **RAY_START_ENV}
        argv = [
            str(Path(sys.executable).with_name("ray")), "start", f"--address={HEAD_ADDRESS}:{RAY_PORT}", "--block",
            f"--node-ip-address={WORKER_ADDRESS}", f"--num-cpus={num_cpus}", "--disable-usage-stats",
            f"--temp-dir={self.dir / name}",
        ]  # fmt: skip
        return Logged(self.worker, argv, self.dir / f"{name}.log", env)

    def serve(self, config_path: Path, env: dict[str, str]) -> Logged:
        argv = [sys.executable, "-m", "rollout.cli", "serve", "--config", str(config_path), "--address", f"{HEAD_ADDRESS}:{RAY_PORT}"]
        return Logged(self.head, argv, self.dir / "rollout-serve.log", env)

    def platform_config(self, model_dir: Path, api_key_file: Path, replicas: int = 1, **sections: dict) -> dict:
        """A ``rollout serve`` config for these hosts: the demo model on CPU as every test
        engine runs (tests/engines.py), HTTP on every address of the head, ``replicas``
        replicas (one per Ray host: ``deployment.num_cpus`` is ``ENGINE_CPUS``);
        ``sections`` merged over it."""
        config = {
            "model": {"path": str(model_dir), "device": "cpu", "dtype": "float32", **TEST_MODEL},
            "deployment": {"replicas": replicas, "num_cpus": ENGINE_CPUS},
            "http": {"host": "0.0.0.0", "port": HTTP_PORT, "api_key_file": str(api_key_file)},
            "metrics": {"enabled": False},
            "sync": dict(SYNC_POLLING),
            # No test on these hosts calls a tool: one tool worker a replica (the default
            # two are a Ray worker process each to start) and no python sandbox to check.
            "tools": {"workers": 1, "python": {"enabled": False}},
        }
        for name, section in sections.items():
            config[name] = {**config.get(name, {}), **section}
        return config

    def api_key_file(self, api_key: str) -> Path:
        """A file holding ``api_key``, for ``http.api_key_file``."""
        path = self.dir / "api-key"
        path.write_text(api_key + "\n")
        return path

    def start_platform(self, config: dict, env: dict[str, str]) -> tuple[Logged, Logged]:
        """The Ray head on the head host, then ``rollout serve`` of ``config`` on it (``env``:
        :meth:`cluster_env`): the two processes, not waited for beyond the head's start. A
        head that does not start fails the test (and is stopped, as is one whose serve
        could not be launched)."""
        import pytest
        import yaml

        config_path = self.dir / "rollout.yaml"
        config_path.write_text(yaml.safe_dump(config))
        head = self.start_ray_head(env)
        try:
            if not head.wait_for("Ray runtime started", 120):
                pytest.fail(f"the Ray head did not start:\n{self.logs()}")
            return head, self.serve(config_path, env)
        except BaseException:
            head.stop(grace_s=30)
            raise

    def replica_nodes(self, env: dict[str, str], app: str = "rollout", deployment: str = "RolloutEngine", timeout_s: float = 60) -> dict[str, str]:
        """Each running replica of ``app``'s ``deployment``: its id (a result's
        ``replica_id``) and the address of the Ray node it runs on, asked of the replica
        itself by a driver on the head host."""
        script = (
            "import json, ray\n"
            f"ray.init(address='{HEAD_ADDRESS}:{RAY_PORT}', logging_level='ERROR', log_to_driver=False)\n"
            f"prefix = 'SERVE_REPLICA::{app}#{deployment}#'\n"
            "out = {}\n"
            "for a in ray.util.list_named_actors(all_namespaces=True):\n"
            "    if a['name'].startswith(prefix):\n"
            "        h = ray.get_actor(a['name'], namespace=a['namespace'])\n"
            "        try:\n"
            "            out[a['name'][len(prefix):]] = ray.get(h.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=20)\n"
            "        except Exception as e:\n"
            "            out[a['name'][len(prefix):]] = f'unreachable: {type(e).__name__}'\n"
            "print('REPLICAS ' + json.dumps(out))\n"
        )
        done = subprocess.run(self.head.argv(sys.executable, "-c", script), capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout_s)
        for line in done.stdout.splitlines():
            if line.startswith("REPLICAS "):
                return json.loads(line[len("REPLICAS "):])
        raise RuntimeError(f"cannot list the replicas (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")

    def deploy(self, config_path: Path, env: dict[str, str], timeout_s: float = 420) -> subprocess.CompletedProcess:
        """Deploy ``config_path`` again from a driver on the head host (as ``serve deploy``
        would), waiting until the app runs: with only the replica count changed, a scale."""
        script = (
            "import ray\n"
            "from rollout.app import deploy\n"
            "from rollout.config import load_config\n"
            f"ray.init(address='{HEAD_ADDRESS}:{RAY_PORT}', namespace='rollout')\n"
            f"deploy(load_config({str(config_path)!r}))\n"
            "print('DEPLOYED')\n"
        )
        with open(self.dir / "deploy.log", "a") as log:
            return subprocess.run(self.head.argv(sys.executable, "-c", script), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout_s)

    def trainer_process(self, api_key: str, model_dir: Path, env: dict[str, str]) -> Trainer:
        return Trainer(self.trainer, f"http://{HEAD_ADDRESS}:{HTTP_PORT}", api_key, model_dir, self.dir / "trainer.log", env)

    def reference_process(self, model_dir: Path, seed: int, prompts: list[list[int]], max_tokens: int, env: dict[str, str]) -> Logged:
        """A fresh vLLM engine on the trainer host with ``seed``'s weights (as
        tests/host_trainer.py publishes them): its greedy tokens, one JSON line at the end
        of its log (:func:`last_json`)."""
        argv = [sys.executable, "-u", "-m", "tests.host_trainer", "--reference", str(model_dir), str(seed), str(self.dir), json.dumps(prompts), str(max_tokens)]
        return Logged(self.trainer, argv, self.dir / f"reference-seed-{seed}.log", env)

    def driver(self, model_dir: Path, seed: int, env: dict[str, str], timeout_s: float = 300) -> dict:
        """A trainer joining the Ray cluster as a driver from the trainer host (``env``
        says how: ``RAY_ADDRESS`` and Ray's token settings) and publishing ``seed``'s
        weights with ``WeightPublisher.connect``; what it printed, and its log."""
        log = self.dir / f"driver-{time.monotonic_ns()}.log"
        argv = [sys.executable, "-u", "-m", "tests.host_trainer", "--driver", str(model_dir), str(seed), str(timeout_s - 10)]
        process = Logged(self.trainer, argv, log, env)
        try:
            process.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        process.stop(grace_s=5)
        text = process.text()
        return {**(last_json(text) or {"error_type": "NoAnswer", "message": f"no answer within {timeout_s:.0f}s"}), "log": text}

    def destroy(self) -> None:
        # Ray's processes first, hard: nothing of a test's Ray is needed any more, and its
        # agents (ray::DashboardAgent, ray::RuntimeEnvAgent) outlive SIGTERM past any grace
        # once their raylet is gone, so a polite stop only waited out stop_everything's
        # grace, host by host. What is left (trainers, reference engines) then gets SIGTERM.
        for h in self.all:
            self.kill_ray(h)
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


def greedy_rollouts(trainer: Trainer, hosts: Hosts, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy rollouts of ``prompts`` from ``trainer`` over HTTP, each of ``max_tokens`` and
    made by one version: the trainer's answer, plus ``version_set`` (the versions seen)."""
    out = trainer.call(op="generate", prompts=prompts, max_tokens=max_tokens)
    assert "tokens" in out, f"{out}\n{hosts.logs()}"
    assert [len(t) for t in out["tokens"]] == [max_tokens] * len(prompts)
    for spans in out["versions"]:
        assert len(spans) == 1 and spans[0][1:] == [0, max_tokens], f"one version made every token: {spans}"
    out["version_set"] = {spans[0][0] for spans in out["versions"]}
    return out


@contextmanager
def made(worker: bool = False) -> Iterator[Hosts]:
    """Fresh hosts for a test module: skips it (pytest.skip, with the reason) where
    namespaces cannot be made; everything is torn down and its files removed when the
    block ends, also on failure."""
    import pytest

    h = Hosts(worker=worker)
    try:
        h.create()
    except CannotMakeHosts as e:
        h.remove_files()
        pytest.skip(str(e))
    try:
        yield h
    finally:
        h.destroy()
        h.remove_files()
