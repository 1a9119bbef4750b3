"""The ``python`` tool's sandbox: the model's code behind kernel boundaries, one per call.

Each call runs under bubblewrap (Debian's ``bubblewrap``; see the README's threat model
for why that tool) in new user, mount, PID, network, IPC and UTS namespaces:

- an unprivileged uid (65534) in a user namespace that may not make another one, with no
  capabilities;
- a read-only root holding only what Python needs (``/usr``, the interpreter's prefix and
  virtualenv, the dynamic linker's cache) and a fresh ``/proc`` of the call's own PID
  namespace, so no host process, environment or memory is in view;
- a private tmpfs of ``disk_bytes`` as the working directory (``/tmp``), gone when the
  call ends; ``/dev`` read-only;
- a network namespace with nothing but its own loopback;
- a seccomp filter (:mod:`rollout.tools.seccomp_filter`), rlimits on CPU time, address
  space, file size, descriptors and processes, and cgroup limits on the whole tree's
  memory, processes and CPU where the host offers them (:mod:`rollout.tools.cgroups`);
- an empty environment.

The code and the boot script reach the sandbox as read-only files copied from
descriptors; stdout and stderr come back over pipes, capped as they are read, so
nothing the code leaves behind is ever opened by this side. At the wall-time limit the
whole process group is killed; when bubblewrap's init dies the kernel kills the rest of
the PID namespace.

:class:`Sandbox` refuses to be built where any of this cannot be had
(:class:`SandboxUnavailable` names what is missing and the setting to change): there is no
weaker mode to fall back to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

from rollout.tools import cgroups
from rollout.tools.seccomp_filter import SeccompUnavailable, compile_filter, program_fd

logger = logging.getLogger(__name__)

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
NOBODY = 65534
NAMESPACES = ("user", "mount", "pid", "network", "ipc", "uts")
WORKDIR = "/tmp"
# Past the call's own limits, what bubblewrap and its init need in the call's cgroup.
CGROUP_SLACK_BYTES = 64 << 20
CGROUP_SLACK_PROCESSES = 4
DISABLE_HINT = "or set tools.python.enabled=false to offer no python tool"


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20
    max_processes: int = 16
    output_chars: int = 4000


@dataclass(frozen=True)
class Isolation:
    """What a tool worker's sandbox was verified to give (by running a probe inside it)."""

    tool: str  # "bubblewrap 0.8.0"
    namespaces: tuple[str, ...]
    seccomp: bool  # (always True: a sandbox without its filter fails the check)
    cgroups: str  # "v2", "v1" or "none"

    @property
    def label(self) -> str:
        """A short, bounded name: the metrics label and ``rollout status`` column."""
        return f"{self.tool.split()[0]}+seccomp+cgroup-{self.cgroups}"

    def describe(self) -> str:
        return f"{self.tool}: {', '.join(self.namespaces)} namespaces; seccomp filter; cgroups {self.cgroups}"


class SandboxUnavailable(RuntimeError):
    """The kernel or the host cannot give the sandbox; the message says what and how to fix it."""


@dataclass(frozen=True)
class SandboxResult:
    exit_code: Optional[int]
    stdout: str
    stderr: str
    stopped: Optional[str] = None  # which limit ended the run: "wall time", "CPU time", "memory"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.stopped is None

    def text(self) -> str:
        """What the model reads back: its output, then what went wrong."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(self.stderr)
        if self.stopped:
            parts.append(f"[stopped: {self.stopped} limit]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts)


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

    def text(self, chars: int) -> str:
        text = bytes(self.data).decode("utf-8", errors="replace")
        if len(text) <= chars and self.total == len(self.data):
            return text
        return text[:chars] + "\n[output truncated]" if self.keep == "head" else "[output truncated]\n" + text[-chars:]


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


def _python_binds() -> list[str]:
    """The interpreter's prefix and, when it runs from a virtualenv, the virtualenv (its
    packages are the tool's library), read-only; /usr is bound in any case."""
    args = []
    for prefix in dict.fromkeys([os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), os.path.dirname(os.path.realpath(sys.executable))]):
        if prefix != "/usr" and not prefix.startswith("/usr/") and os.path.isdir(prefix):
            args += ["--ro-bind", prefix, prefix]
    if sys.prefix != os.path.realpath(sys.prefix):
        args += ["--ro-bind", sys.prefix, sys.prefix]
    return args


