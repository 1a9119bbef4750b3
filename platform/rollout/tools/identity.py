"""Who a ``python`` tool call's processes are on the host.

bubblewrap maps the sandbox's uid (65534) onto the uid that runs bubblewrap. Under a root
tool worker that is kuid 0 without capabilities, and the kernel still treats kuid 0
specially wherever it compares uids instead of checking a capability: owner bits of
``/proc/sys`` and of root's 0400 files, ``RLIMIT_NPROC``. So a root worker never runs
bubblewrap as itself: it leases an unprivileged host uid that nothing else uses
(``tools.python.uid_base`` .. ``+ uid_count``, one per concurrent worker on the node) and
starts bubblewrap under it through util-linux's ``setpriv``. The lease also gives the
kernel's per-user counts (processes, inotify, message queues) a scope of one worker's
calls, and a cleanup nothing inside can dodge: before a call, every process of that uid
is killed (``kill(-1, SIGKILL)`` sent as that uid), whatever an earlier holder left.

A worker that is not root cannot change its uid: its calls run as its own uid (never 0),
and what ends them is the PID namespace (see :mod:`rollout.tools.sandbox`).

Leases are ``flock``\\ s on files in :data:`LEASE_DIR`, held for the worker's life: the
kernel drops them when the worker dies, however it dies, so a restarted worker takes a
free uid (reaped first) and no two live workers of one node share one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

# Shared by every root tool worker on the node (containers that share a node but not this
# directory must be given disjoint uid ranges: docs/security.md's threat model says so).
LEASE_DIR = "/run/rollout-python-uids"


class IdentityUnavailable(RuntimeError):
    """No host uid can be had for the calls; the message names the setting."""


@dataclass(frozen=True)
class CallUser:
    """The host uid and gid the call's processes have, and how they got it."""

    uid: int
    gid: int
    leased: bool  # True: a uid of its own from tools.python.uid_base; False: the worker's own (non-root worker)

    def describe(self) -> str:
        return f"host uid {self.uid} ({'leased for this worker from tools.python.uid_base' if self.leased else 'the tool worker’s own'})"


class CallUsers:
    """Where a worker's calls get their host uid: :meth:`lease` under root, :meth:`own` otherwise."""

    def __init__(self, user: CallUser, setpriv: Optional[str] = None, lock_fd: Optional[int] = None):
        self.user = user
        self._setpriv = setpriv
        self._lock_fd = lock_fd

    @classmethod
    def for_this_process(cls, uid_base: int, uid_count: int) -> "CallUsers":
        return cls.lease(uid_base, uid_count) if os.geteuid() == 0 else cls.own()

    @classmethod
    def own(cls) -> "CallUsers":
        """The worker's own uid. Never root: bubblewrap would map the sandbox onto kuid 0."""
        if os.geteuid() == 0:
            raise IdentityUnavailable("a root tool worker must lease a uid of its own for its calls (tools.python.uid_base)")
        return cls(CallUser(os.geteuid(), os.getegid(), leased=False))

    @classmethod
    def lease(cls, uid_base: int, uid_count: int, lease_dir: str = LEASE_DIR) -> "CallUsers":
        """The first free uid of the range, held until this process ends; reaped before use."""
        if not _mapped(uid_base, uid_count):
            # A rootless container's root: these uids do not exist for it (setresuid would refuse them).
            raise IdentityUnavailable(
                f"uids {uid_base}..{uid_base + uid_count - 1} are not all mapped in this worker's user namespace (uid map: {_uid_map()}): "
                "choose tools.python.uid_base and uid_count inside it"
            )
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise IdentityUnavailable("util-linux's setpriv is not installed (Debian: apt-get install util-linux): a root tool worker needs it to run its calls as an unprivileged uid")
        try:
            os.makedirs(lease_dir, mode=0o700, exist_ok=True)
            st = os.lstat(lease_dir)
        except OSError as e:
            raise IdentityUnavailable(f"cannot make the uid lease directory {lease_dir}: {e}") from None
        if not os.path.isdir(lease_dir) or os.path.islink(lease_dir) or st.st_uid != 0 or st.st_mode & 0o022:
            raise IdentityUnavailable(f"{lease_dir} must be a directory owned by root and writable by root only")
        for uid in range(uid_base, uid_base + uid_count):
            fd = os.open(os.path.join(lease_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a live worker holds it
                raise
            users = cls(CallUser(uid, uid, leased=True), setpriv, fd)
            users.reap()  # whatever a worker that held it before left behind
            return users
        raise IdentityUnavailable(f"all {uid_count} uids from tools.python.uid_base={uid_base} are leased by live tool workers on this node: raise tools.python.uid_count")

    def command_prefix(self) -> list[str]:
        """What runs bubblewrap as the call's user: nothing for the worker's own uid."""
        if not self.user.leased:
            return []
        return [
            self._setpriv, f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip

    def reap(self) -> None:
        """Kill every process of the leased uid (nothing for the worker's own uid: that would
        be the worker). ``kill(-1)`` from a process of that uid reaches exactly its processes,
        in one pass the kernel makes under its task-list lock, so a forking process cannot
        outrun it."""
        if not self.user.leased:
            return
        try:
            subprocess.run(
                ["/bin/sh", "-c", "kill -KILL -1 2>/dev/null; exit 0"],
                user=self.user.uid, group=self.user.gid, extra_groups=[],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, timeout=10, check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            # setresuid refuses a uid that is not mapped in this worker's user namespace.
            raise IdentityUnavailable(f"cannot act as uid {self.user.uid} ({e}): choose tools.python.uid_base inside this worker's uid map ({_uid_map()})") from None

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _mapped(first: int, count: int) -> bool:
    """Whether uids first..first+count-1 all exist in this process's user namespace."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return True  # no user namespaces in this kernel: every uid exists
    return any(inside <= first and first + count <= inside + length for inside, _, length in ranges)


def _uid_map() -> str:
    try:
        with open("/proc/self/uid_map") as f:
            return "; ".join(" ".join(line.split()) for line in f)
    except OSError:
        return "unreadable"
