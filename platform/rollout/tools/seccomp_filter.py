"""The seccomp filter of the ``python`` tool's sandbox, compiled by libseccomp.

A deny list on top of the namespaces bubblewrap builds: the calls below either reach
kernel code that untrusted code has no use for and that has a history of privilege
escalations (BPF, keyrings, perf, io_uring, user namespaces), or they act on other
processes (ptrace, ``process_vm_*``, pidfds), or they hold memory outside the limits
(``memfd_create``, System V shared memory), or they draw on kernel pools counted per host
user or shared by the whole node (inotify instances, System V and POSIX message queues and
semaphores). Each is answered with ``EPERM`` so Python raises a readable
``PermissionError`` instead of the process dying; ``clone3`` answers ``ENOSYS`` so the C
library falls back to ``clone``, whose flags the filter can read.

Sockets: only the families a python tool needs, Unix and IP (in the call's own network
namespace); every other family is refused with ``EAFNOSUPPORT``, as a kernel without it
would. ``AF_VSOCK`` matters most: the network namespace does not cover it, and it reaches
the hypervisor (Kata's agent listens there). Netlink, ``AF_ALG`` and packet sockets are
kernel attack surface a tool has no use for.

``prctl(PR_SET_PDEATHSIG)`` is refused: bubblewrap sets it so the call dies with its
supervisor, and the code must not take it back.

System calls of other ABIs (32-bit ``int 0x80`` on x86-64) are not in the filter's
architecture list: libseccomp kills a thread that makes one.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile

logger = logging.getLogger(__name__)

DENIED = (
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "kcmp",
    # namespaces and mounts: the sandbox's layout is final
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",
    # kernel attack surface
    "bpf", "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "lookup_dcookie",
    # the machine itself
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "quotactl_fd", "syslog", "iopl", "ioperm", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "move_pages", "migrate_pages", "uselib", "ustat", "sysfs",
    # memory outside the address-space and tmpfs limits
    "memfd_create", "memfd_secret", "shmget", "shmat",
    # kernel pools charged to a host user or shared by the node: inotify instances and
    # watches, System V message queues and semaphores, POSIX message queues
    "inotify_init", "inotify_init1", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl",
    "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
)

# Socket families a python tool may open: Unix and IP (within its own network namespace).
ALLOWED_SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
PR_SET_PDEATHSIG = 1

# clone(2) flags that would make namespaces of the sandbox's own.
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


class SeccompUnavailable(RuntimeError):
    pass


def compile_filter() -> bytes:
    """The filter as a BPF program, for bubblewrap's ``--seccomp FD``."""
    try:
        import pyseccomp as seccomp  # libseccomp through ctypes: needs libseccomp.so.2
    except (ImportError, OSError) as e:
        raise SeccompUnavailable(f"libseccomp cannot be loaded ({e}): install it (Debian: apt-get install libseccomp2)") from None
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    skipped = []
    for name in DENIED:
        try:
            f.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):  # a call this libseccomp or architecture does not know
            skipped.append(name)
    for flag in CLONE_NAMESPACE_FLAGS.values():
        f.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # An allow list as deny rules on the first argument: every value but the allowed ones
    # (the comparison is on all 64 bits, so no high bits can smuggle a family past it).
    top = max(ALLOWED_SOCKET_FAMILIES.values())
    for call in ("socket", "socketpair"):
        f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.GT, top))
        for family in range(top):
            if family not in ALLOWED_SOCKET_FAMILIES.values():
                f.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, family))
    f.add_rule(seccomp.ERRNO(errno.EPERM), "prctl", seccomp.Arg(0, seccomp.EQ, PR_SET_PDEATHSIG))
    try:
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    except (ValueError, RuntimeError, OSError):
        skipped.append("clone3")
    if skipped:
        logger.info("seccomp: this libseccomp knows no %s here (nothing to deny)", ", ".join(skipped))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a {len(program)}-byte program, not a list of 8-byte BPF instructions")
    return program


def program_fd(program: bytes) -> int:
    """A readable descriptor holding ``program`` (bubblewrap reads it to the end)."""
    fd = os.memfd_create("rollout-seccomp", os.MFD_CLOEXEC)
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
