"""Stand-ins for the two ends a replica's sync agent talks to, for tests that run the real
coordinator and agents in one process (no Ray): vLLM's engine, recorded, and the
coordinator's Serve handle, answered in-process."""

from __future__ import annotations


class RecordingEngine:
    """Stands in for vLLM's AsyncLLM: records the protocol calls the agent makes (a reload
    loads nothing)."""

    def __init__(self):
        self.calls = []

    async def get_weight_version(self):
        return "0"

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, *args, *kwargs.values()))

        return call


class InProcess:
    """The real coordinator, called in-process the way a Serve handle would."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def __getattr__(self, name):
        return type("Method", (), {"remote": staticmethod(getattr(self.coordinator, name))})
