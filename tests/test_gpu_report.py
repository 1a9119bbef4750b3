"""The GPU table of docs/gpu.md (rollout.gpu_report) for the fleet check and for checks that
have no row of their own, from small synthetic results."""

from __future__ import annotations

from rollout.gpu_report import render

FLEET = "test_fleet_publish_time_stays_flat_from_one_to_three_replicas"
ENV = {"vllm": "0.32.0", "torch": "2.13.0+cu130", "ray": "2.60.0", "gpus": ["H100"] * 4}


def _point(n: int, steady: float, first: float, greedy: str = "equal") -> dict:
    return {
        "replicas": n,
        "gpus": list(range(n)),
        "ready_s": 60.0 + n,
        "publish_s": [first, steady, steady],
        "publish_first_s": first,
        "publish_steady_s": steady,
        "greedy": {f"r{i}": greedy for i in range(n)},
    }


def _row(text: str, marker: str) -> str:
    (row,) = [line for line in text.splitlines() if marker in line]
    return row


def _check_row(check: str, metrics: dict, marker: str, **entry) -> str:
    """The table row (found by ``marker``) of a run that recorded ``metrics`` for ``check``;
    ``entry``: the check's outcome (passed unless given) and error."""
    results = {"started": "2026-11-28T09:00:00Z", "environment": ENV, "checks": {check: {"outcome": "passed", **entry, "metrics": metrics}}}
    return _row(render([(results, "docs/gpu/x.json")]), marker)


def test_the_fleet_row_shows_publish_time_per_replica_count_and_the_ratio_to_the_goal():
    metrics = {
        "trainer_gpu": 3,
        "bytes": 2_960_000_000,
        "goal_ratio": 1.2,
        "fleet": [_point(1, 0.25, 0.8), _point(2, 0.26, 0.85), _point(3, 0.275, 0.9)],
        "publish_3_vs_1": 1.1,
        "first_3_vs_1": 1.125,
    }
    row = _check_row(FLEET, metrics, "Many replicas")
    assert "| passed |" in row
    assert "2.96 GB from cuda:3" in row
    assert "into 1: 0.25 s (0.8 s); into 2: 0.26 s (0.85 s); into 3: 0.275 s (0.9 s)" in row
    assert "**3 vs 1 = 1.10x** (goal <= 1.2x), first 1.12x" in row
    assert "serving: 1 after 61.0 s, 2 after 62.0 s, 3 after 63.0 s" in row
    assert "equal on every replica at 1, 2, 3 replicas" in row


def test_a_fleet_check_that_failed_part_way_shows_what_it_reached():
    # Cut short after two counts, one replica of which served other tokens: no ratio yet.
    metrics = {"trainer_gpu": 0, "bytes": 1e9, "goal_ratio": 1.2, "fleet": [_point(1, 0.25, 0.8), _point(2, 0.3, 0.9, greedy="prompt 3: first difference at token 5")]}
    row = _check_row(FLEET, metrics, "Many replicas", outcome="failed", error="AssertionError: 2 replicas")
    assert "**failed**: AssertionError: 2 replicas" in row
    assert "into 2: 0.3 s (0.9 s)" in row and " vs 1 = " not in row
    assert "2 replicas: {'r0': 'prompt 3: first difference at token 5'" in row


def test_checks_without_a_row_of_their_own_are_grouped_by_their_file():
    checks = {
        # Recorded before entries named their file: the senders' tests then.
        "test_old_sender_check": {"outcome": "passed", "metrics": {}},
        "test_a_sender_check": {"file": "tests/gpu/test_gpu_senders.py", "outcome": "passed", "metrics": {}},
        "test_a_direct_publish": {"file": "tests/gpu/test_gpu_direct.py", "outcome": "failed", "error": "AssertionError: slow", "metrics": {}},
    }
    text = render([({"started": "2026-11-28T09:00:00Z", "environment": ENV, "checks": checks}, "x.json")])
    assert "| Trainer-side senders on a GPU (`tests/gpu/test_gpu_senders.py`) | 2 of 2 passed | vLLM 0.32.0: passed (`x.json`) |  |" in text
    assert "| Further GPU checks (`tests/gpu/test_gpu_direct.py`) | 0 of 1 passed | vLLM 0.32.0: **not passed** (`x.json`) | `test_a_direct_publish`: **failed**: AssertionError: slow |" in text


