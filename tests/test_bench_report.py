"""rollout.bench.report renders the Benchmarks page's numbers from the benchmark JSON."""

from __future__ import annotations

import json

from rollout.bench import report


def throughput(handle_vs_bare: float) -> dict:
    rounds = {"bare": [900.0, 1000.0, 1100.0], "handle": [800.0, 1000.0 * handle_vs_bare, 1200.0], "http": [950.0, 990.0, 1000.0]}
    point = {
        "concurrency": 64,
        "bare_vllm_tokens_per_s": 1000.0,
        "handle_tokens_per_s": 1000.0 * handle_vs_bare,
        "http_tokens_per_s": 990.0,
        "handle_vs_bare": handle_vs_bare,
        "http_vs_bare": 0.99,
        "vs_bare_interval_90": {"handle": [handle_vs_bare - 0.05, handle_vs_bare + 0.04], "http": [0.97, 1.01]},
        "rounds": rounds,
        "cpu_s_per_round": {"bare": {"vllm worker": 1.0}, "handle": {"vllm worker": 1.0, "engine replica": 0.5}},
    }
    return {
        "max_tokens": 128,
        "rounds": 3,
        "order": "interleaved",
        "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11", "vllm": "0.32.0"},
        "target": "handle_vs_bare and http_vs_bare >= 0.95 at every concurrency",
        "target_met": handle_vs_bare >= 0.95,
        "points": [point],
    }


def test_every_number_comes_from_the_json_and_a_missed_target_says_so(tmp_path):
    (tmp_path / "engine_throughput.json").write_text(json.dumps(throughput(0.9)))
    text = report.render(tmp_path)
    assert text.startswith(report.BEGIN) and text.endswith(report.END)
    assert "| 64 | 1,000 (900-1,100) | 900 (800-1,200) | 990 (950-1,000) | **0.90x** (0.85-0.94) | **0.99x** (0.97-1.01) |" in text
    assert "**not met**" in text
    assert "64 concurrent, handle: total 1.50 s (vllm worker 1.00, engine replica 0.50)" in text
    # A benchmark without committed results says so instead of showing old numbers.
    assert "**weight_sync**: no results committed" in text


def test_the_page_section_is_rewritten_in_place(tmp_path):
    (tmp_path / "engine_throughput.json").write_text(json.dumps(throughput(1.0)))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{report.BEGIN}\nold numbers\n{report.END}\noutro\n")
    assert report.update_page(page, tmp_path)
    text = page.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old numbers" not in text and "**met**" in text
    assert not report.update_page(page, tmp_path)


def test_paired_ratios_cancel_drift_that_both_paths_see():
    from rollout.stats_summary import median_interval, paired_ratios

    # The machine slows down over the run; the path is 10% behind bare in every rotation.
    bare = [1000.0, 800.0, 600.0, 1000.0, 700.0]
    path = [b * 0.9 for b in bare]
    ratios = paired_ratios(path, bare)
    assert all(abs(r - 0.9) < 1e-9 for r in ratios)
    assert all(abs(v - 0.9) < 1e-9 for v in median_interval(ratios))
    # Scattered ratios give an interval around the median that a rerun may land in.
    lo, hi = median_interval([0.8, 0.9, 1.0, 1.1, 1.2, 0.95, 1.05])
    assert lo < 1.0 < hi and median_interval([0.8, 0.9, 1.0, 1.1, 1.2, 0.95, 1.05]) == (lo, hi)


def test_the_soak_section_says_which_checks_failed_and_counts_every_outcome(tmp_path):
    soak = {
        "duration_s": 120, "fault_period_s": 20, "replicas": 2, "hung": 1, "lost": 0,
        "checks": {"no call hung": False, "no call lost": True},
        "passed": False,
        "publishes": {"committed": 9, "failed": 1, "failures": ["SyncError: round aborted"]},
        "uncommitted_versions_seen": [],
        "calls": {"batch": {"ok": 10, "ReplicaLostError": 2}, "openai": {"ok": 3, "untyped": 1}},
        "faults": [{"fault": "kill_ingress", "at_s": 10.0, "serving_again_s": 0.5, "full_strength_s": 9.0}],
        "memory_by_role": {"vllm worker": {"start_mb": 1, "end_mb": 2, "max_process_growth_mb": 1}},
    }
    text = "\n".join(report.soak(soak))
    assert "**failed: no call hung**" in text and "failed 1 (`SyncError`)" in text
    assert "| batch | 10 | ReplicaLostError 2 | 0 |" in text and "| openai | 3 | 0 | 1 |" in text
    assert "| kill_ingress | 10 s | 0.5 s | 9.0 s |" in text


