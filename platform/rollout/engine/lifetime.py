"""vLLM general plugin (entry point ``vllm.general_plugins``): a vLLM process that another
process started dies with it.

vLLM's engine core is a child of the process that built the engine (an engine replica, a
Ray actor, ``vllm serve``). When that process is killed hard (SIGKILL, ``ray stop
--force``, the OOM killer), nothing tells the engine core: it lives on with parent 1,
ignoring SIGTERM, holding its KV cache and weights (gigabytes; on a GPU, the memory the
replacement replica needs). vLLM's own death pipe covers its workers, which follow the
engine core; nothing covers the engine core itself. vLLM loads general plugins in every
engine and worker process, so here each process that ``multiprocessing`` started asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``).

The same processes write a fatal signal (SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT) to a
file of their own under the fault log directory of the replica that started them
(``ROLLOUT_ENGINE_FAULT_DIR``): vLLM logs only an exit code for a worker that died so, and
its error to the replica names no cause. The replica reads them when its engine dies
(:func:`fatal_errors`), so the death it reports says what killed it (issue 40).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
FAULT_DIR_ENV = "ROLLOUT_ENGINE_FAULT_DIR"
_fault_file = None  # kept open: faulthandler writes to its descriptor when the signal comes


def die_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        # Not started by multiprocessing (a Ray worker, `vllm serve` itself): its lifetime
        # is its supervisor's business.
        return
    log_fatal_signals()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("cannot ask to die with the parent (prctl: errno %d): this vLLM process may outlive it", ctypes.get_errno())
        return
    if os.getppid() != parent.pid:
        # The parent died before the request took effect: no signal will come.
        logger.warning("vLLM process %d: its parent %d is gone; exiting", os.getpid(), parent.pid)
        os.kill(os.getpid(), signal.SIGKILL)


def log_fatal_signals() -> None:
    """Where the replica named a fault log directory: this process's fatal signal, with its
    Python stack, into ``<dir>/<pid>.log``."""
    global _fault_file
    import faulthandler

    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory or _fault_file is not None:
        return
    try:
        _fault_file = open(os.path.join(directory, f"{os.getpid()}.log"), "w")
    except OSError as e:
        logger.warning("cannot open a fault log in %s (%s): a fatal signal of vLLM process %d will not be reported", directory, e, os.getpid())
        return
    faulthandler.enable(_fault_file, all_threads=False)


def fault_dir() -> str:
    """This process's fault log directory, made and exported for the vLLM processes it
    starts (which inherit its environment)."""
    import tempfile

    import atexit
    import shutil

    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        directory = tempfile.mkdtemp(prefix=f"rollout-engine-faults-{os.getpid()}-")
        os.environ[FAULT_DIR_ENV] = directory
        # Removed when the replica's process exits normally (a killed one leaves a few
        # bytes in the temporary directory, as its other temporary files do).
        atexit.register(shutil.rmtree, directory, True)
    return directory


def fatal_errors() -> list[str]:
    """The fatal signals the vLLM processes of this process's engine logged, one line each:
    ``vLLM process PID: Fatal Python error: Illegal instruction (in FILE, line N, in FUNC)``."""
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        try:
            with open(os.path.join(directory, name)) as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        except OSError:
            continue
        fatal = next((line for line in lines if line.startswith("Fatal Python error")), None)
        if fatal is None:
            continue
        frame = next((line for line in lines if line.startswith("File ")), None)
        out.append(f"vLLM process {name.removesuffix('.log')}: {fatal}" + (f" ({frame})" if frame else ""))
    return out
