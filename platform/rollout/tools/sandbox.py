"""The ``python`` tool's sandbox: the model's code behind kernel boundaries, one per call.

Each call runs under bubblewrap (Debian's ``bubblewrap``; see docs/security.md's threat model
for why that tool and which version) in new user, mount, PID, network, IPC and UTS
namespaces:

- never as host root: uid 65534 inside a user namespace that may not make another one, with
  no capabilities, mapped onto an unprivileged host uid (:mod:`rollout.tools.identity`: a
  root worker leases a uid of its own per worker; another worker uses its own). The probe
  reads that host uid from outside and refuses 0;
- a read-only root holding only what Python needs (``/usr``, the interpreter's prefix and
  virtualenv, the dynamic linker's cache) and a fresh ``/proc`` of the call's own PID
  namespace, with ``/proc/sys`` read-only and the host-kernel information files masked, as
  container runtimes do; a ``/dev`` of ``null``, ``zero``, ``full`` and ``urandom`` only (no
  ptys: they come from a pool the whole node shares);
- a private tmpfs of ``disk_bytes`` as the working directory (``/tmp``), gone when the
  call ends;
- a network namespace with nothing but its own loopback, and no socket family the
  namespace does not cover;
- a seccomp filter (:mod:`rollout.tools.seccomp_filter`), rlimits on CPU time, address
  space, file size, descriptors and processes, and cgroup limits on the whole tree's
  memory (kernel memory included), processes and CPU where the host offers them
  (:mod:`rollout.tools.cgroups`);
- an empty environment.

The code is the PID namespace's first process (``--as-pid-1``): no other process of the
sandbox's uid is in view to be patched through ``/proc/PID/mem``, and when it ends the
kernel kills everything else in the namespace. The supervisor learns its host pid from
bubblewrap (``--info-fd``), holds a pidfd on it and kills it when the call ends, so
nothing the call started outlives it, with or without cgroups; a root worker's leased uid
is also swept with ``kill(-1)`` whenever that could not be confirmed.

The code and the boot script reach the sandbox as read-only files copied from
descriptors; stdout and stderr come back over pipes, capped as they are read, so nothing
the code leaves behind is ever opened by this side. What the model reads back is JSON
whose status fields only this side writes (:meth:`SandboxResult.text`).

:class:`Sandbox` refuses to be built where any of this cannot be had
(:class:`SandboxUnavailable` names what is missing and the setting to change): there is no
weaker mode to fall back to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

from rollout.tools import cgroups
from rollout.tools.identity import CallUsers, IdentityUnavailable
from rollout.tools.seccomp_filter import SeccompUnavailable, compile_filter, program_fd

logger = logging.getLogger(__name__)

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
NOBODY = 65534
NAMESPACES = ("user", "mount", "pid", "network", "ipc", "uts")
WORKDIR = "/tmp"
# Past the call's own limits, what bubblewrap needs in the call's cgroup.
CGROUP_SLACK_BYTES = 64 << 20
CGROUP_SLACK_PROCESSES = 4
DISABLE_HINT = "or set tools.python.enabled=false to offer no python tool"
# Host-kernel information and knobs in /proc, covered as container runtimes cover them
# (runc's masked and read-only paths, and the root-only files a kuid-0 sandbox could read):
# files are covered by an unopenable node, directories by an empty read-only tmpfs.
PROC_MASKED = (
    "kcore", "keys", "key-users", "config.gz", "kallsyms", "iomem", "ioports", "timer_list", "timer_stats", "sched_debug",
    "slabinfo", "vmallocinfo", "pagetypeinfo", "kpageflags", "kpagecount", "kpagecgroup", "latency_stats", "modules",
    "sysrq-trigger", "acpi", "asound", "scsi", "driver", "tty", "bus", "fs", "irq",
)  # fmt: skip
PROC_READ_ONLY = ("sys",)
# The only devices a python program needs.
DEVICES = ("null", "zero", "full", "urandom", "random")


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    max_processes: int = 16
    output_chars: int = 4000


def _cpu_count_slack(limit_s: int) -> float:
    """How far below the limit the CPU time a reaped process reports may lie when the kernel
    stopped it at the limit. RLIMIT_CPU is enforced on the tick-sampled clock, while wait4()
    reports the scheduler's exact run time: on a loaded machine they part. Measured here
    with a 1 s limit beside 40 busy loops on 2 cores: 0.924 to 1.046 s reported for a kill
    at the limit."""
    return max(0.25, 0.1 * limit_s)


@dataclass(frozen=True)
class Isolation:
    """What a tool worker's sandbox was verified to give (by running a probe inside it and
    looking at it from outside)."""

    tool: str  # "bubblewrap 0.8.0"
    namespaces: tuple[str, ...]
    seccomp: bool  # (always True: a sandbox without its filter fails the check)
    cgroups: str  # "v2", "v1" or "none"
    host_uid: int = -1  # the uid the call's processes have on the host, read from outside (never 0)
    uid_leased: bool = False  # a uid of its own (root worker) or the worker's own

    @property
    def label(self) -> str:
        """A short, bounded name: the metrics label and ``rollout status`` column."""
        return f"{self.tool.split()[0]}+seccomp+cgroup-{self.cgroups}"

    def describe(self) -> str:
        who = f"host uid {self.host_uid} ({'leased' if self.uid_leased else 'the worker’s own'})"
        return f"{self.tool}: {', '.join(self.namespaces)} namespaces; {who}; seccomp filter; cgroups {self.cgroups}"


class SandboxUnavailable(RuntimeError):
    """The kernel or the host cannot give the sandbox; the message says what and how to fix it."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: Optional[int]
    stdout: str
    stderr: str
    stopped: Optional[str] = None  # which limit ended the run: "wall time", "CPU time", "memory"
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped is None

    @property
    def status(self) -> str:
        if self.stopped:
            return f"stopped: {self.stopped} limit"
        return "ok" if self.exit_code == 0 else f"exit code {self.exit_code}"

    def text(self, max_chars: Optional[int] = None) -> str:
        """What the model reads back: one JSON object of at most ``max_chars``. Its
        ``status`` (first) and ``truncated`` are written only here; the code's output is a
        JSON string, so no line it prints, no NUL and no terminal escape can pass for them.
        Past ``max_chars`` the longer stream is cut (stdout keeps its head, stderr its tail,
        where a traceback says what went wrong), so the object stays whole."""
        stdout, stderr = self.stdout, self.stderr
        cut = {"stdout": self.stdout_truncated, "stderr": self.stderr_truncated}
        while True:
            out: dict = {"status": self.status, "stdout": stdout}
            if stderr:
                out["stderr"] = stderr
            if any(cut.values()):
                out["truncated"] = [name for name, c in cut.items() if c]
            text = _escape_invisible(json.dumps(out, ensure_ascii=False))
            excess = len(text) - max_chars if max_chars is not None else 0
            if excess <= 0 or not (stdout or stderr):
                return text
            # (escapes make a character cost up to 12 in the text: cut at least what is over)
            if len(stdout) >= len(stderr):
                stdout, cut["stdout"] = stdout[: max(0, len(stdout) - excess - 16)], True
            else:
                stderr, cut["stderr"] = stderr[min(len(stderr), excess + 16) :], True


