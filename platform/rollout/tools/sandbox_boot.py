"""Runs first inside the ``python`` tool's sandbox, before the model's code:
``python -I /sandbox/boot.py LIMITS [CODE_PATH]`` with the code at ``/sandbox/main.py``
(or CODE_PATH: the benchmark runs this boot outside a sandbox, as the floor it compares with).

It only sets the per-process limits (rlimits cannot be raised again without a
capability the sandbox does not have) and runs the code. It is no boundary: everything
that isolates the code is the kernel's, set up by bubblewrap around this process (see
:mod:`rollout.tools.sandbox`). Standard library only; nothing here imports ``rollout``.
"""

import json
import resource
import signal
import sys
import traceback


def main() -> None:
    limits = json.loads(sys.argv[1])
    cpu = int(limits["cpu_time_s"])
    # Soft = hard: the kernel's SIGKILL at the limit. This process is its PID namespace's
    # init, and an init ignores a SIGXCPU it has no handler for (the supervisor judges a CPU
    # stop by the time the kernel counted, not by the signal).
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    # Counted per user in the sandbox's own user namespace: a fork bomb stops here.
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails instead of killing
    with open(sys.argv[2] if len(sys.argv) > 2 else "/sandbox/main.py") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.argv = ["main.py"]
    sys.path[0] = "."
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
