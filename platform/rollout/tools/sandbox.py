"""The ``python`` tool's sandbox: the model's code in a child process of its own.

The child (:mod:`rollout.tools.sandbox_boot`) sets its limits and isolation before the code
runs; this side gives it a fresh temporary working directory, a minimal environment and no
stdin, kills its whole process group at the wall-time limit, and reads back at most
``output_chars`` of what it printed (stdout and stderr go to files in the working directory,
capped by the file-size limit, so a print loop fills neither memory nor disk).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Optional

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")


@dataclass(frozen=True)
class SandboxLimits:
    wall_time_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 512 << 20
    file_bytes: int = 16 << 20
    output_chars: int = 4000


@dataclass(frozen=True)
class SandboxResult:
    exit_code: Optional[int]
    stdout: str
    stderr: str
    stopped: Optional[str] = None  # which limit ended the run: "wall time", "CPU time"
    # How the network was closed: "namespace" (a network namespace of its own) or "audit"
    # (the kernel allows no namespace here: the audit hook alone refuses sockets).
    isolation: Optional[str] = None

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


def _read(path: str, limit: int, keep: str = "head") -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(0 if keep == "head" else max(0, size - limit * 4))
            data = f.read(limit * 4)  # UTF-8 is at most 4 bytes a character
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    if len(text) <= limit and len(data) == size:
        return text
    # A traceback's last lines say what went wrong; output's first lines what it did.
    return text[:limit] + "\n[output truncated]" if keep == "head" else "[output truncated]\n" + text[-limit:]


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` under ``limits``; never raises for what the code does."""
    with tempfile.TemporaryDirectory(prefix="rollout-python-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
            # Threads count as processes under RLIMIT_NPROC; math libraries start one per core.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", BOOT, json.dumps(asdict(limits))],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: the wall-time kill takes everything it started
            )
            stopped = None
            try:
                proc.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                stopped = "wall time"
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)  # SIGKILL cannot be caught: the wait is for the kernel to reap it
        code_ = proc.returncode
        if stopped is None and code_ == -signal.SIGXCPU:
            stopped = "CPU time"
        elif stopped is None and code_ == -signal.SIGKILL:
            stopped = "CPU time or memory"  # the hard CPU limit, or the kernel's OOM killer
        return SandboxResult(
            exit_code=None if stopped else code_,
            stdout=_read(out_path, limits.output_chars),
            stderr=_read(err_path, limits.output_chars, keep="tail"),
            stopped=stopped,
            isolation=_read(os.path.join(workdir, ".isolation"), 20) or None,
        )