# What every python_tool result says of its run, beside its points.
PYTHON_TOOL_RUN = {
    "rounds": 30,
    "order": "interleaved",
    "bubblewrap": "bubblewrap 0.8.0",
    "isolation": "bubblewrap+seccomp+cgroup-v1",
    "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11.7", "kernel": "6.1.0"},
}


def test_the_python_tool_section_shows_both_sandboxes_and_the_paired_overhead(tmp_path):
    result = {
        **PYTHON_TOOL_RUN,
        "points": [
            {
                "program": "print(6*7)",
                "wall_ms": {"bare": {"median": 17.63, "interval_90": [17.15, 17.76]}, "bubblewrap": {"median": 33.12, "interval_90": [27.51, 34.47]}},
                "overhead_ms": {"median": 15.58, "interval_90": [10.47, 17.71]},
                "bubblewrap_vs_bare": {"median": 1.89, "interval_90": [1.56, 1.95]},
            }
        ],
    }
    (tmp_path / "python_tool.json").write_text(json.dumps(result))
    text = report.render(tmp_path)
    assert "bubblewrap 0.8.0, isolation `bubblewrap+seccomp+cgroup-v1`; 2 CPUs (test cpu), Python 3.11.7, kernel 6.1.0" in text
    assert "| `print(6*7)` | 17.6 (17.1-17.8) | 33.1 (27.5-34.5) | **15.6 (10.5-17.7)** | 1.89x (1.56-1.95) |" in text


def test_the_python_tool_section_shows_the_previous_pass_and_its_goal(tmp_path):
    def m(median, low, high):
        return {"median": median, "interval_90": [low, high]}

    result = {
        **PYTHON_TOOL_RUN,
        "goal": "today's sandbox at most +5 ms over the previous pass on print(6*7)",
        "goal_met": None,
        "points": [
            {
                "program": "print(6*7)",
                "wall_ms": {"bare": m(19.85, 19.63, 20.13), "bubblewrap-before": m(26.19, 25.59, 29.84), "bubblewrap": m(30.0, 29.0, 32.0)},
                "overhead_ms": m(10.1, 9.5, 11.0),
                "bubblewrap_vs_bare": m(1.5, 1.45, 1.55),
                "before_overhead_ms": m(6.3, 5.8, 9.0),
                "vs_before_ms": m(3.8, -0.4, 5.2),
            }
        ],
    }
    (tmp_path / "python_tool.json").write_text(json.dumps(result))
    text = report.render(tmp_path)
    assert "`before` is the bubblewrap sandbox as its previous pass left it (git bd40811)" in text
    assert "Goal: today's sandbox at most +5 ms over the previous pass on print(6*7): **not resolved by this run (the interval spans it)**." in text
    assert "| `print(6*7)` | 19.9 (19.6-20.1) | 26.2 (25.6-29.8) | 30.0 (29.0-32.0) | **10.1 (9.5-11.0)** | 1.50x (1.45-1.55) | **+3.8 (-0.4 to +5.2)** |" in text
    result["goal_met"] = True
    (tmp_path / "python_tool.json").write_text(json.dumps(result))
    assert "print(6*7): **met**." in report.render(tmp_path)


def test_the_hosts_publish_table_comes_from_the_json_and_a_bench_that_could_not_run_says_why(tmp_path):
    def summary(median):
        return {"median_s": median, "interval_90_s": [median - 0.01, median + 0.02], "rounds_s": [median] * 3}

    result = {
        "benchmark": "hosts_publish",
        "bytes": 120_000_000,
        "backend": "gloo",
        "replicas": 1,
        "rounds": 3,
        "order": "interleaved",
        "links": "a veth pair",
        "one_host": {"first_s": summary(0.5), "kept_s": summary(0.25)},
        "two_hosts": {"first_s": summary(0.55), "kept_s": summary(0.3)},
        "two_hosts_vs_one_host": {"first_s": {"median": 1.1, "interval_90": [1.0, 1.2]}, "kept_s": {"median": 1.2, "interval_90": [1.1, 1.3]}},
        "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11"},
    }
    (tmp_path / "hosts_publish.json").write_text(json.dumps(result))
    text = report.render(tmp_path)
    assert "| forms the group | 0.500 (0.490-0.520) | 0.550 (0.540-0.570) | 1.10x (1.00-1.20) |" in text
    assert "| reuses the group | 0.250 (0.240-0.270) | 0.300 (0.290-0.320) | 1.20x (1.10-1.30) |" in text
    (tmp_path / "hosts_publish.json").write_text(json.dumps({"benchmark": "hosts_publish", "skipped": "making network namespaces needs root"}))
    assert "**hosts_publish**: did not run (making network namespaces needs root)." in report.render(tmp_path)


