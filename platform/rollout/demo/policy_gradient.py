"""The trainer half of the demo: a GRPO-style policy-gradient step on a transformers model.

Advantages are rewards minus their group mean (the ``n`` samples of one prompt), so
no value model is needed; the loss is the advantage-weighted logprob of the sampled
tokens, recomputed by the trainer under its own weights.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rollout.api import RolloutResult


def group_advantages(rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        out.append([r - mean for r in group])
    return out


def policy_gradient_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, results: Sequence[RolloutResult], advantages: Sequence[Sequence[float]], pad_id: int) -> float:
    """One optimizer step; returns the loss."""
    seqs, comp_starts, advs = [], [], []
    for result, group_adv in zip(results, advantages):
        for sample, adv in zip(result.samples, group_adv):
            if not sample.token_ids or adv == 0.0:
                continue
            seqs.append(result.prompt_token_ids + sample.token_ids)
            comp_starts.append(len(result.prompt_token_ids))
            advs.append(adv)
    if not seqs:
        return 0.0
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)  # which positions are sampled tokens
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, comp_starts)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        mask[i, start : len(s)] = True
    model.train()
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    weights = torch.tensor(advs).unsqueeze(1) * mask[:, 1:]
    loss = -(logp * weights).sum() / mask[:, 1:].sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()
    return loss.item()  # the number, not the graph (float() of a tensor that requires grad warns)
