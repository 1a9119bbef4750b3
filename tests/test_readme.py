"""The README (the front page) and the documentation site under docs/: the commands the
README shows stay runnable, and every generated section of a page is what its command
writes today (a stale one names the command that rewrites it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rollout.config_docs import BEGIN, END, render

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "configuration.md"
HTTP_PAGE = DOCS / "reference" / "http.md"
BENCHMARKS = DOCS / "benchmarks.md"
GPU = DOCS / "gpu.md"
CONCEPTS = DOCS / "concepts.md"
QUICKSTART = DOCS / "quickstart.md"


def test_configuration_reference_is_generated_from_the_models():
    text = CONFIGURATION.read_text()
    block = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert block == render(), "docs/configuration.md is stale: run `make config-docs`"


def test_readme_shows_the_two_commands_and_ci_runs_the_test_command():
    text = README.read_text()
    assert "make test" in text and "make demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "step test" in ci and "step docs" in ci


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_readmes_commands_name_targets_subcommands_flags_and_paths_that_exist():
    import contextlib
    import io
    import tomllib

    from rollout.cli import main

    text = README.read_text()
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = [line.split("#")[0].strip() for block in _blocks(text, "bash") for line in block.splitlines()]
    lines = [part.strip() for line in lines for part in line.split("&&") if part.strip()]
    assert len(lines) >= 6
    for line in lines:
        words = line.split()
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, flags=re.M), line
        elif words[0] == "rollout":
            out = io.StringIO()
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
                main([words[1], "--help"])
            assert e.value.code == 0, line
            assert [w for w in words[2:] if w.startswith("--") and w not in out.getvalue()] == [], line
        elif words[0] == "pip" and "-e" in words:
            named = re.search(r"\.\[([\w,]+)\]", line).group(1).split(",")
            assert set(named) <= set(extras), line
        elif words[0] == "helm" and words[1] == "install":
            assert (ROOT / words[3] / "Chart.yaml").is_file(), line
        elif words[0] not in ("pip", "kubectl", "helm"):
            raise AssertionError(f"a README command this test does not know: {line}")


def test_the_readmes_python_names_what_the_package_exports():
    import importlib

    code = "\n".join(_blocks(README.read_text(), "python"))
    imported = {}
    for module, names in re.findall(r"^from ([\w.]+) import ([\w, ]+)$", code, flags=re.M):
        for name in (n.strip() for n in names.split(",")):
            imported[name] = getattr(importlib.import_module(module), name)
    assert {"RolloutClient", "WeightPublisher", "RolloutRequest", "SamplingConfig"} <= set(imported)
    # Commented lines too: the other way to connect is shown as a comment.
    instances = {var: imported[cls] for var, cls in re.findall(r"(\w+) = (\w+)\.\w+\(", code) if cls in imported}
    called = re.findall(r"\b(\w+)\.(\w+)\(", code)
    missing = [f"{obj}.{attr}" for obj, attr in called if obj in imported and not hasattr(imported[obj], attr)]
    missing += [f"{obj}.{attr}" for obj, attr in called if obj in instances and not hasattr(instances[obj], attr)]
    assert missing == []
    assert {obj for obj, _ in called} >= {"client", "publisher", "RolloutClient", "WeightPublisher"}


def test_readme_is_a_front_page_whose_links_reach_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is the front page: move text into a page under docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    # Every page a reader can reach from the site's navigation is linked from the README too
    # (the Python API by its first page), so the front page stays the map of the docs.
    linked = {str((ROOT / link).resolve().relative_to(DOCS)) for link in links if link.startswith("docs/") and link.endswith(".md")}
    missing = [p for p in pages(nav) if p not in linked and p != "index.md" and not p.startswith("reference/python/")]
    assert missing == [], f"pages the README does not link: {missing}"


def test_the_smallest_config_of_the_quickstart_is_a_valid_config():
    from rollout.config import PlatformConfig

    text = QUICKSTART.read_text()
    block = text[text.index("The smallest config names only the model") :].split("```yaml\n", 1)[1].split("```", 1)[0]
    config = yaml.safe_load(block)
    # tests/test_cli_serve.py serves exactly these sections, with a real model path.
    assert set(config) == {"model", "http"} and set(config["model"]) == {"path"}
    PlatformConfig.model_validate(config)


def test_http_reference_and_committed_schema_are_generated_from_the_ingress():
    from rollout import config_docs
    from rollout.readme_section import section

    schema = config_docs.openapi_schema()
    assert config_docs.OPENAPI_FILE.read_text() == config_docs.openapi_json(schema), "docs/reference/openapi.json is stale: run `make http-docs`"
    block = section(HTTP_PAGE.read_text(), config_docs.HTTP_BEGIN, config_docs.HTTP_END)
    assert block == config_docs.render_http(schema), "docs/reference/http.md is stale: run `make http-docs`"
    # The raw-HTTP storage publish the page walks through names the routes and fields it uses.
    for route in ("### `POST /v1/sync/storage-rounds`", "### `POST /v1/sync/rounds/{round_id}/finish`"):
        assert route in block
    for field in ("checkpoint", "manifest", "params"):
        assert f"| `{field}` |" in block.split("### `POST /v1/sync/storage-rounds`")[1].split("\n### ")[0]


def test_gpu_section_is_generated_from_the_committed_results():
    from rollout import gpu_report

    text = GPU.read_text()
    block = text[text.index(gpu_report.BEGIN) : text.index(gpu_report.END) + len(gpu_report.END)]
    assert block == gpu_report.render_files(gpu_report.all_results()), "docs/gpu.md is stale: run `make gpu-report`"


def test_benchmark_numbers_are_generated_from_the_committed_json():
    from rollout.bench import report

    from rollout.readme_section import section

    assert section(BENCHMARKS.read_text(), report.BEGIN, report.END) == report.render(), "docs/benchmarks.md is stale: run `rollout bench-report --page docs/benchmarks.md` (make bench does)"
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
    return CONCEPTS.read_text()


def test_how_it_is_built_names_modules_that_exist():
    import re

    section = _how_it_is_built()
    package = ROOT / "platform" / "rollout"
    named = set(re.findall(r"`rollout/([\w/]+\.py)`", section)) | set(re.findall(r"\b((?:contracts|sync|engine|routing|http|client)/[\w/]+\.py)\b", section))
    assert len(named) > 20
    assert sorted(p for p in named if not (package / p).is_file()) == []


def test_a_publish_is_followed_through_at_most_eight_modules():
    import re

    section = _how_it_is_built()
    diagram = section[section.index("A publish, from the trainer's call") :].split("```")[1]
    modules = set(re.findall(r"\b(sync/[\w/<>]+\.py)\b", diagram))
    assert 0 < len(modules) <= 8, sorted(modules)