def _escape_invisible(text: str) -> str:
    """JSON escapes the C0 controls; this escapes the rest a reader cannot see (C1
    controls, bidi and other format characters, line and paragraph separators), which only
    occur inside JSON strings here, so the text stays valid JSON."""
    return "".join(c if c.isprintable() or c in "\n\t" else json.dumps(c)[1:-1] for c in text)


class _Capped:
    """At most ``limit`` bytes of a stream: its head, or its tail (a traceback's last lines
    say what went wrong), and how many bytes there were in all."""

    def __init__(self, limit: int, keep: str):
        self.limit, self.keep = limit, keep
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.keep == "head":
            if len(self.data) < self.limit:
                self.data += chunk[: self.limit - len(self.data)]
        else:
            self.data += chunk
            del self.data[: max(0, len(self.data) - self.limit)]

    def text(self, chars: int) -> tuple[str, bool]:
        """At most ``chars`` characters, and whether anything was cut."""
        text = bytes(self.data).decode("utf-8", errors="replace")
        if len(text) <= chars and self.total == len(self.data):
            return text, False
        return (text[:chars] if self.keep == "head" else text[-chars:]), True


def _top_level_layout() -> list[str]:
    """bubblewrap arguments recreating the host's /bin, /lib, ... (links on merged-/usr systems)."""
    args = []
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _python_paths() -> list[str]:
    """The interpreter's prefix and, when it runs from a virtualenv, the virtualenv (its
    packages are the tool's library); /usr is bound in any case."""
    paths = []
    for prefix in dict.fromkeys([os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), os.path.dirname(os.path.realpath(sys.executable))]):
        if prefix != "/usr" and not prefix.startswith("/usr/") and os.path.isdir(prefix):
            paths.append(prefix)
    if sys.prefix != os.path.realpath(sys.prefix):
        paths.append(sys.prefix)
    return paths


