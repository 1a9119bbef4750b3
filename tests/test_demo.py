"""``make demo``'s parts that need no platform: the trainer's step and the report (the
whole demo runs as ``rollout demo``; issue 43 named what made a working run look broken)."""

from __future__ import annotations

import warnings

import torch

from rollout.api import RolloutResult, Sample


def test_a_policy_gradient_step_returns_the_loss_as_a_number_without_a_warning(model_dir):
    from transformers import AutoModelForCausalLM

    from rollout.demo.policy_gradient import group_advantages, policy_gradient_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    samples = [Sample(token_ids=[5, 6, 7]), Sample(token_ids=[8, 9])]
    results = [RolloutResult(request_id="r", prompt_token_ids=[1, 2, 3], samples=samples)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Converting a tensor with requires_grad=True to a scalar" was one
        loss = policy_gradient_step(model, optimizer, results, group_advantages([[1.0, 0.0]]), pad_id=0)
    assert type(loss) is float and loss == loss


def test_the_report_draws_the_steps_kv_peak_and_says_so_when_no_replica_reported_one(tmp_path, monkeypatch):
    from rollout.demo import report

    row = {"step": 1, "reward": 0.1, "loss": 0.0, "version": 1, "tokens_per_s": 100.0, "sync_ms": 50.0, "kv_cache_usage": 0.03}
    titles: list[str] = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: (titles.append(t), original(self, t, *a, **k))[1])
    assert report.write_report(tmp_path / "a.png", [row, {**row, "step": 2, "kv_cache_usage": 0.05}]).stat().st_size > 0
    assert "the step's peak KV-cache usage" in titles
    titles.clear()
    assert report.write_report(tmp_path / "b.png", [{**row, "kv_cache_usage": None}]).stat().st_size > 0
    (kv,) = [t for t in titles if "KV" in t]
    assert "not reported" in kv
