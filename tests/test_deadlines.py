"""Every wait in the platform's code has a deadline: a scan for the calls that can block
forever (``ray.get``, ``.result()``, an awaited event, a thread join, a collective's
``.wait()``). A line passes when it names a timeout itself, or when it is listed below with
what bounds it instead; a new unbounded wait fails here until it gets one or a reason."""

from __future__ import annotations

import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "platform" / "rollout"
# The benchmarks run offline against a platform they start themselves.
SKIPPED = ("bench/",)

WAITS = re.compile(r"ray\.get\(|\.result\(|\.wait\(\)|\.join\(\)")

# (file, code on the line) -> what bounds the wait.
BOUNDED_ELSEWHERE = {
    ("engine/openai_app.py", "await disconnected.wait()"): "set when the forwarded response ends or the caller leaves",
    ("engine/replica.py", "[t.result() for t in tasks]"): "results of tasks the TaskGroup has already finished",
    ("batching.py", "for r in t.result()]"): "results of tasks the TaskGroup has already finished",
    ("sync/sessions.py", "rnd.decided.wait()"): "a round is decided by its deadline at the latest (_enforce_deadline)",
    ("sync/rounds.py", "await rnd.decided.wait()"): "a round is decided by its deadline at the latest (Rounds._enforce_deadline)",
    ("sync/coordinator.py", "await rnd.decided.wait()"): "a round is decided by its deadline at the latest (Rounds._enforce_deadline)",
    ("sync/backends/gloo_group.py", ".broadcast_async(tensor, root).wait()"): "gloo collectives end at the group's timeout (Rendezvous.timeout_s)",
    ("sync/backends/gloo_stream.py", "in_flight[0].wait()"): "gloo collectives end at the group's timeout (Rendezvous.timeout_s)",
    ("sync/backends/gloo_stream.py", "work.wait()"): "gloo collectives end at the group's timeout (Rendezvous.timeout_s)",
    ("client/client.py", "run_coroutine_threadsafe(coro, self.loop).result()"): "the coroutine is a transport call with its own deadline (timeout_s)",
    ("processes.py", "            proc.wait()"): "reaping after SIGKILL, which no process outlasts",
}


def unbounded_waits() -> list[str]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        rel = path.relative_to(SOURCE).as_posix()
        if rel.startswith(SKIPPED):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not WAITS.search(code) or "timeout" in code or "wait_for(" in code or code.strip().startswith(('"""', "'''")):
                continue
            if not any(rel == f and snippet in code for f, snippet in BOUNDED_ELSEWHERE):
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_every_wait_in_the_platform_has_a_deadline_or_a_stated_bound():
    assert unbounded_waits() == [], "a wait without a deadline: give it one, or list what bounds it in BOUNDED_ELSEWHERE"


def test_every_listed_bound_still_matches_code():
    lines = {(p.relative_to(SOURCE).as_posix(), line) for p in SOURCE.rglob("*.py") for line in p.read_text().splitlines()}
    stale = [key for key in BOUNDED_ELSEWHERE if not any(f == key[0] and key[1] in line for f, line in lines)]
    assert stale == []
