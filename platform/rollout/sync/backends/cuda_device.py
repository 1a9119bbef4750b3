"""Which GPU a trainer-side sender works on."""

from __future__ import annotations

from typing import Sequence

import torch


def sending_device(tensors: Sequence[torch.Tensor], backend: str) -> torch.device:
    """The GPU a sender works on: the one holding the tensors, not the process's current
    device (a trainer that sees several GPUs may keep its weights on any of them).

    With host tensors only, the current device. Tensors spread
    over several GPUs are refused: a silent cross-GPU copy of every step's weights is
    a cost the trainer should choose, not discover.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(f"backend: {backend!r} needs a CUDA device in the publishing process")
    devices = {t.device for t in tensors if t.is_cuda}
    if len(devices) > 1:
        raise ValueError(
            f"backend: {backend!r} sends from one GPU, but the tensors are on {sorted(str(d) for d in devices)}; "
            "move them to one device before publishing"
        )
    if devices:
        return devices.pop()
    return torch.device("cuda", torch.cuda.current_device())
