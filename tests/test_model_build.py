from __future__ import annotations

import hashlib
import json

from rollout.modelbuild import build_model


def _digest(d):
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in ("model.safetensors", "tokenizer.json", "config.json")}


def test_model_build_is_deterministic_from_the_seed(tmp_path):
    a = build_model(tmp_path / "a", seed=3)
    b = build_model(tmp_path / "b", seed=3)
    c = build_model(tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b)
    assert _digest(a)["model.safetensors"] != _digest(c)["model.safetensors"]


def test_built_model_has_head_dim_64_and_untied_embeddings(tmp_path):
    cfg = json.loads((build_model(tmp_path / "m") / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg["tie_word_embeddings"] is False
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]


def test_built_tokenizer_round_trips_text_and_has_a_chat_template(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_model(tmp_path / "m")))
    text = "the reward is 42 because the policy learns!"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
