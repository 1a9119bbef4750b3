"""The per-request GPU check's harness (tests/gpu/per_request.py) on CPU: its pure parts
(prompts, order, the ratio table and the acceptance, the round budget, the front door it
picks from the committed CPU benchmarks), and, when ``ROLLOUT_PER_REQUEST_DRY_RUN=1`` asks
for it, the whole harness against a CPU `vllm serve` and a CPU `rollout serve` with a tiny
workload (two engines and a Ray cluster: minutes on the 2-core machine, so not in
``make test`` unasked)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from tests.gpu import per_request as pr

ROOT = Path(__file__).resolve().parents[1]


def test_random_prompts_are_the_same_for_a_seed_and_differ_between_batches():
    a = pr.random_prompts(4, 128, "s")
    assert a == pr.random_prompts(4, 128, "s")
    assert [len(p) for p in a] == [128] * 4
    assert all(pr.TOKEN_LOW <= t < pr.TOKEN_HIGH for p in a for t in p)
    w = pr.FULL
    # Issue 41's workload.
    assert (w.requests, w.prompt_tokens, w.max_tokens, w.concurrencies) == (512, 128, 256, (256, 512))
    batches = [pr.batch_prompts(w, r, c, p) for r in range(2) for c in w.concurrencies for p in pr.PATH_NAMES]
    assert all(len(b) == 512 and len(b[0]) == 128 for b in batches)
    # No batch shares a prompt's first KV block (16 tokens) with another: nothing is served from the prefix cache.
    firsts = [tuple(p[:16]) for b in batches for p in b]
    assert len(set(firsts)) == len(firsts)


def test_the_order_rotates_every_round():
    names = pr.PATH_NAMES
    orders = [pr.order(names, k) for k in range(len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert [o[0] for o in orders] == list(names)


def _rates(platform: dict[str, list[float]], bare: list[float], bare_lp: list[float]) -> dict[str, list[float]]:
    return {pr.BARE: bare, pr.BARE_LOGPROBS: bare_lp, **platform}


def test_the_ratio_table_pairs_each_platform_path_with_the_bare_path_of_the_same_logprobs():
    rates = {
        256: _rates({"completions": [90, 100, 95], "completions_logprobs": [80, 80, 80], "rollouts": [100, 100, 100], "rollouts_logprobs": [50, 50, 50]}, [100, 100, 100], [80, 100, 100]),
        512: _rates({"completions": [99], "completions_logprobs": [99], "rollouts": [99], "rollouts_logprobs": [99]}, [100], [100]),
    }
    table = pr.ratio_table(rates)
    assert [(r["route"], r["logprobs"], r["concurrency"]) for r in table] == [
        (route, lp, c) for c in (256, 512) for route, lp in (("/v1/completions", False), ("/v1/completions", True), ("/v1/rollouts", False), ("/v1/rollouts", True))
    ]
    row = {(r["path"], r["concurrency"]): r for r in table}
    assert row["completions", 256]["ratios"] == [0.9, 1.0, 0.95] and row["completions", 256]["ratio"] == 0.95
    assert row["completions_logprobs", 256]["bare_path"] == pr.BARE_LOGPROBS and row["completions_logprobs", 256]["ratios"] == [1.0, 0.8, 0.8]
    assert row["rollouts_logprobs", 256]["ratio"] == 0.5 and row["rollouts_logprobs", 256]["platform_tokens_per_s"] == 50
    lo, hi = row["completions", 256]["interval_90"]
    assert 0.9 <= lo <= 0.95 <= hi <= 1.0
    assert row["rollouts", 512]["rounds"] == 1 and row["rollouts", 512]["interval_90"] == [0.99, 0.99]
    missed = pr.misses(table)
    assert len(missed) == 2, missed  # completions with logprobs (0.8x) and rollouts with logprobs (0.5x) at 256
    assert missed[0].startswith("/v1/completions logprobs on at 256 in flight: 0.8x") and "platform 80 tok/s, bare 100)" in missed[0]
    assert missed[1].startswith("/v1/rollouts logprobs on at 256 in flight: 0.5x")


def test_a_round_cut_short_pairs_only_the_rounds_both_paths_ran():
    rates = {256: _rates({"completions": [90, 100]}, [100], [100])}
    (row,) = pr.ratio_table(rates)
    assert row["rounds"] == 1 and row["ratios"] == [0.9]


def test_rounds_run_to_the_minimum_then_while_the_budget_allows_and_never_into_the_runs_end():
    w = dataclasses.replace(pr.FULL, min_rounds=3, max_rounds=5, budget_s=480, first_round_estimate_s=110)
    now = 1_000_000.0
    # The minimum even over the budget, while the run's end allows.
    assert pr.another_round(0, w, elapsed_s=600, round_s=None, now=now, end=None, stop_slack_s=60) == (True, "")
    assert pr.another_round(2, w, elapsed_s=600, round_s=100, now=now, end=now + 200, stop_slack_s=60) == (True, "")
    # Above the minimum, only within the budget.
    assert pr.another_round(3, w, elapsed_s=370, round_s=100, now=now, end=None, stop_slack_s=60)[0]
    go, why = pr.another_round(3, w, elapsed_s=390, round_s=100, now=now, end=None, stop_slack_s=60)
    assert not go and "budget 480 s" in why
    assert pr.another_round(5, w, elapsed_s=0, round_s=1, now=now, end=None, stop_slack_s=60) == (False, "max_rounds 5 ran")
    # The run's end: not even the first round when its estimate and the stop do not fit.
    go, why = pr.another_round(0, w, elapsed_s=0, round_s=None, now=now, end=now + 150, stop_slack_s=60)
    assert not go and "ROLLOUT_GPU_END" in why
    go, _ = pr.another_round(1, w, elapsed_s=0, round_s=100, now=now, end=now + 159, stop_slack_s=60)
    assert not go


def test_the_front_door_is_the_one_the_committed_cpu_benchmarks_found_fastest():
    door, scores = pr.fastest_front_door(ROOT / "docs" / "bench")
    assert set(scores) >= {"per_request.json", "per_request_haproxy.json"}
    assert door == {"front_door": "haproxy", "throughput_optimized": False}, scores
    assert scores["per_request_haproxy.json"] > scores["per_request.json"]


def test_bare_vllm_serve_gets_the_replicas_engine_arguments(tmp_path):
    from rollout.config import load_config
    from rollout.engine.args import engine_kwargs
    from rollout.engine.openai_app import parse_serve_args

    model = {"path": str(tmp_path), "served_name": "m", "dtype": "bfloat16", "device": "cuda", "max_model_len": 2048, "gpu_memory_utilization": 0.42, "seed": 0}
    config = pr.platform_config(model, 18142, tmp_path / "key", {"front_door": "haproxy", "throughput_optimized": False})
    argv, env = pr.bare_argv(config, "cuda", 18141, "k")
    assert env == {}
    args = argv[argv.index("serve") + 1 :]
    assert args[-6:] == ["--host", "127.0.0.1", "--port", "18141", "--api-key", "k"]
    parsed = parse_serve_args(args[:-6])
    kw = engine_kwargs(load_config(config, environ={}).model, "cuda")
    for name in ("max_model_len", "max_num_seqs", "gpu_memory_utilization", "dtype", "seed", "enable_prefix_caching", "enforce_eager"):
        assert getattr(parsed, name) == kw[name], name
    assert load_config(config, environ={}).http.front_door == "haproxy"


# ---- the harness end to end, on CPU -----------------------------------------------------

DRY = dataclasses.replace(
    pr.FULL, requests=8, prompt_tokens=16, max_tokens=4, concurrencies=(4, 8), min_rounds=2, max_rounds=2, budget_s=3600.0, quiet_s=0.2,
    warmup_requests=4, warmup_max_tokens=2, greedy_lengths=(8, 20), greedy_max_tokens=8, first_round_estimate_s=30.0,
)  # fmt: skip
# ROLLOUT_PER_REQUEST_DRY_RUN=wide: the GPU check's concurrencies and batch size (one round,
# two tokens a request): its client, both servers and the front door at 512 calls in flight.
WIDE = dataclasses.replace(DRY, requests=512, concurrencies=(256, 512), min_rounds=1, max_rounds=1, max_tokens=2, quiet_s=1.0)


@pytest.mark.skipif(
    os.environ.get("ROLLOUT_PER_REQUEST_DRY_RUN") not in ("1", "wide"), reason="the harness against CPU servers: set ROLLOUT_PER_REQUEST_DRY_RUN=1 or wide (minutes)"
)
def test_the_harness_runs_against_cpu_servers(model_dir, tmp_path):
    from tests.engines import TEST_MODEL
    from tests.gpu.servers import Command, kv_cache_tokens, rollout_serve_argv, write_platform_config

    key, name = "dry-run-key", "dry-model"
    (tmp_path / "key").write_text(key + "\n")
    door, _ = pr.fastest_front_door(ROOT / "docs" / "bench")
    model = {"path": str(model_dir), "served_name": name, "device": "cpu", "seed": 0, **TEST_MODEL}
    config = pr.platform_config(model, 18152, tmp_path / "key", door)
    argv, env = pr.bare_argv(config, "cpu", 18151, key)
    started = time.monotonic()
    bare = Command(argv, env, tmp_path / "bare.log", 18151, key, name, gpu=False)
    platform = None
    try:
        bare.first_completion_s(600)
        platform = Command(rollout_serve_argv(write_platform_config(config, tmp_path / "platform.yaml")), {"ROLLOUT_SYNC_TOKEN": "dry"}, tmp_path / "platform.log", 18152, key, name, gpu=False)
        platform.first_completion_s(600)
        w = WIDE if os.environ["ROLLOUT_PER_REQUEST_DRY_RUN"] == "wide" else DRY
        result = pr.run(bare.url, platform.url, name, key, w, started, None, 0.0)
    finally:
        for cmd in (platform, bare):
            if cmd is not None:
                cmd.stop()
    print(pr.summary_line(result["table"]), result["round_s"], result["greedy"], kv_cache_tokens(bare.lines), kv_cache_tokens(platform.lines))
    assert result["rounds_run"] == w.max_rounds and result["rounds_stopped"] == f"max_rounds {w.max_rounds} ran"
    assert len(result["table"]) == 8 and all(r["rounds"] == w.max_rounds and r["platform_tokens_per_s"] > 0 and r["bare_tokens_per_s"] > 0 for r in result["table"])
    assert result["greedy"] == {"/v1/rollouts": "equal", "/v1/completions": "equal"}, result["greedy"]
