"""``make demo``: a real RL loop on CPU.

A trainer (the transformers model of the served architecture) samples groups of
rollouts through the client, scores them (reward: how often the target token appears
in a sample), takes a policy-gradient step and publishes the new weights; every
rollout of the next step must come from that version. It prints a progress bar and a
line per step, then a throughput/latency summary, and writes a PNG report.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import time
from pathlib import Path

from tqdm import tqdm

from rollout.api import RolloutRequest, SamplingConfig
from rollout.stats_summary import percentiles

TARGET_TEXT = " reward"


def _prompts(n: int, rng: random.Random) -> list[str]:
    words = "the policy model answer question value action state group replica weight update".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]


def _quiet_libraries() -> None:
    """The demo's output is the platform's lines and its progress bar. This process is the
    trainer: it imports vLLM only to build the app (whose import-time notes about GPU
    kernels on a CPU machine are not the demo's), and Ray's, Serve's and transformers'
    notes of their own progress (a local cluster started, weights loaded) are not either;
    their warnings and errors still show."""
    from transformers.utils import logging as hf_logging

    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("rollout").setLevel(logging.INFO)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # before vLLM's import, which logs
    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()


def _steps(client, publisher, model, optimizer, tokenizer, target: int, steps: int, prompts_per_step: int, n: int, max_tokens: int, rng: random.Random, history: list, latencies: list, totals: list) -> None:
    from rollout.demo.policy_gradient import group_advantages, policy_gradient_step

    version = 0
    bar = tqdm(range(1, steps + 1), desc="RL steps", unit="step")
    for step in bar:
        requests = [RolloutRequest(prompt=p, n=n, sampling=SamplingConfig(max_tokens=max_tokens, temperature=1.0)) for p in _prompts(prompts_per_step, rng)]
        t0 = time.perf_counter()
        results = client.generate_sync(requests)
        wall = time.perf_counter() - t0
        # What the step's rollouts used of the KV cache at their peak: the replica keeps it
        # from the engine's every step (polling the usage misses a burst this short, and an
        # idle replica reports 0). One replica serves the demo: its peak is the step's.
        kv_peak = client.stats_sync().kv_cache_usage_peak
        latencies.append(wall)
        tokens = sum(len(s.token_ids) for r in results for s in r.samples)
        totals[0], totals[1] = totals[0] + tokens, totals[1] + wall
        stale = {sp.version for r in results for s in r.samples for sp in s.weight_versions} - {version}
        if stale:
            raise RuntimeError(f"step {step}: samples from versions {stale}, expected {version}")
        rewards = [[s.token_ids.count(target) / max(1, len(s.token_ids)) for s in r.samples] for r in results]
        loss = policy_gradient_step(model, optimizer, results, group_advantages(rewards), tokenizer.pad_token_id)
        t1 = time.perf_counter()
        version = publisher.publish(model.named_parameters())
        sync_ms = (time.perf_counter() - t1) * 1000
        mean_reward = sum(map(sum, rewards)) / sum(map(len, rewards))
        row = {"step": step, "reward": mean_reward, "loss": loss, "version": version, "tokens_per_s": tokens / wall, "sync_ms": sync_ms, "kv_cache_usage": kv_peak}
        history.append(row)
        kv = f"{kv_peak:6.1%}" if kv_peak is not None else "     -"
        bar.write(f"step {step:3d}  reward {mean_reward:.3f}  version {version:3d}  {tokens / wall:7.0f} tok/s  KV peak {kv}  sync {sync_ms:6.1f} ms  loss {loss:+.4f}")
    bar.close()


def run_demo(model_dir: Path, steps: int = 30, prompts_per_step: int = 8, n: int = 8, max_tokens: int = 16, lr: float = 3e-3, out_dir: Path = Path("build/demo")) -> int:
    _quiet_libraries()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.client import RolloutClient
    from rollout.demo.report import write_report
    from rollout.local import cpu_config, local_platform
    from rollout.modelbuild import build_model, is_built
    from rollout.sync import WeightPublisher

    if not is_built(model_dir):
        print(f"building the demo model in {model_dir} ...")
        build_model(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    (target,) = tokenizer.encode(TARGET_TEXT)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    os.environ.setdefault("ROLLOUT_SYNC_TOKEN", secrets.token_hex(16))
    cfg = cpu_config(model_dir)
    rng = random.Random(0)
    print(f"starting Ray and the platform (about a minute on 2 cores); target token {TARGET_TEXT!r} = id {target}")
    history: list[dict] = []
    latencies: list[float] = []
    totals = [0, 0.0]  # tokens, seconds
    with local_platform(cfg, quiet=True):
        client = RolloutClient.connect(app_name=cfg.app_name)
        publisher = WeightPublisher.connect(app_name=cfg.app_name)
        try:
            _steps(client, publisher, model, optimizer, tokenizer, target, steps, prompts_per_step, n, max_tokens, rng, history, latencies, totals)
        finally:
            # Before the platform goes: the publisher's transfer group and the client's
            # handles are the last things that talk to it.
            publisher.close()
            client.close()
    total_tokens, total_time = totals
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "history.json").write_text(json.dumps(history, indent=2))
    png = write_report(out_dir / "report.png", history)
    p = percentiles(latencies)
    first = sum(h["reward"] for h in history[:3]) / min(3, len(history))
    last = sum(h["reward"] for h in history[-3:]) / min(3, len(history))
    print()
    print("summary")
    print(f"  steps           {len(history)} ({prompts_per_step} prompts x {n} samples x {max_tokens} tokens)")
    print(f"  reward          {first:.3f} (first 3 steps) -> {last:.3f} (last 3 steps)")
    print(f"  rollouts        {total_tokens} tokens in {total_time:.1f} s = {total_tokens / total_time:,.0f} tokens/s")
    print(f"  step latency    p50 {p['p50'] * 1000:.0f} ms   p90 {p['p90'] * 1000:.0f} ms   p99 {p['p99'] * 1000:.0f} ms")
    print(f"  weight sync     median {sorted(h['sync_ms'] for h in history)[len(history) // 2]:.0f} ms per publish")
    peaks = [h["kv_cache_usage"] for h in history if h["kv_cache_usage"] is not None]
    print(f"  KV cache        {f'peak {max(peaks):.1%} of the cache in a step' if peaks else 'no peak reported (a replica of an older platform)'}")
    print(f"  report          {png}")
    return 0