def test_each_row_says_per_vllm_version_whether_the_newest_run_of_that_version_passed_it():
    sleep = "test_sleep_levels_free_the_replicas_gpu_memory_and_wake_to_the_same_greedy_output"
    run = lambda started, vllm, outcome: {"started": started, "environment": {**ENV, "vllm": vllm}, "checks": {sleep: {"outcome": outcome, "metrics": {}}}}  # noqa: E731
    runs = [
        (run("2026-11-30T00:00:00Z", "0.33.0", "passed"), "docs/gpu/c.json"),
        (run("2026-11-29T00:00:00Z", "0.32.0", "failed"), "docs/gpu/b.json"),
        # An older pass on 0.32.0 does not outvote the newer failure on it.
        (run("2026-11-28T00:00:00Z", "0.32.0", "passed"), "docs/gpu/a.json"),
        (run("2026-11-27T00:00:00Z", "0.33.0", "not run"), "docs/gpu/d.json"),
    ]
    row = _row(render(runs), "18. Sleep and wake")
    assert "| vLLM 0.33.0: passed (`c.json`)<br>vLLM 0.32.0: **not passed** (`b.json`) |" in row, row
    never = [(run("2026-11-27T00:00:00Z", "0.33.0", "not run"), "d.json")]
    assert "| not run yet |" in _row(render(never), "18. Sleep and wake")


LORA = "test_a_lora_adapter_published_into_a_gpu_replica_serves_like_a_fresh_engine_with_it"
LORA_HEAD = {"rank": 16, "adapter_tensors": 168, "replica_start_s": 40.1, "publish_adapter_s": [0.5, 0.4]}


def _lora_row(metrics: dict, **entry) -> str:
    return _check_row(LORA, metrics, "12. A LoRA adapter", **entry)


def test_the_lora_row_shows_per_version_equal_prompts_near_ties_and_deviations():
    version = lambda ties: {"prompts": 8, "exactly_equal": 8 - len(ties), "near_ties": ties, "max_deviation": [0.01, 0.03], "failures": [], "accepted_against_the_other_version": 0}  # noqa: E731
    tie = {"prompt": 1, "position": 4, "gap": 0.012, "max_deviation_before": 0.02, "deviation_at": 0.01}
    metrics = {**LORA_HEAD, "top_logprobs": 5, "lp_tol": 0.1, "tie_tol": 0.2, "versions": {"1": version([tie]), "2": version([])}, "base": "equal"}
    row = _lora_row(metrics)
    parts = [
        "| passed | vLLM 0.32.0: passed (`x.json`) | rank 16, 168 tensors; replica start 40.1 s (eager); publish_adapter [0.5, 0.4] s; ",
        "against a fresh engine with the adapter (top-5 logprobs, lp_tol 0.1, tie_tol 0.2): ",
        "version 1: 7 of 8 prompts equal, near-ties: prompt 1 at token 4 (gap 0.012, deviation 0.02 before, 0.01 there), "
        "largest logprob deviation 0.03, accepted against the other version's reference 0; ",
        "version 2: 8 of 8 prompts equal, largest logprob deviation 0.03, accepted against the other version's reference 0; ",
        "without an adapter equal |",
    ]
    assert "".join(parts) in row, row


def test_a_lora_check_that_failed_on_its_first_version_says_why_and_what_it_did_not_reach():
    failed = {"prompts": 8, "exactly_equal": 1, "near_ties": [], "max_deviation": [0.02, 2.5], "failures": [{"prompt": 1, "reason": "token 0 (5): 2.5 apart > lp_tol 0.1"}], "accepted_against_the_other_version": 0}
    row = _lora_row({**LORA_HEAD, "top_logprobs": 5, "lp_tol": 0.1, "tie_tol": 0.2, "versions": {"1": failed}}, outcome="failed")
    assert "version 1: 1 of 8 prompts equal, **failed**: prompt 1: token 0 (5): 2.5 apart > lp_tol 0.1, largest logprob deviation 2.5" in row
    assert "version 2" not in row and "without an adapter not reached" in row


def test_lora_results_from_before_logprobs_were_judged_still_render():
    row = _lora_row({**LORA_HEAD, "greedy": "equal for versions 1 and 2, and the base model without an adapter"})
    assert row.endswith("publish_adapter [0.5, 0.4] s; greedy equal for versions 1 and 2, and the base model without an adapter |")


SPARSE = "test_sparse_nccl_publishes_patches_through_vllms_sparse_engine_and_serves_exactly_the_published_weights"


