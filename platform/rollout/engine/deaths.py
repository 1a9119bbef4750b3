"""Engine deaths: the record of each replica whose vLLM engine died, kept where it outlives
the replica.

A replica whose engine died fails Serve's health check and is replaced; everything it
knew goes with it. An engine that dies on every first request (issue 40: vLLM's CPU worker
killed by SIGILL) then restarts in a loop, each replica dying as the one before, and the
operator saw only retries. So the replica that sees its engine die writes why, once, into
the Ray cluster's own key-value store (GCS: it outlives every actor of the app), under the
app's name and its own id; ``rollout serve`` prints each new record as it appears, the
ingress's ``/healthz`` reports them (and fails on a crash loop), and ``rollout status``
shows them from the ingress's gauge.

One key per replica: each replica writes at most one record (its engine dies once), so
writers never race and the count of records is the count of deaths.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

NAMESPACE = "rollout-engine-deaths"
# A crash loop: this many engine deaths within the window. One death is a fault the restart
# repairs; three in ten minutes are a replica that keeps dying the same way.
CRASH_LOOP_DEATHS = 3
CRASH_LOOP_WINDOW_S = 600.0


@dataclass(frozen=True)
class EngineDeath:
    app: str
    replica_id: str
    reason: str  # the engine's last error: what killed it, as far as the replica can tell
    at: float  # time.time() when the replica saw it
    uptime_s: float  # since the replica's engine was ready
    served: int  # requests the engine finished before it died (0: it died on its first)

    def line(self) -> str:
        first = " on its first request" if self.served == 0 else f" after {self.served} requests"
        return f"the engine of replica {self.replica_id} died {self.uptime_s:.0f}s after it started{first}: {self.reason}"


def _key(app: str, replica_id: str) -> bytes:
    return f"{app}/{replica_id}".encode()


def record(death: EngineDeath) -> bool:
    """Write ``death`` (once per replica). False where no Ray cluster is reachable (a unit
    use of the replica): the caller has logged it already."""
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return False
    internal_kv._internal_kv_put(_key(death.app, death.replica_id), json.dumps(asdict(death)).encode(), overwrite=False, namespace=NAMESPACE)
    return True


def read(app: str) -> list[EngineDeath]:
    """Every engine death of ``app`` recorded in this Ray cluster, oldest first."""
    from ray.experimental import internal_kv

    deaths = []
    for key in internal_kv._internal_kv_list(f"{app}/".encode(), namespace=NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if raw is not None:
            deaths.append(EngineDeath(**json.loads(raw)))
    return sorted(deaths, key=lambda d: d.at)


def forget(app: str) -> None:
    """Drop ``app``'s records (a new deployment of it starts with none)."""
    from ray.experimental import internal_kv

    for key in internal_kv._internal_kv_list(f"{app}/".encode(), namespace=NAMESPACE):
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def crash_loop(deaths: Sequence[EngineDeath], now: Optional[float] = None) -> Optional[str]:
    """Why ``deaths`` are a crash loop (None: they are not): at least
    :data:`CRASH_LOOP_DEATHS` within :data:`CRASH_LOOP_WINDOW_S`, with the last one's error."""
    now = time.time() if now is None else now
    recent = [d for d in deaths if now - d.at <= CRASH_LOOP_WINDOW_S]
    if len(recent) < CRASH_LOOP_DEATHS:
        return None
    on_first = sum(1 for d in recent if d.served == 0)
    return (
        f"crash loop: engines of app {recent[-1].app!r} died {len(recent)} times in the last {CRASH_LOOP_WINDOW_S / 60:.0f} minutes "
        f"({on_first} on their first request; {len(deaths)} since it was deployed), and Serve restarts each; "
        f"the last: {recent[-1].line()}"
    )
