"""Per-phase wall times of a sync round, so a slow round says where its time went."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import AsyncIterator


class PhaseClock:
    def __init__(self) -> None:
        self.phases: dict[str, float] = {}  # phase -> seconds, in the order they ran
        self.current = ""  # the phase running now (or the last one)

    @asynccontextmanager
    async def __call__(self, phase: str) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        self.current = phase
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    def __str__(self) -> str:
        return ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in self.phases.items())
