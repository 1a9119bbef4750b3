"""What every GPU check shares about the machine it runs on: where the check's files and
the built model are (``check.sh`` sets both), and the skip for a machine with too few
GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("ROLLOUT_GPU_WORK", ROOT / "build" / "gpu"))
MODEL = Path(os.environ.get("ROLLOUT_GPU_MODEL", WORK / "model-1.5b"))


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int, why: str = "") -> pytest.MarkDecorator:
    """Skip unless this machine has ``n`` CUDA GPUs; ``why`` says what they are for."""
    return pytest.mark.skipif(
        gpus() < n,
        reason=f"needs {n} CUDA GPUs{why} (this machine has {gpus()}); run tests/gpu/check.sh on a {n}-GPU machine",
    )
