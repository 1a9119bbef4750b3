"""Runs first in the python tool's child process (``python -I sandbox_boot.py LIMITS``),
before the model's code: limits, isolation, then the code (``main.py`` in the working
directory). Standard library only; nothing here imports ``rollout``.

Layers, each stopping what the others might miss:
- rlimits: CPU seconds (SIGXCPU), address space (a memory bomb gets MemoryError), file
  size (SIGXFSZ ignored, so an oversized write fails instead of killing), no core dumps.
- a network namespace of its own when the kernel allows one (``unshare``): no interface
  but a down loopback, so no connection reaches anything.
- an audit hook (PEP 578, cannot be removed once added) refusing: new processes (fork,
  exec, spawn, system, subprocess), signals, sockets and name lookups, ctypes calls,
  raising rlimits, and any write, delete, rename or mode change outside the working
  directory. For a user other than root, RLIMIT_NPROC also caps processes.
The parent adds the wall-time limit (it kills the process group).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import traceback


def _count_processes_of(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            n += int(line.split()[1]) == uid
                            break
            except OSError:
                pass
    return n


def _isolate_network() -> str:
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            return "namespace"
    except Exception:
        pass
    return "audit"


def _limit(limits: dict, uid: int) -> None:
    cpu = int(limits["cpu_time_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if uid != 0:
        # RLIMIT_NPROC counts every process of the user; the kernel never applies it to
        # root, where the audit hook alone refuses new processes.
        n = _count_processes_of(uid) + 4
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))


def _refuse_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: starting processes is not allowed (_posixsubprocess.fork_exec)")


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_REFUSED = {
    "os.fork": "starting processes",
    "os.forkpty": "starting processes",
    "os.exec": "starting processes",
    "os.posix_spawn": "starting processes",
    "os.spawn": "starting processes",
    "os.system": "starting processes",
    "subprocess.Popen": "starting processes",
    "pty.spawn": "starting processes",
    "os.kill": "sending signals",
    "os.killpg": "sending signals",
    "signal.pthread_kill": "sending signals",
    "socket.__new__": "network access",
    "socket.getaddrinfo": "network access",
    "socket.gethostbyname": "network access",
    "socket.gethostbyaddr": "network access",
    "ctypes.dlopen": "ctypes",
    "ctypes.dlsym": "ctypes",
    "ctypes.call_function": "ctypes",
    "ctypes.cdata": "ctypes",
    "resource.setrlimit": "changing limits",
    "resource.prlimit": "changing limits",
}
# The one way to start a process that raises no audit event of its own: the loaded module's
# function is replaced before the hook goes in, and loading it afresh is refused.
_REFUSED_IMPORTS = {"_posixsubprocess"}
# Events whose first argument is a path the code changes.
_MUTATIONS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink", "os.truncate", "os.utime", "os.chflags", "shutil.rmtree"}


def _install_hook(workdir: str) -> None:
    root = os.path.realpath(workdir)

    def inside(path) -> bool:
        if isinstance(path, int):  # an open descriptor: already allowed when it was opened
            return True
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep)

    def hook(event, args):
        why = _REFUSED.get(event)
        if why is not None:
            raise PermissionError(f"sandbox: {why} is not allowed ({event})")
        if event == "import" and args[0] in _REFUSED_IMPORTS:
            raise PermissionError(f"sandbox: starting processes is not allowed (import {args[0]})")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (mode is None and flags & _WRITE_FLAGS)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed ({os.fsdecode(path)})")
        elif event in _MUTATIONS:
            paths = args[:2] if event in ("os.rename", "os.link") else args[:1]
            if event == "os.symlink":
                paths = args[1:2]  # where the link is made; what it points to is checked when opened
            for path in paths:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: changing files outside the working directory is not allowed ({event} {os.fsdecode(path)})")

    sys.addaudithook(hook)


def main() -> None:
    limits = json.loads(sys.argv[1])
    uid = os.getuid()  # (before a user namespace maps it away)
    with open(".isolation", "w") as f:  # the parent reports it
        f.write(_isolate_network())
    _limit(limits, uid)
    import _posixsubprocess

    _posixsubprocess.fork_exec = _refuse_fork_exec
    workdir = os.getcwd()
    with open(os.path.join(workdir, "main.py")) as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path[0] = workdir
    _install_hook(workdir)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:
        # The model's frames only: this file's frame is noise to it.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
