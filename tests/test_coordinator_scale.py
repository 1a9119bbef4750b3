"""The coordinator-at-scale simulation (rollout.bench.coordinator_scale) keeps working, and
the coordinator's work per round stays linear in its members.

The first test runs the benchmark's harness itself, small: a real coordinator process,
10 real SyncAgents over stub engines, the real WeightPublisher. The second counts the
coordinator's own work (lines it runs, bytes it answers) for one round at two sizes: a
count, not a time, so a loaded machine cannot make it flaky.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
from pathlib import Path

from rollout.bench import coordinator_scale, report
from rollout.contracts.sync_protocol import ParamSpec, PushRound, RoundRequest
from rollout.sync.coordinator import WeightSyncCoordinator

SYNC = Path(coordinator_scale.__file__).resolve().parents[1] / "sync"


def test_the_simulation_drives_real_rounds_catch_up_and_a_stall_that_ends_in_an_abort_then_a_commit_without_them():
    timeout_s, poll_s = 2.0, 1.0
    r = asyncio.run(
        coordinator_scale.simulate(populations=(10,), rounds=2, timeout_s=timeout_s, params=12, idle_s=0.5, poll_s=poll_s)
    )
    (p,) = r["points"]
    # simulate() raises unless every round committed into all 10 and the late replicas caught up.
    assert p["replicas"] == 10 and len(p["rounds"]["round_s"]) == 2 and p["late_replicas"] == 1
    assert p["coordinator_cpu_s"]["median"] > 0 and p["coordinator_sent_kb"] > 0, "the coordinator process did the work"
    stall = p["stall"]
    assert stall["stalled"] == 1
    first = stall["first_round"]
    # The stalled member never reports: the round must not commit without its report, and must
    # end by itself (the publisher's send deadline, 2 x timeout_s, within the round's 3 x).
    assert not first["committed"] and first["decided_s"] <= 3 * timeout_s + 2, first
    assert "did not finish within" in first["error"] or "deadline" in first["error"], first
    # Once the silent replica is dropped (3 polls), a round commits without it.
    assert stall["commit_without_them_s"] is not None and stall["members_at_end"] == 9, stall
    # What docs/benchmarks.md shows comes from this JSON.
    text = "\n".join(report.coordinator_scale(r))
    assert "| 10 |" in text and "1 stalled mid-round: the round aborted after" in text


def _coordinator() -> WeightSyncCoordinator:
    # nccl keeps no weight copy: the round is the members' and the trainer's calls alone.
    return WeightSyncCoordinator({"model": {"path": "/m"}, "metrics": {"enabled": False}, "sync": {"timeout_s": 5, "require_token": False}}, "nccl")


async def _one_round(c: WeightSyncCoordinator, n: int, specs: list[ParamSpec]) -> int:
    """Every call of one committed round with ``n`` members, as their agents make them;
    the bytes of what the coordinator answers them (pickled, as Serve sends it)."""
    sent = 0
    plan = await c.begin_round(None, RoundRequest(tuple(specs), "127.0.0.1", 1))
    for i in range(n):
        mine = await c.next_round(f"r{i}", 0)
        assert isinstance(mine, PushRound) and mine.round_id == plan.round_id
        sent += len(pickle.dumps(mine))
    reports = [asyncio.create_task(c.report(plan.round_id, f"r{i}", None)) for i in range(n)]
    finish = asyncio.create_task(c.finish(None, plan.round_id))
    for outcome in await asyncio.gather(*reports):
        sent += len(pickle.dumps(outcome))
    for i in range(n):
        await c.applied(plan.round_id, f"r{i}", plan.version)
    assert (await finish).committed
    return sent


def _work(n: int) -> tuple[int, int]:
    """(bytecodes of the sync modules run, bytes answered) for one round of ``n``."""
    specs = [ParamSpec(f"w{i}", "float32", (4,)) for i in range(8)]
    ops = 0

    def local(frame, event, arg):
        nonlocal ops
        if event == "opcode":
            ops += 1
        return local

    def tracer(frame, event, arg):
        # Every bytecode, not every line: a comprehension over the members runs on one line.
        if frame.f_code.co_filename.startswith(str(SYNC)):
            frame.f_trace_opcodes = True
            return local
        return None

    async def main() -> int:
        c = _coordinator()
        for i in range(n):
            await c.register(f"r{i}", 1, 0, specs)
        sys.settrace(tracer)
        try:
            return await _one_round(c, n, specs)
        finally:
            sys.settrace(None)

    sent = asyncio.run(main())
    return ops, sent


def test_a_rounds_coordination_grows_linearly_with_its_members():
    """10x the members may cost at most 20x the work (linear is 10x at most: fixed costs
    only lower it); a per-call scan of the members, or the whole member list in every
    member's plan, makes it ~100x."""
    small, large = _work(40), _work(400)
    assert large[0] < 20 * small[0], f"bytecodes run: {small[0]} at 40 members, {large[0]} at 400"
    assert large[1] < 20 * small[1], f"bytes answered: {small[1]} at 40 members, {large[1]} at 400"