def rendered(tmp_path, name: str, result: dict) -> str:
    """The page section rendered from ``result`` as the benchmark ``name``'s JSON."""
    (tmp_path / f"{name}.json").write_text(json.dumps(result))
    return report.render(tmp_path)


def test_the_prefix_cache_table_shows_both_modes_per_event_and_names_where_they_differ(tmp_path):
    def call(hits, version, queries=257):
        return {"hits": hits, "queries": queries, "computed": queries - hits, "version": version}

    def event(before, after, again, version):
        return {"before": call(before, str(version - 1)), "after": call(after, str(version)), "again": call(again, str(version))}

    result = {
        "benchmark": "prefix_cache",
        "prompt_tokens": 257,
        "block_tokens": 128,
        "best_possible_hits": 256,
        "order": "the modes one after the other",
        "events": ["commit", "aborted_round"],
        "modes": {
            "salt": {"commit": event(256, 0, 256, 1), "aborted_round": event(256, 256, 256, 2)},
            "flush": {"commit": event(256, 0, 256, 1), "aborted_round": event(256, 0, 256, 2)},
        },
        "events_where_the_modes_differ": ["aborted_round"],
        "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11"},
    }
    text = rendered(tmp_path, "prefix_cache", result)
    assert "a prompt of 257 tokens per event (128-token KV blocks: at most 256 can hit)" in text
    assert "The modes differ after: `aborted_round`." in text
    assert "| commit | 256 of 257 / 256 of 257 | **0 of 257**, 257 computed (version 1) | **0 of 257**, 257 computed (version 1) | 256 of 257 / 256 of 257 |" in text
    assert "| aborted_round | 256 of 257 / 256 of 257 | **256 of 257**, 1 computed (version 2) | **0 of 257**, 257 computed (version 2) | 256 of 257 / 256 of 257 |" in text


def test_the_weight_sync_digest_table_shows_each_sides_share_of_a_publish_and_the_goal(tmp_path):
    def side(share, inside):
        return {"round_s": 0.3, "rounds": [0.28, 0.3, 0.35], "vs_engine_round": 1.02, "share_of_publish": share,
                "share_of_publish_interval_90": [share - 0.01, share + 0.02], "inside_digest_s": inside}

    point = {
        "replicas": 1, "publish_s": 0.3, "publish_rounds": [0.3], "engine_round_s": 0.29, "engine_round_rounds": [0.29],
        "floor_s": 0.1, "per_tensor_s": 1.2, "publish_vs_engine_round": 1.0, "publish_vs_floor": 3.0, "per_tensor_vs_publish": 4.0,
        "digests": {"sender": side(0.012, {"sender_digest": 0.011}), "replica": side(0.031, {"replica_digest": 0.02}),
                    "both": side(0.062, {"sender_digest": 0.011, "replica_digest": 0.02})},
    }
    result = {
        "parameters": 28_700_000, "bytes": 115_000_000, "tensors": 99, "bucket_bytes": 32 << 20, "repeats": 3,
        "targets": "publish_vs_engine_round <= 1.1", "target_met": True, "load_average_1min": {"before": 4.2, "after": 5.0},
        "digest_goal": "the digests (sender and replicas) cost < 5% of a publish", "digest_goal_met": False, "points": [point],
    }
    text = rendered(tmp_path, "weight_sync", result)
    assert "32 MiB buckets; medians of 3 rounds; load average 4.2 before, 5.0 after). Target" in text
    assert "Goal: the digests (sender and replicas) cost < 5% of a publish: **not met**." in text
    assert "| 1 | sender (publisher) | 0.30 s (0.28-0.35) | 1.02x | **1.2%** (0.2-3.2%) | sender 0.011 s |" in text
    assert "| 1 | both (as a publish) | 0.30 s (0.28-0.35) | 1.02x | **6.2%** (5.2-8.2%) | sender 0.011 s, replica 0.020 s |" in text
    # A run whose interval spans the goal says it did not decide it, rather than met or not met.
    assert "cost < 5% of a publish: **not resolved by this run (an interval spans it)**." in rendered(tmp_path, "weight_sync", {**result, "digest_goal_met": None})
    # A run from before the digest rows says they are missing, not that they cost nothing.
    without = {**result, "points": [{k: v for k, v in point.items() if k != "digests"}]}
    assert "Received-bytes digests: not in this run's JSON (it predates the digest rows" in rendered(tmp_path, "weight_sync", without)


