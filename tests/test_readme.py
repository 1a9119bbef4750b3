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
