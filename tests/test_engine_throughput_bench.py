"""The throughput benchmark's schedule: paths take turns batch by batch, each first equally
often, and a round's rate is its batches' tokens over their summed wall time."""

from __future__ import annotations

from rollout.bench import engine_throughput as et


def test_paths_take_turns_batch_by_batch_and_each_leads_equally_often(monkeypatch):
    monkeypatch.setattr(et, "QUIET_S", 0.0)
    calls: list[str] = []
    wall = {"bare": 1.0, "handle": 1.25, "http": 2.0}

    def path(name):
        def fn(requests):
            calls.append(name)
            return len(requests) * et.MAX_TOKENS, wall[name]

        return fn

    fns = {name: path(name) for name in wall}
    n, rounds = 64, 3
    batches = et.batches_per_round(n)
    assert batches > 1  # the case where turns within a round matter
    rates, cpu = et._interleaved(fns, n, rounds)

    timed = calls[len(fns):]  # after one warm-up batch per path
    assert len(timed) == rounds * batches * len(fns)
    turns = [timed[i : i + len(fns)] for i in range(0, len(timed), len(fns))]
    # Every turn runs each path once; the leading path rotates, so no path always follows
    # the same one.
    assert all(sorted(t) == sorted(fns) for t in turns)
    leads = [t[0] for t in turns]
    assert {name: leads.count(name) for name in fns} == {name: len(turns) // len(fns) for name in fns}
    # A round's rate: its batches' tokens over their summed wall time.
    for name, w in wall.items():
        assert rates[name] == [round(n * et.MAX_TOKENS / w, 1)] * rounds
    assert set(cpu) == set(fns)