def _open_paths(paths: list[str]) -> dict[str, int]:
    """O_PATH descriptors of ``paths``, opened by the worker. bubblewrap binds them by
    descriptor (``--ro-bind-fd``): the call's unprivileged user need not be able to walk
    to them (an interpreter under root's 0700 home), only to read what is inside."""
    return {p: os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in paths}


def _hint(stderr: str) -> str:
    """The setting to change for what bubblewrap said."""
    s = stderr.lower()
    if "mount proc" in s:  # (before the permission cases: its message ends "Operation not permitted")
        return "a fresh /proc cannot be mounted: the container masks /proc (Kubernetes: procMount: Unmasked, or hostUsers: false)"
    if "no space left on device" in s or "enospc" in s or "max_" in s:
        return "the kernel allows no more user namespaces here: raise the sysctl user.max_user_namespaces (it is 0 or used up)"
    if "can't find source path" in s and "permission denied" in s:
        return (
            "the call's unprivileged user cannot reach that path (bubblewrap opens it as that user): let other users traverse and read it "
            "(chmod o+x on each directory above it, o+rX below), or run the tool worker from a Python installed where any user can read it"
        )
    if "creating new namespace" in s or "uid map" in s or "setting up uid" in s or "operation not permitted" in s or "permission denied" in s:
        return (
            "the kernel refuses this user an unprivileged user namespace: set kernel.unprivileged_userns_clone=1 (Debian) or "
            "kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu), and in a container allow unshare/clone with namespace flags in its "
            "seccomp profile (see docs/kubernetes-tool-sandbox.md)"
        )
    if "seccomp" in s:
        return "the kernel refused the seccomp filter (CONFIG_SECCOMP_FILTER is needed)"
    return "see bubblewrap's message"


