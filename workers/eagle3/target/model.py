"""The target model as the workers need it, whatever its checkpoint is: a causal LM
(Llama, Qwen3-MoE, DeepSeek-V3, ...) or a multimodal model whose text half is one
(Kimi-K2.5: `model_type: kimi_k25`, the DeepSeek-V3 language model under
`text_config`, vision tower and projector beside it).

What the workers use is the same in both cases, and `Target` names it:
- `decoder`: the text decoder, with `layers`, the final `norm` and the token embedding
  (extraction hooks its layers; HF's `output_hidden_states[i]` is the input of layer i);
- `lm_head`: the output projection of the language model (the training targets);
- `text_config`: `config.get_text_config()`, where `hidden_size`, `num_hidden_layers`
  and `vocab_size` live (a multimodal config has none of them at the top level);
- `model`: what was loaded, for `generate()` and full forward passes.

How a checkpoint becomes one: workers/eagle3/target/loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TargetError(Exception):
    """The checkpoint is not a model the workers can use; the message says why."""


@dataclass(frozen=True)
class Target:
    model: Any
    decoder: Any
    lm_head: Any | None
    text_config: Any
    experts: str = "dense"
    """How the routed experts are held: 'packed', 'dequantized' (a packed-INT4
    checkpoint), or 'dense' (a checkpoint without packed experts)."""

    @classmethod
    def of(cls, model: Any, experts: str = "dense") -> Target:
        """The text parts of a loaded (or meta-device) model."""
        decoder, lm_head = text_parts(model)
        return cls(model, decoder, lm_head, model.config.get_text_config(decoder=True),
                   experts)

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def dtype(self) -> Any:
        """The compute dtype: the embedding's (a quantized model's first parameter can
        be packed integers)."""
        return self.decoder.get_input_embeddings().weight.dtype


def text_parts(model: Any) -> tuple[Any, Any | None]:
    """(decoder, lm_head) of a causal LM or of a multimodal model's language model."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, ValueError) as exc:
        raise TargetError(f"{type(model).__name__}: no text decoder found ({exc})") from None
    missing = [name for name in ("layers", "norm") if not hasattr(decoder, name)]
    if missing:
        raise TargetError(f"{type(model).__name__}: its decoder {type(decoder).__name__} has "
                          f"no {' or '.join(missing)} (a decoder-only text model is needed)")
    return decoder, model.get_output_embeddings()


def model_class(config: Any) -> Any:
    """The auto class that builds this config's model with its language-model head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    raise TargetError(f"model_type {config.model_type!r} ({type(config).__name__}) is neither "
                      "a causal LM nor a multimodal model with a language model in this "
                      "transformers version")


def load_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"{path}: cannot read its config.json: {exc}") from None