def test_the_digest_goal_is_met_only_when_every_interval_lies_under_it():
    from rollout.bench.weight_sync import _digest_goal_met

    def point(low, high):
        return {"digests": {"both": {"share_of_publish_interval_90": [low, high]}}}

    assert _digest_goal_met([point(0.01, 0.04), point(-0.02, 0.049)]) is True
    assert _digest_goal_met([point(0.01, 0.04), point(0.051, 0.2)]) is False
    assert _digest_goal_met([point(0.01, 0.04), point(-0.1, 0.3)]) is None


def test_the_delta_table_shows_bytes_and_time_of_every_path_from_the_json(tmp_path):
    rounds = {"full": [1.0, 1.2, 1.1], "delta_1pct": [0.5, 0.7, 0.6], "delta_10pct": [0.8, 0.9, 1.0]}
    paths = {
        name: {"publish_s": sorted(r)[1], "publish_rounds": r, "modes": ["full" if name == "full" else "delta"], "bytes_sent": b, "phases_s": {"trainer.send": 0.25}}
        for (name, r), b in zip(rounds.items(), (120e6, 3.6e6, 36e6))
    }
    paths["delta_1pct"].update(vs_full=0.52, vs_full_interval_90=[0.5, 0.55], bytes_vs_full=0.03)
    paths["delta_10pct"].update(vs_full=0.81, vs_full_interval_90=[0.78, 0.9], bytes_vs_full=0.3)
    result = {
        "backend": "gloo_delta", "replicas": 1, "parameters": 30e6, "tensors": 100, "bytes": 120e6, "repeats": 3,
        "order": "interleaved", "ratios": "paired", "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11"}, "paths": paths,
    }
    (tmp_path / "weight_delta.json").write_text(json.dumps(result))
    text = report.render(tmp_path)
    assert "| 1% changed, sent in full | full | 120.00 MB | 100% | 1.10 s (1.00-1.20) | 1 |" in text
    assert "| 1% changed, as a delta | delta | 3.60 MB | 3.0% | 0.60 s (0.50-0.70) | **0.52x** (0.50-0.55) |" in text
    assert "| 10% changed, as a delta | delta | 36.00 MB | 30.0% | 0.90 s (0.80-1.00) | **0.81x** (0.78-0.90) |" in text
    assert "- 10% changed, as a delta: trainer.send 0.250" in text


def test_the_per_request_table_shows_each_path_against_vllm_serve_from_the_benchs_own_summary(tmp_path):
    from rollout.bench.per_request import summarize

    rounds = {
        "vllm": [{"requests_per_s": 100.0}, {"requests_per_s": 120.0}],
        "vllm_logprobs": [{"requests_per_s": 90.0}, {"requests_per_s": 100.0}],
        "completions": [{"requests_per_s": 80.0}, {"requests_per_s": 84.0}],
        "rollouts": [{"requests_per_s": 45.0}, {"requests_per_s": 50.0}],
    }
    result = {
        "benchmark": "per_request", "measure": "requests_per_s", "in_flight": 256, "prompt_tokens": 8, "max_tokens": 1, "requests_per_round": 512,
        "rounds": 2, "order": "interleaved", "front_door": {"front_door": "haproxy", "throughput_optimized": False}, "enforce_eager": True,
        "machine": {"cpus": 2, "cpu": "test cpu", "python": "3.11"}, "summary": summarize(rounds, "requests_per_s"),
    }
    text = rendered(tmp_path, "per_request", result)
    assert "`http.front_door` haproxy, `http.throughput_optimized` False" in text
    assert "| platform /v1/completions | 82.0 (80.0-84.0) | **0.75x** (0.70-0.80) |  |" in text
    assert "| platform /v1/rollouts (sampled-token logprobs, the default) | 47.5 (45.0-50.0) | **0.43x** (0.42-0.45) | **0.50x** (0.50-0.50) |" in text
    assert "logprobs: false" not in text  # a path the run did not measure has no row
