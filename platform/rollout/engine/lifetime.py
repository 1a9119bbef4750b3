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
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        # Not started by multiprocessing (a Ray worker, `vllm serve` itself): its lifetime
        # is its supervisor's business.
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("cannot ask to die with the parent (prctl: errno %d): this vLLM process may outlive it", ctypes.get_errno())
        return
    if os.getppid() != parent.pid:
        # The parent died before the request took effect: no signal will come.
        logger.warning("vLLM process %d: its parent %d is gone; exiting", os.getpid(), parent.pid)
        os.kill(os.getpid(), signal.SIGKILL)
