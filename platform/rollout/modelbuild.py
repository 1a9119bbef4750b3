"""Build the demo/test model in code: no hub downloads anywhere.

A Qwen2-architecture causal LM (or, preset ``moe``, a Qwen3-MoE one) with random weights and a byte-level BPE tokenizer
trained here on a seeded synthetic corpus, both written with ``save_pretrained``.
Everything is a function of the seed and the size preset, so two builds are identical.

Why these settings: head_dim must be 64 on CPU (vLLM's CPU attention rejects 16); untied
embeddings with ``initializer_range=0.2`` make greedy output varied and dependent on
the prompt. With tied embeddings and the default init an untrained model repeats the
last prompt token, which would let a broken engine pass token-equality tests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an policy reward model token sample step gradient agent answer question "
    "value action state return advantage group prompt replica engine weight version "
    "update train learn fast slow small large red green blue one two three four five "
    "six seven eight nine ten is are was be has have do does can will not and or but "
    "if then else for while with from into over under good bad best worst number "
    "math add sum product equal yes no true false because so when where why how what"
).split()


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "float32"
    # Mixture of experts (Qwen3-MoE) when num_experts > 0: every layer's MLP is num_experts
    # experts of moe_intermediate_size, top_k of them per token.
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    # The std of every weight's random init (transformers' initializer_range). 0.2, large,
    # makes greedy output varied and dependent on the weights (see the module's docstring).
    initializer_range: float = 0.2
    # A MoE model's router (gate) weights' std, where it differs from initializer_range.
    router_initializer_range: float | None = None


SIZES = {
    # ~0.7M parameters: fast enough for CI on two cores.
    "tiny": ModelSize(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=256, vocab_size=2048),
    # ~30M parameters: large enough that weight-sync cost matters on CPU (benchmarks).
    "medium": ModelSize(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=1536, vocab_size=8192),
    # ~1.5B parameters in bf16 (GPU check): Qwen2-1.5B's attention and depth (hidden 1536,
    # 28 layers, 12 query / 2 KV heads, head_dim 128); its MLP is wider (10240, not 8960)
    # to stand in for the 151k-token embeddings a tokenizer trained here cannot have.
    "1.5b": ModelSize(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=10240, vocab_size=8192, dtype="bfloat16"),
    # ~0.9B parameters in bf16 (the GPU check of routed experts and FP8): Qwen3-MoE's shape
    # (q/k norms, head_dim 128, normalised top-k) with 64 experts of which 8 per token in
    # each of 12 layers: uint8 expert ids, as vLLM returns them for up to 256 experts.
    # Its routers decide and its layers barely drift: the first GPU run (b9f641b), with every
    # weight at 0.2, saw vLLM and a transformers teacher on the same weights part on 1,029 of
    # 4,740 (token, layer) top-8 choices beyond any near-tie, the hidden states feeding each
    # router already apart after a few chaotic random layers. Small weights elsewhere make each
    # layer a small, smooth step; routers at 0.2 on their RMS-normalised input spread the logits
    # with a std of ~6.4 (hidden 1024), so the top-8 boundary has room. Measured on CPU
    # (tests/gpu/moe_routing_drift.py): bf16 against float32 on these weights, 93% of the check's
    # (token, layer) pairs pick the same 8 experts and the rest swap experts within 0.047 of the
    # logits' std. The attention output outweighs the 0.02 embeddings, so neighbouring tokens
    # route alike (31% of pairs equal one token apart), which the check allows for.
    "moe": ModelSize(
        hidden_size=1024, num_layers=12, num_heads=8, num_kv_heads=2, intermediate_size=3072, vocab_size=8192, dtype="bfloat16",
        num_experts=64, top_k=8, moe_intermediate_size=384, initializer_range=0.02, router_initializer_range=0.2,
    ),
}


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(out_dir: str | Path, seed: int = 0, size: str = "tiny", max_position_embeddings: int = 2048) -> Path:
    """Write a model + tokenizer to ``out_dir``; return the directory."""
    import torch
    from transformers import GenerationConfig

    if size not in SIZES:
        raise ValueError(f"size: unknown preset {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, spec.vocab_size, seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype=spec.dtype,
    )
    if spec.num_experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # `num_experts` is Qwen3-MoE's own name (transformers 5 maps it to num_local_experts).
        config = Qwen3MoeConfig(
            **common, num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1
        )
        model_cls = Qwen3MoeForCausalLM
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    dtype = getattr(torch, spec.dtype)
    torch.manual_seed(seed)
    # Initialised in float32 everywhere (the same weights on any machine), then cast.
    model = model_cls(config)
    if spec.router_initializer_range is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, spec.router_initializer_range)
    model = model.to(dtype)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(str(out))
    (out / "rollout-model.json").write_text(json.dumps({"seed": seed, "size": size}, indent=2))
    return out


def is_built(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return (out / "config.json").exists() and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


if __name__ == "__main__":
    # Standalone use needs only torch, transformers and tokenizers (not this package's
    # other dependencies): the GPU check builds its models with a lent machine's own
    # Python while our stack is still being carried there.
    #   python -P modelbuild.py DIR [SIZE] [SEED]   (-P: this folder holds a package named
    #   `http`, which must not shadow the standard library)
    import sys

    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit("usage: python -P modelbuild.py DIR [SIZE] [SEED]")
    target = build_model(args[0], size=args[1] if len(args) > 1 else "tiny", seed=int(args[2]) if len(args) > 2 else 0)
    print(f"built {args[1] if len(args) > 1 else 'tiny'} model in {target}")
