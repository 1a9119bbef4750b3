from __future__ import annotations

from pathlib import Path

from rollout.config_docs import BEGIN, END, render

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_configuration_reference_is_generated_from_the_models():
    text = README.read_text()
    block = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert block == render(), "README is stale: run `make config-docs`"


def test_readme_shows_the_two_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    assert "make test" in text and "make demo" in text
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_readme_gpu_section_is_generated_from_the_committed_results():
    from rollout import gpu_report

    text = README.read_text()
    block = text[text.index(gpu_report.BEGIN) : text.index(gpu_report.END) + len(gpu_report.END)]
    assert block == gpu_report.render_files(gpu_report.all_results()), "README is stale: run `rollout gpu-report --readme README.md`"


def test_readme_benchmark_numbers_are_generated_from_the_committed_json():
    from rollout.bench import report

    from rollout.readme_section import section

    assert section(README.read_text(), report.BEGIN, report.END) == report.render(), "README is stale: run `rollout bench-report --readme README.md` (make bench does)"
    for name in report.RENDERERS:
        assert (report.RESULTS_DIR / f"{name}.json").exists(), f"docs/bench/{name}.json is not committed"


def test_gpu_report_says_what_did_not_pass_and_why():
    from rollout.gpu_report import render

    results = {
        "started": "2026-11-26T00:00:00Z",
        "environment": {"vllm": "0.32.0", "torch": "2.13.0+cu130", "ray": "2.60.0", "gpus": ["H100", "H100"]},
        "checks": {
            "test_a_tensor_parallel_replica_serves_like_a_fresh_tp_engine_and_takes_a_gloo_publish": {"outcome": "failed", "error": "AssertionError: prompt 0 differs\nmore", "metrics": {}},
            "test_a_trainer_killed_mid_publish_leaves_every_replica_on_the_committed_version": {"outcome": "not run", "metrics": {}},
            "test_contiguous_gpu_parameters_are_shared_in_place_without_a_copy": {"outcome": "passed", "metrics": {}},
        },
    }
    text = render([(results, "docs/gpu/x.json")])
    assert "2x H100: vLLM 0.32.0" in text
    assert "| **failed**: AssertionError: prompt 0 differs |" in text
    assert "| **not run** |" in text
    assert "1 of 1 passed" in text


def test_gpu_report_shows_where_a_check_that_failed_last_passed_before():
    from rollout.gpu_report import render

    tp = "test_a_tensor_parallel_replica_serves_like_a_fresh_tp_engine_and_takes_a_gloo_publish"
    env = {"vllm": "0.32.0", "gpus": ["H100", "H100"]}
    newest = {"started": "2026-11-27T10:00:00Z", "environment": env, "checks": {tp: {"outcome": "failed", "error": "SystemExit: 1", "metrics": {}}}}
    older = {"started": "2026-11-26T10:00:00Z", "environment": env, "checks": {tp: {"outcome": "passed", "metrics": {"replica_start_s": 97.5}}}}
    text = render([(newest, "new.json"), (older, "old.json")])
    assert "Newest run: 2026-11-27 10:00 UTC" in text and "Earlier: 2026-11-26 10:00 UTC" in text
    (row,) = [line for line in text.splitlines() if "TP=2" in line]
    assert "**failed**: SystemExit: 1" in row and "Last passed 2026-11-26 10:00 UTC (`old.json`): replica start 97.5 s" in row


def _how_it_is_built() -> str:
    text = README.read_text()
    start = text.index("## How it is built")
    return text[start : text.index("\n## ", start + 1)]


def test_how_it_is_built_names_modules_that_exist():
    import re

    section = _how_it_is_built()
    package = README.parent / "platform" / "rollout"
    named = set(re.findall(r"`rollout/([\w/]+\.py)`", section)) | set(re.findall(r"\b((?:contracts|sync|engine|routing|http|client)/[\w/]+\.py)\b", section))
    assert len(named) > 20
    assert sorted(p for p in named if not (package / p).is_file()) == []


def test_a_publish_is_followed_through_at_most_eight_modules():
    import re

    section = _how_it_is_built()
    diagram = section[section.index("A publish, from the trainer's call") :].split("```")[1]
    modules = set(re.findall(r"\b(sync/[\w/<>]+\.py)\b", diagram))
    assert 0 < len(modules) <= 8, sorted(modules)