class Sandbox:
    """One tool worker's sandbox: checked once when built (:attr:`isolation`), then one
    fresh set of namespaces per :meth:`run`."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        bwrap: str = "bwrap",
        cgroup_mode: str = "auto",
        uid_base: int = 200_000,
        uid_count: int = 256,
        users: Optional[CallUsers] = None,
    ):
        self.limits = limits
        path = shutil.which(bwrap)
        if path is None:
            raise SandboxUnavailable(f"bubblewrap ({bwrap!r}) is not installed: install it (Debian/Ubuntu: apt-get install bubblewrap) or set tools.python.bwrap; {DISABLE_HINT}")
        self.bwrap = path
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxUnavailable(f"{path} does not run: {e}; {DISABLE_HINT}") from None
        m = re.search(r"(\d+)\.(\d+)", version)
        if m is None or (int(m.group(1)), int(m.group(2))) < (0, 8):
            # --disable-userns (0.8) is what keeps the sandbox from making user namespaces of its own.
            raise SandboxUnavailable(f"{path} is {version or 'of an unknown version'}; the sandbox needs bubblewrap 0.8 or later; {DISABLE_HINT}")
        self.version = version
        try:
            self._seccomp = compile_filter()
        except SeccompUnavailable as e:
            raise SandboxUnavailable(f"{e}; {DISABLE_HINT}") from None
        try:
            self._cgroups, cgroup_note = cgroups.optional(cgroup_mode)
        except cgroups.CgroupsUnavailable as e:
            raise SandboxUnavailable(f"tools.python.cgroups=required, but {e}; set tools.python.cgroups=auto to run on rlimits alone, or delegate cgroups to the tool worker") from None
        try:
            self.users = users or CallUsers.for_this_process(uid_base, uid_count)
        except IdentityUnavailable as e:
            raise SandboxUnavailable(f"the calls cannot run as an unprivileged host user: {e}; {DISABLE_HINT}") from None
        if self._cgroups is None:
            # Loud, not silent: the tree's memory is then bounded per process only.
            logger.warning(
                "python tool sandbox without cgroups (%s): a call's memory is bounded per process (%d MiB each, at most %d processes), not as a tree, "
                "and kernel memory is not charged to it; processes still end with the call (its PID namespace). Set tools.python.cgroups=required to refuse this.",
                cgroup_note, limits.memory_bytes >> 20, limits.max_processes,
            )  # fmt: skip
        logger.info("python tool sandbox: %s, %s, calls as %s", version, cgroup_note, self.users.user.describe())
        with open(BOOT, "rb") as f:
            self._boot = f.read()
        self._layout = _top_level_layout()
        self._python = _open_paths(_python_paths())
        self._proc = _proc_covers()
        self.isolation = self._probe()

    def close(self) -> None:
        """Give the worker's uid lease back (the kernel does when the process ends in any case)."""
        self.users.close()
        for fd in self._python.values():
            os.close(fd)
        self._python = {}

    # ---- one call -----------------------------------------------------------------

    def _command(self, fds: dict[str, int], limits: SandboxLimits, program: str) -> list[str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": WORKDIR,
            "TMPDIR": WORKDIR,
            "LANG": "C.UTF-8",
            # Threads count as processes under RLIMIT_NPROC; math libraries start one per core.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        cmd = [*self.users.command_prefix(), self.bwrap]
        cmd += ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--disable-userns"]
        # The code is the namespace's init: no reaper of bubblewrap's beside it to be patched
        # through /proc/1/mem, and the whole namespace dies with it.
        cmd += ["--as-pid-1", "--info-fd", str(fds["info"]), "--block-fd", str(fds["gate"])]
        cmd += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
        cmd += ["--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
        cmd += ["--ro-bind", "/usr", "/usr", *self._layout]
        if os.path.exists("/etc/ld.so.cache"):
            cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        cmd += ["--proc", "/proc", *self._proc]
        cmd += ["--tmpfs", "/dev"]
        for name in DEVICES:
            if os.path.exists(f"/dev/{name}"):
                cmd += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
        cmd += ["--symlink", "/proc/self/fd", "/dev/fd", "--remount-ro", "/dev"]
        cmd += ["--size", str(limits.disk_bytes), "--perms", "0700", "--tmpfs", WORKDIR, "--chdir", WORKDIR]
        # The interpreter after the working directory: bubblewrap mounts in order, and a
        # virtualenv under /tmp (a checkout there) would otherwise be hidden by the tmpfs
        # ("execvp .../python3: No such file or directory"): bound on top, read-only.
        for path, fd in self._python.items():
            cmd += ["--ro-bind-fd", str(fd), path]
        cmd += ["--ro-bind-data", str(fds["boot"]), "/sandbox/boot.py", "--ro-bind-data", str(fds["code"]), "/sandbox/main.py"]
        cmd += ["--seccomp", str(fds["seccomp"]), "--remount-ro", "/"]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        cmd += [sys.executable, "-I", "-B", "-X", "utf8", program, json.dumps(asdict(limits))]
        return cmd

    def run(self, code: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
        """Run ``code``; never raises for what the code does."""
        result, _ = self._run(code, limits or self.limits, "/sandbox/boot.py")
        return result

    def _run(self, code: str, limits: SandboxLimits, program: str, watch=None) -> tuple[SandboxResult, object]:
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
        fds = {
            "boot": program_fd(self._boot),
            "code": program_fd(code.encode("utf-8", errors="surrogatepass")),
            "seccomp": program_fd(self._seccomp),
            "info": info_w,
            "gate": gate_r,
        }
        group = None
        try:
            cmd = self._command(fds, limits, program)
            if self._cgroups is not None:
                group = cgroups.CallGroup(
                    self._cgroups,
                    cgroups.CgroupLimits(
                        memory_bytes=limits.memory_bytes + limits.disk_bytes + CGROUP_SLACK_BYTES, max_processes=limits.max_processes + CGROUP_SLACK_PROCESSES
                    ),
                )
            return self._supervise(cmd, fds, info_r, gate_w, limits, group, watch)
        finally:
            # (the pipes' child ends are gone from fds: closed once the child had them)
            for fd in (*fds.values(), info_r, gate_w):
                os.close(fd)
            if group is not None:
                group.close()

    def _supervise(self, cmd: list[str], fds: dict[str, int], info_r: int, gate_w: int, limits: SandboxLimits, group, watch) -> tuple[SandboxResult, object]:
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=[*fds.values(), *self._python.values()],
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,  # its own process group: the wall-time kill takes everything it started
            )
        finally:
            # The pipes' other ends are the child's alone: EOF on info once bubblewrap has
            # written where the sandbox is.
            os.close(fds.pop("info"))
            os.close(fds.pop("gate"))
        cap = limits.output_chars * 4  # UTF-8 is at most 4 bytes a character
        out, err, info = _Capped(cap, "head"), _Capped(cap, "tail"), _Capped(4096, "head")
        init = _NamespaceInit()
        stopped, watched = None, None
        deadline = time.monotonic() + limits.wall_time_s
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ, out)
                sel.register(proc.stderr, selectors.EVENT_READ, err)
                sel.register(info_r, selectors.EVENT_READ, info)
                while sel.get_map():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        stopped = "wall time"
                        break
                    for key, _ in sel.select(timeout=left):
                        chunk = os.read(key.fd, 65536)
                        if chunk:
                            key.data.add(chunk)
                        else:
                            sel.unregister(key.fileobj)
                            if key.data is info:
                                init.open(bytes(info.data), proc.pid)
                                self._open_gate(init, group, gate_w)
                    if watch is not None and watched is None and init.pid is not None:
                        watched = watch(init.pid, bytes(out.data))
                        if watched is not None:
                            break
        finally:
            # The namespace's init first: its death takes every process the call started.
            ended = init.kill()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(proc.pid, 0)  # SIGKILL cannot be caught: the wait is for the kernel to reap it
            proc.returncode = os.waitstatus_to_exitcode(status)
            proc.stdout.close()
            proc.stderr.close()
            if not ended:
                # The namespace was not seen to end (bubblewrap failed before it said where
                # it was, or the kill was not confirmed): sweep the leased uid.
                self.users.reap()
        code = proc.returncode
        cpu_s = usage.ru_utime + usage.ru_stime  # the sandbox's init and all it waited for
        # bubblewrap answers a child killed by signal N with 128 + N. Which limit stopped it
        # is judged from what the kernel counted, not from an exit code the code can choose.
        if stopped is None and group is not None and group.out_of_memory():
            stopped = "memory"
        elif stopped is None and code in (-signal.SIGXCPU, 128 + signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGKILL):
            if cpu_s >= limits.cpu_time_s - _cpu_count_slack(limits.cpu_time_s):
                stopped = "CPU time"
            elif code in (-signal.SIGKILL, 128 + signal.SIGKILL):
                stopped = "CPU time or memory"  # the kernel's OOM killer where no cgroup says which
        stdout, out_cut = out.text(limits.output_chars)
        stderr, err_cut = err.text(limits.output_chars)
        result = SandboxResult(exit_code=None if stopped else code, stdout=stdout, stderr=stderr, stopped=stopped, stdout_truncated=out_cut, stderr_truncated=err_cut)
        return result, watched

    @staticmethod
    def _open_gate(init: "_NamespaceInit", group, gate_w: int) -> None:
        """Let the sandbox go on (bubblewrap waits on ``--block-fd`` before it runs the code),
        once it is in the call's cgroups: moved there while nothing but its init exists,
        everything it starts is counted from its first instruction. Where it cannot be
        moved, the gate stays shut and the init is killed: no call runs outside its group."""
        if group is not None:
            if init.pid is None or not group.join(init.pid):
                init.kill()
                return
        os.write(gate_w, b"1")

    # ---- the check when built ------------------------------------------------------

    def _probe(self) -> Isolation:
        """Run a check inside a sandbox, verify each boundary from inside and what cannot be
        trusted from inside (the host uid, the mounts) from outside; raise
        SandboxUnavailable naming what failed."""
        limits = SandboxLimits(wall_time_s=30, output_chars=20_000)

        def outside(pid: int, stdout: bytes) -> Optional[dict]:
            if b"\n" not in stdout:
                return None  # the probe has not reported yet: it is then still running, as itself
            return _seen_from_outside(pid)

        result, host = self._run(_PROBE, limits, "/sandbox/main.py", watch=outside)
        if host is None or not result.stdout.strip():
            said = (result.stderr or result.stdout or f"exit code {result.exit_code}, stopped {result.stopped}").strip()
            raise SandboxUnavailable(f"bubblewrap cannot build the sandbox here ({said[-800:]}): {_hint(said)}; {DISABLE_HINT}")
        try:
            seen = json.loads(result.stdout.strip().splitlines()[0])
        except (json.JSONDecodeError, IndexError):
            raise SandboxUnavailable(f"the sandbox's probe printed {result.stdout[-400:]!r}, not its report") from None
        wrong = []
        user = self.users.user
        if host["uids"] is None or 0 in host["uids"] or 0 in host["gids"]:
            wrong.append(f"runs as host uid/gid {host['uids']}/{host['gids']} (root: the kernel exempts kuid 0 from checks a sandbox relies on; a root tool worker leases tools.python.uid_base)")
        elif set(host["uids"]) != {user.uid}:
            wrong.append(f"runs as host uids {host['uids']}, not the call's uid {user.uid}")
        if not host["proc_sys_read_only"]:
            wrong.append("can write /proc/sys (the host kernel's global knobs)")
        if seen["uid"] != NOBODY or seen["euid"] != NOBODY:
            wrong.append(f"runs as uid {seen['uid']} inside, not {NOBODY}")
        if seen["cap_eff"] != 0:
            wrong.append(f"has capabilities {seen['cap_eff']:#x}")
        if seen["seccomp"] != 2:
            wrong.append(f"seccomp mode is {seen['seccomp']}, not 2 (filter)")
        if seen["interfaces"] != ["lo"]:
            wrong.append(f"sees network interfaces {seen['interfaces']}")
        if seen["host_pids"]:
            wrong.append(f"sees processes {seen['host_pids']} beyond its own")
        if seen["root_writable"]:
            wrong.append("can write its root")
        if seen["proc_sys_writable"]:
            wrong.append(f"can open {seen['proc_sys_writable']} for writing")
        if seen["readable"]:
            wrong.append(f"can read host-kernel information {seen['readable']}")
        if seen["sockets"]:
            wrong.append(f"can open sockets of families {seen['sockets']} (only Unix and IP are allowed)")
        if seen["pools"]:
            wrong.append(f"can draw on shared kernel pools: {seen['pools']}")
        if not seen["userns_refused"]:
            wrong.append("can make a user namespace of its own")
        if seen["hostname"] != "sandbox":
            wrong.append(f"has the host's name {seen['hostname']!r}")
        if seen["pid"] != 1:
            wrong.append(f"is pid {seen['pid']}, not its namespace's init")
        if wrong:
            raise SandboxUnavailable(f"the sandbox does not hold here: it {'; '.join(wrong)}; {DISABLE_HINT}")
        return Isolation(
            tool=self.version,
            namespaces=NAMESPACES,
            seccomp=True,
            cgroups=self._cgroups.version if self._cgroups else "none",
            host_uid=user.uid,
            uid_leased=user.leased,
        )


class _NamespaceInit:
    """The call's PID-namespace init (the code), held by a pidfd from when bubblewrap says
    where it is: killing it ends the namespace and everything in it."""

    def __init__(self):
        self.pid: Optional[int] = None
        self._fd: Optional[int] = None

    def open(self, info: bytes, bwrap_pid: int) -> None:
        try:
            pid = int(json.loads(info)["child-pid"])
            fd = os.pidfd_open(pid)
        except (ValueError, KeyError, TypeError, OSError):
            return  # bubblewrap said nothing (it failed first), or the child is already gone
        # The pid could have been reused between bubblewrap's word and the pidfd: it is
        # ours only while it is bubblewrap's child and the init of a namespace of its own.
        status = _status(pid)
        # (setpriv, where it runs, becomes bubblewrap: same pid, so the init is its child.)
        if status.get("PPid") != str(bwrap_pid) or status.get("NSpid", "").split()[-1:] != ["1"]:
            os.close(fd)
            return
        self.pid, self._fd = pid, fd

    def kill(self) -> bool:
        """SIGKILL the init and wait for the namespace to be gone; False where that was not seen."""
        if self._fd is None:
            return False
        try:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already ended (its namespace with it)
        except OSError:
            return False
        try:
            # Readable once the init has exited, which the kernel lets happen only after
            # every other process of the namespace is gone.
            ready, _, _ = select.select([self._fd], [], [], 10)
            return bool(ready)
        finally:
            os.close(self._fd)
            self._fd = None


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}
    except OSError:
        return {}


