"""A tiny random Llama with a real tokenizer and chat template, built locally with no
download: for tests and for `jobsup demo`. `python -m workers.tiny OUT_DIR`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|end|>"]
DEMO_PROMPTS = Path(__file__).parent / "data" / "demo_prompts.jsonl"


def build_tokenizer(texts: Iterable[str], vocab_size: int = 384) -> Any:
    """A byte-level BPE trained on `texts`, wrapped as a fast HF tokenizer with a chat
    template (so `apply_chat_template` and offsets work as with real models)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|end|>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def corpus(prompts_file: Path = DEMO_PROMPTS) -> list[str]:
    texts: list[str] = []
    with open(prompts_file, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            texts.extend(m["content"] for m in record["messages"])
    # some generic text so generated answers are not all <unk>-like bytes
    texts += ["The answer is that the model writes one token at a time, and the draft "
              "model predicts several of them ahead so the target can verify them in one "
              "pass. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000."] * 4
    return texts


def build_tiny_llama(out_dir: str | Path, *, layers: int = 8, hidden: int = 64,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                     vocab_size: int = 384, seed: int = 0,
                     texts: Iterable[str] | None = None) -> Path:
    """Save a random LlamaForCausalLM and its tokenizer to `out_dir`; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts if texts is not None else corpus(), vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


LAYOUTS = ("llama", "qwen3_moe", "deepseek_v3", "kimi_k25", "kimi_k25_released")
"""Target layouts `build_tiny_target` makes: a dense Llama, two MoE causal LMs, and
Kimi-K2.5's multimodal wrapper around a DeepSeek-V3 language model, as transformers
saves it and with the released checkpoint's language-model tensor names."""


def _text_config(layout: str, vocab_size: int, layers: int, hidden: int, tokenizer: Any) -> Any:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False,
               "vocab_size": vocab_size, "hidden_size": hidden, "num_hidden_layers": layers,
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    if layout == "llama":
        return LlamaConfig(intermediate_size=2 * hidden, num_attention_heads=4,
                           num_key_value_heads=2, **special)
    if layout == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the rest 8 experts top-2
        return Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                              num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                              num_key_value_heads=2, mlp_only_layers=[0],
                              **special)
    # DeepSeek-V3 (and Kimi-K2's language model): MLA, a first dense layer, 8 routed
    # experts in 2 groups (top-1 group, top-2 experts) plus a shared one
    return DeepseekV3Config(intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                            n_shared_experts=1, first_k_dense_replace=1, num_attention_heads=4,
                            num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **special)


def build_tiny_target(out_dir: str | Path, layout: str = "llama", *, layers: int = 8,
                      hidden: int = 64, seed: int = 0) -> Path:
    """Save a random model of `layout` (one of LAYOUTS), built from transformers' own
    classes, with a real tokenizer and chat template, to `out_dir`; returns it."""
    import torch

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if layout == "llama":
        return build_tiny_llama(out_dir, layers=layers, hidden=hidden, seed=seed)
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus())
    text = _text_config(layout, len(tokenizer), layers, hidden, tokenizer)
    torch.manual_seed(seed)
    if layout.startswith("kimi_k25"):
        from transformers.models.kimi_k25 import (
            Kimi_K25Config,
            Kimi_K25ForConditionalGeneration,
        )

        config = Kimi_K25Config(
            text_config=text.to_dict(), tie_word_embeddings=False, projection_hidden_size=32,
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2})
        model: Any = Kimi_K25ForConditionalGeneration(config)
    else:
        model = AutoModelForCausalLM.from_config(text)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if layout == "kimi_k25_released":
        _rename_to_release_names(out / "model.safetensors")
    return out


def _rename_to_release_names(file: Path) -> None:
    """transformers (5.x) saves Kimi-K2.5's decoder layers as `language_model.model.
    blocks.N` (its weight renames run backwards over the vision tower's `blocks`); the
    released checkpoint names them `language_model.model.layers.N`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    renamed = {name.replace("language_model.model.blocks.", "language_model.model.layers."):
               tensor for name, tensor in tensors.items()}
    save_file(renamed, file, metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write the model into")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_llama(args.out, layers=args.layers, hidden=args.hidden, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
