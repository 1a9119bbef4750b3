"""How far bf16 routing drifts from a float32 teacher on the ``moe`` preset, on CPU: the
measurement behind ``tests.gpu.compare.ROUTE_TIE`` and ``ROUTE_AGREE_FLOOR`` (GPU check 15).

transformers runs the model twice on the same bf16 weights: in bf16 (weights, activations,
KV cache and router logits, as vLLM's unquantized gate returns them: the stand-in for the
engine, each prompt prefilled and every other token decoded alone, as served; also the whole
sequence in one forward) and in float32 (the check's teacher, one forward). The sequences are the check's: its prompts with 24 greedy
tokens each, four sampled continuations of the first, a two-turn chat episode. It prints the
router logits' error by layer, the judgement of the bf16 rows (``compare.judge_routing``),
and the same judgement of rows a broken platform would return (one token late or early,
another router, a publish not taken, layers off by one).

    PYTHONPATH=platform python -m tests.gpu.moe_routing_drift DIR [--cache FILE]

DIR holds the ``moe`` model (built there when missing). ~10 minutes on two cores; --cache
keeps the logits, so a second run only judges.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from tests.gpu.compare import ROUTE_AGREE_FLOOR, ROUTE_TIE, judge_routing, routing_failures

PROMPTS = [[5, 17, 42, 99, 3], [100, 200, 300], [7] * 40, list(range(10, 74)), [900, 12, 77], [31] * 5 + [8] * 5]  # test_gpu_moe.PROMPTS


def sequences(model, path: Path) -> list[tuple[str, list[int], list[tuple[int, int]]]]:
    """(kind, token ids, the spans the engine prefills: every other token it decodes alone)."""
    from transformers import AutoTokenizer

    gen = dict(pad_token_id=0, eos_token_id=None)
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            out.append(("greedy", model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, **gen)[0].tolist(), [(0, len(p))]))
        for i in range(4):
            torch.manual_seed(i)
            ids = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, **gen)[0].tolist()
            out.append(("sampled", ids, [(0, len(PROMPTS[0]))]))
        tok = AutoTokenizer.from_pretrained(str(path))

        def chat(content: str) -> list[int]:
            ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        first, second = chat("the policy reward model is"), chat("and then?")
        turn1 = model.generate(torch.tensor([first]), max_new_tokens=12, do_sample=False, **gen)[0].tolist()
        ids = model.generate(torch.tensor([turn1 + second]), max_new_tokens=12, do_sample=False, **gen)[0].tolist()
        # Turn 2 prefills what the engine has not run: turn 1's last token and the new message.
        out.append(("episode", ids, [(0, len(first)), (len(turn1) - 1, len(turn1) + len(second))]))
    return out


def _hooked(model, run) -> list[torch.Tensor]:
    store: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, o: store.append(o[0] if isinstance(o, tuple) else o)) for layer in model.model.layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return store


def router_logits(model, ids: list[int]) -> torch.Tensor:
    """``[tokens, layers, experts]`` float32: the gates' outputs (bf16 in a bf16 model) over
    the whole sequence in one forward, as the teacher runs it."""
    store = _hooked(model, lambda: model(torch.tensor([ids])))
    return torch.stack([x.reshape(len(ids), -1).float() for x in store], dim=1)


def router_logits_as_served(model, ids: list[int], prefills: list[tuple[int, int]]) -> torch.Tensor:
    """The same for all tokens but the last, run as the engine runs them: each span in
    ``prefills`` in one forward, every other token alone, on a KV cache of the model's dtype."""
    from transformers import DynamicCache

    starts = dict(prefills)
    cache = DynamicCache()
    rows, t = [], 0
    while t < len(ids) - 1:
        end = min(starts.get(t, t + 1), len(ids) - 1)
        store = _hooked(model, lambda: model(torch.tensor([ids[t:end]]), past_key_values=cache, use_cache=True))
        rows.append(torch.stack([x.reshape(end - t, -1).float() for x in store], dim=1))
        t = end
    return torch.cat(rows)


def measure(path: Path):
    """(kind, ids, bf16 logits as served, float32 teacher's, bf16 in one forward) per sequence;
    the last token has no routing (the engine never runs it)."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return [
        (kind, ids, router_logits_as_served(bf16, ids, spans), router_logits(fp32, ids)[:-1], router_logits(bf16, ids)[:-1])
        for kind, ids, spans in sequences(bf16, path)
    ]


def report(recs) -> None:
    k = 8
    err = torch.cat([(a - b).abs() for _, _, a, b, _ in recs])
    for layer in range(err.shape[1]):
        x = err[:, layer].flatten()
        print(f"layer {layer:2d}: |bf16 as served - fp32| router logit error median {x.median():.4f}, p99 {x.quantile(0.99):.4f}, max {x.max():.4f}")
    print(f"teacher logits' std {torch.cat([b for _, _, _, b, _ in recs]).std():.3f}; near-tie tolerance {ROUTE_TIE} std, agreement floor {ROUTE_AGREE_FLOOR:.0%}")
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    cases = {
        "honest (bf16, prefill + decode, as served)": lambda a: a.topk(k, -1).indices,
        "honest (bf16, one forward)": None,
        "one token late": lambda a: torch.cat([a[1:], a[-1:]]).topk(k, -1).indices,
        "one token early": lambda a: torch.cat([a[:1], a[:-1]]).topk(k, -1).indices,
        "another router": lambda a: perm[a.topk(k, -1).indices],
        "a publish not taken (ids + 1)": lambda a: (a.topk(k, -1).indices + 1) % 64,
        "layers off by one": lambda a: torch.roll(a.topk(k, -1).indices, 1, dims=1),
    }
    for name, rows_of in cases.items():
        if rows_of is None:
            verdicts = [judge_routing(whole.topk(k, -1).indices.numpy(), b.numpy()) for _, _, _, b, whole in recs]
        else:
            verdicts = [judge_routing(rows_of(a).numpy(), b.numpy()) for _, _, a, b, _ in recs]
        pairs, agree = sum(v.pairs for v in verdicts), sum(v.agree for v in verdicts)
        inv = np.array([x[2] for v in verdicts for x in [*v.near_ties, *v.beyond]])
        q = (lambda p: float(np.quantile(inv, p))) if inv.size else (lambda p: 0.0)
        swapped = np.bincount([len(set(b[3]) - set(b[4])) for v in verdicts for b in v.beyond], minlength=9)
        print(
            f"{name}: {agree}/{pairs} agree ({agree / pairs:.1%}); {sum(len(v.near_ties) for v in verdicts)} near-ties, "
            f"{sum(len(v.beyond) for v in verdicts)} beyond ({sum(len(v.beyond) for v in verdicts) / pairs:.1%}); inversions (std) "
            f"p1 {q(0.01):.3f} median {q(0.5):.3f} p99 {q(0.99):.3f} max {q(1.0):.3f}; beyond ones swapped {swapped.tolist()} experts; "
            f"the check {'FAILS' if routing_failures(verdicts) else 'passes'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--cache", type=Path)
    a = ap.parse_args()
    if a.cache and a.cache.exists():
        recs = torch.load(a.cache)
    else:
        from rollout.modelbuild import build_model, is_built

        if not is_built(a.model):
            build_model(a.model, size="moe")
        torch.set_num_threads(max(1, torch.get_num_threads()))
        recs = measure(a.model)
        if a.cache:
            torch.save(recs, a.cache)
    print(f"{len(recs)} sequences, {sum(len(ids) for _, ids, *_ in recs)} tokens")
    report(recs)


if __name__ == "__main__":
    main()