def _seen_from_outside(pid: int) -> dict:
    """What the host sees of the sandboxed process: its host uids and gids, and whether its
    /proc/sys is mounted read-only."""
    status = _status(pid)
    uids = [int(x) for x in status["Uid"].split()] if "Uid" in status else None
    gids = [int(x) for x in status["Gid"].split()] if "Gid" in status else None
    read_only = False
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[4] == "/proc/sys":
                    read_only = "ro" in fields[5].split(",")  # the last mount there is the one in force
    except OSError:
        pass
    return {"uids": uids, "gids": gids, "proc_sys_read_only": read_only}


def _proc_covers() -> list[str]:
    """bubblewrap arguments covering the fresh /proc's host-kernel files (those this kernel has)."""
    args = []
    for name in PROC_READ_ONLY:
        if os.path.exists(f"/proc/{name}"):
            args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args


# Run as the sandbox's program (no boot script, no rlimits): reports what it can see and
# do, then waits to be looked at from outside (the supervisor kills it).
_PROBE = r"""
import ctypes, json, os, socket, sys, time
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
try:
    open("/probe", "w").close(); root_writable = True
except OSError:
    root_writable = False
libc = ctypes.CDLL(None, use_errno=True)
userns_refused = libc.unshare(0x10000000) != 0
proc_sys_writable = []
for p in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/pid_max", "/proc/sys/kernel/msgmax", "/proc/sys/fs/file-max"):
    try:
        os.close(os.open(p, os.O_WRONLY)); proc_sys_writable.append(p)
    except OSError:
        pass
readable = []
for p in ("/proc/kcore", "/proc/keys", "/proc/config.gz", "/proc/slabinfo", "/proc/timer_list", "/proc/vmallocinfo", "/proc/kpageflags", "/proc/iomem", "/proc/kallsyms"):
    try:
        with open(p, "rb") as f:
            f.read(1) and readable.append(p)
    except OSError:
        pass
sockets = []
for family in (16, 17, 38, 40, 31, 4):  # netlink, packet, alg, vsock, bluetooth, ipx
    try:
        socket.socket(family, socket.SOCK_DGRAM).close(); sockets.append(family)
    except OSError:
        pass
pools = []
if libc.inotify_init1(0) >= 0: pools.append("inotify")
if libc.msgget(0, 0o1600) >= 0: pools.append("System V message queues")
if libc.semget(0, 1, 0o1600) >= 0: pools.append("System V semaphores")
if os.path.exists("/dev/ptmx") or os.path.exists("/dev/pts"): pools.append("ptys")
interfaces = [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]]
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(), "pid": os.getpid(),
    "cap_eff": int(status["CapEff"].strip(), 16),
    "seccomp": int(status["Seccomp"].strip()),
    "interfaces": interfaces,
    "host_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()),
    "root_writable": root_writable,
    "proc_sys_writable": proc_sys_writable,
    "readable": readable,
    "sockets": sockets,
    "pools": pools,
    "userns_refused": userns_refused,
    "hostname": socket.gethostname(),
}), flush=True)
time.sleep(25)
"""