def test_the_sparse_row_reads_two_publishes_from_old_records_and_three_from_new_ones():
    old = {"replica_start_s": 109.4, "first_mode": "full", "first_publish_s": 1.48, "delta_mode": "delta", "delta_publish_s": 0.35, "delta_bytes_sent": 8847039900, "full_bytes": 2959694848, "greedy": "equal"}
    row = _check_row(SPARSE, old, "14. ")
    assert "publish 2 (delta) 0.35 s sending 8847039900 bytes against 2959694848" in row and "1% step" not in row
    new = {**old, "first_bytes_sent": 2959694848, "perturbed_mode": "full", "perturbed_publish_s": 0.3, "perturbed_bytes_sent": 2959694848, "delta_bytes_sent": 59000000}
    row = _check_row(SPARSE, new, "14. ")
    assert "the perturbed checkpoint (full) 0.3 s sending 2959694848" in row and "a 1% step (delta) 0.35 s sending 59000000" in row


PER_REQUEST = "test_per_request_http_throughput_against_vllm_serve_on_one_gpu"


def _per_request_metrics(rounds: int) -> dict:
    """What the check records (tests/gpu/test_gpu_per_request.py), its table built by the
    harness's own ratio_table from synthetic rates."""
    from tests.gpu import per_request as pr

    rates = {
        c: {pr.BARE: [20000.0] * rounds, pr.BARE_LOGPROBS: [19000.0] * rounds, "completions": [19500.0] * rounds,
            "completions_logprobs": [18500.0] * rounds, "rollouts": [19800.0] * rounds, "rollouts_logprobs": [15200.0] * rounds}
        for c in (256, 512)
    }  # fmt: skip
    return {
        "front_door": {"front_door": "haproxy", "throughput_optimized": False},
        "kv_cache_tokens": {"bare": 1_800_000, "platform": 1_790_000},
        "bare_start_s": 150.2, "platform_start_s": 98.4, "platform_new_compile_keys": [],
        "greedy": {"/v1/rollouts": "equal", "/v1/completions": "equal"},
        "workload": {"requests": 512, "prompt_tokens": 128, "max_tokens": 256}, "goal": 0.95,
        "rounds_run": rounds, "rounds_stopped": "budget 480 s: 450 s spent, a round takes ~100 s",
        "table": pr.ratio_table(rates),
    }  # fmt: skip


def test_the_per_request_row_shows_each_route_logprobs_and_concurrency_against_bare():
    row = _check_row(PER_REQUEST, _per_request_metrics(3), "19. Per-request", outcome="failed", error="AssertionError: per-request throughput under 0.95x")
    assert "**failed**: AssertionError: per-request throughput under 0.95x" in row
    assert "512 random 128-token prompts, 256 tokens out (ignore_eos), one request a call; front door `haproxy`;" in row
    assert "KV cache tokens bare 1800000, platform 1790000; starts: bare 150.2 s, platform 98.4 s (new compile keys [])" in row
    assert "3 interleaved rounds (budget 480 s: 450 s spent, a round takes ~100 s)" in row
    assert "/v1/completions logprobs off at 256: 19,500 vs 20,000 = **0.97x** (0.97-0.97)" in row
    assert "/v1/rollouts logprobs on at 512: 15,200 vs 19,000 = **0.80x** (0.80-0.80)" in row
    assert row.count(" at 256: ") == 4 and row.count(" at 512: ") == 4


def test_a_per_request_check_that_stopped_before_its_rounds_shows_its_starts():
    metrics = {k: v for k, v in _per_request_metrics(0).items() if k not in ("table", "rounds_run", "rounds_stopped")}
    row = _check_row(PER_REQUEST, metrics, "19. Per-request", outcome="cut off")
    assert "starts: bare 150.2 s, platform 98.4 s" in row and "interleaved rounds" not in row


def test_a_check_the_newest_run_did_not_collect_keeps_its_row_and_where_it_last_passed():
    sleep = "test_sleep_levels_free_the_replicas_gpu_memory_and_wake_to_the_same_greedy_output"
    fp8 = "test_an_fp8_replica_takes_a_bf16_publish_and_serves_like_a_fresh_fp8_engine_on_those_weights"
    newest = {"started": "2026-11-30T00:00:00Z", "environment": {**ENV, "vllm": "0.33.0"}, "checks": {fp8: {"outcome": "passed", "metrics": {}}}}
    older = {"started": "2026-11-29T00:00:00Z", "environment": ENV, "checks": {sleep: {"outcome": "passed", "metrics": {"version": 1}}}}
    row = _row(render([(newest, "docs/gpu/new.json"), (older, "docs/gpu/old.json")]), "18. Sleep and wake")
    assert "| **not run**: not in this run's selection | vLLM 0.32.0: passed (`old.json`) | Last passed 2026-11-29 00:00 UTC (`docs/gpu/old.json`)" in row, row