def _hint(stderr: str) -> str:
    """The setting to change for what bubblewrap said."""
    s = stderr.lower()
    if "mount proc" in s:  # (before the permission cases: its message ends "Operation not permitted")
        return "a fresh /proc cannot be mounted: the container masks /proc (Kubernetes: procMount: Unmasked, or hostUsers: false)"
    if "no space left on device" in s or "enospc" in s or "max_" in s:
        return "the kernel allows no more user namespaces here: raise the sysctl user.max_user_namespaces (it is 0 or used up)"
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

    def __init__(self, limits: SandboxLimits = SandboxLimits(), bwrap: str = "bwrap", cgroup_mode: str = "auto"):
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
        logger.info("python tool sandbox: %s, %s", version, cgroup_note)
        with open(BOOT, "rb") as f:
            self._boot = f.read()
        self._layout = _top_level_layout()
        self._python = _python_binds()
        self.isolation = self._probe()

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
        cmd = [self.bwrap]
        cmd += ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--disable-userns"]
        cmd += ["--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
        cmd += ["--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
        cmd += ["--ro-bind", "/usr", "/usr", *self._layout]
        if os.path.exists("/etc/ld.so.cache"):
            cmd += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        cmd += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        cmd += ["--size", str(limits.disk_bytes), "--perms", "0700", "--tmpfs", WORKDIR, "--chdir", WORKDIR]
        # The interpreter after the working directory: bubblewrap mounts in order, and a
        # virtualenv under /tmp (a checkout there) would otherwise be hidden by the tmpfs
        # ("execvp .../python3: No such file or directory"): bound on top, read-only.
        cmd += self._python
        cmd += ["--ro-bind-data", str(fds["boot"]), "/sandbox/boot.py", "--ro-bind-data", str(fds["code"]), "/sandbox/main.py"]
        cmd += ["--seccomp", str(fds["seccomp"]), "--remount-ro", "/"]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        cmd += [sys.executable, "-I", "-B", "-X", "utf8", program, json.dumps(asdict(limits))]
        return cmd

    def run(self, code: str, limits: Optional[SandboxLimits] = None) -> SandboxResult:
        """Run ``code``; never raises for what the code does."""
        return self._run(code, limits or self.limits, "/sandbox/boot.py")

    def _run(self, code: str, limits: SandboxLimits, program: str) -> SandboxResult:
        fds = {"boot": program_fd(self._boot), "code": program_fd(code.encode("utf-8", errors="surrogatepass")), "seccomp": program_fd(self._seccomp)}
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
                # The shell joins the call's groups, then becomes bubblewrap: everything the
                # sandbox starts is counted there from its first instruction.
                join = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
                cmd = ["/bin/sh", "-c", join, "sh", *group.procs_files, "--", *cmd]
            return self._supervise(cmd, list(fds.values()), limits, group)
        finally:
            for fd in fds.values():
                os.close(fd)
            if group is not None:
                group.close()

    def _supervise(self, cmd: list[str], pass_fds: list[int], limits: SandboxLimits, group) -> SandboxResult:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,  # its own process group: the wall-time kill takes everything it started
        )
        cap = limits.output_chars * 4  # UTF-8 is at most 4 bytes a character
        out, err = _Capped(cap, "head"), _Capped(cap, "tail")
        stopped = None
        deadline = time.monotonic() + limits.wall_time_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
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
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)  # SIGKILL cannot be caught: the wait is for the kernel to reap it
        proc.stdout.close()
        proc.stderr.close()
        code = proc.returncode
        # bubblewrap answers a child killed by signal N with 128 + N.
        if stopped is None and group is not None and group.out_of_memory():
            stopped = "memory"
        elif stopped is None and code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            stopped = "CPU time"
        elif stopped is None and code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            stopped = "CPU time or memory"  # the hard CPU limit, or the kernel's OOM killer
        return SandboxResult(
            exit_code=None if stopped else code,
            stdout=out.text(limits.output_chars),
            stderr=err.text(limits.output_chars),
            stopped=stopped,
        )

    # ---- the check when built ------------------------------------------------------

    def _probe(self) -> Isolation:
        """Run a check inside a sandbox and verify each boundary from inside; raise
        SandboxUnavailable naming what failed."""
        limits = SandboxLimits(wall_time_s=30, output_chars=20_000)
        result = self._run(_PROBE, limits, "/sandbox/main.py")
        if result.exit_code != 0 or not result.stdout.strip():
            said = (result.stderr or result.stdout or f"exit code {result.exit_code}, stopped {result.stopped}").strip()
            raise SandboxUnavailable(f"bubblewrap cannot build the sandbox here ({said[-800:]}): {_hint(said)}; {DISABLE_HINT}")
        try:
            seen = json.loads(result.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise SandboxUnavailable(f"the sandbox's probe printed {result.stdout[-400:]!r}, not its report") from None
        wrong = []
        if seen["uid"] != NOBODY or seen["euid"] != NOBODY:
            wrong.append(f"runs as uid {seen['uid']}, not {NOBODY}")
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
        if not seen["userns_refused"]:
            wrong.append("can make a user namespace of its own")
        if seen["hostname"] != "sandbox":
            wrong.append(f"has the host's name {seen['hostname']!r}")
        if wrong:
            raise SandboxUnavailable(f"the sandbox does not hold here: it {'; '.join(wrong)}; {DISABLE_HINT}")
        return Isolation(tool=self.version, namespaces=NAMESPACES, seccomp=True, cgroups=self._cgroups.version if self._cgroups else "none")


# Run as the sandbox's program (no boot script, no rlimits): reports what it can see and do.
_PROBE = r"""
import ctypes, json, os, socket
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
try:
    open("/probe", "w").close(); root_writable = True
except OSError:
    root_writable = False
libc = ctypes.CDLL(None, use_errno=True)
userns_refused = libc.unshare(0x10000000) != 0
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(),
    "cap_eff": int(status["CapEff"].strip(), 16),
    "seccomp": int(status["Seccomp"].strip()),
    "interfaces": [n for _, n in socket.if_nameindex()],
    "host_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) > 8),
    "root_writable": root_writable,
    "userns_refused": userns_refused,
    "hostname": socket.gethostname(),
}))
"""
