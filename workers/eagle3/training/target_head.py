"""The target's tensors the training needs, read straight from its safetensors files
without loading the model: the token embedding and lm_head (the draft's input embedding
and its training targets) and the final norm. `workers.train` trains with them; the
speculators format (workers/eagle3/draft/speculators_draft.py) ships the embedding."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.eagle3.training.train_data import TrainError


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of the checkpoint in `model_dir`."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    names: dict[str, Path] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def text_first(names: Iterable[str]) -> list[str]:
    """Tensor names, a multimodal target's language model's first, then the shortest."""
    return sorted(names, key=lambda n: ("language_model" not in n, len(n)))


def read_tensor(files: dict[str, Path], name: str, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def read_target_config(model_dir: Path) -> dict[str, Any]:
    """The target's config.json."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise TrainError(f"--target {str(model_dir)!r} has no config.json")
    config: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    return config


def load_target_head(model_dir: Path, device: torch.device,
                     dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(config.json, embed_tokens [V, H], lm_head [V, H]) of the target, reading only
    those two tensors; lm_head is the embedding when the target ties them. A multimodal
    target's are its language model's (Kimi-K2.5: `language_model.model.embed_tokens`,
    `language_model.lm_head`), never a vision tower's."""
    config = read_target_config(model_dir)
    files = tensor_files(model_dir)
    embeds = text_first(n for n in files if n.endswith("embed_tokens.weight"))
    heads = text_first(n for n in files if n == "lm_head.weight" or n.endswith(".lm_head.weight"))
    if not embeds:
        raise TrainError(f"--target {str(model_dir)!r}: no embed_tokens weight in its "
                         "safetensors files")
    text = config.get("text_config") or config
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if not heads and not tied:
        quantized = any(n.endswith("lm_head.weight_packed") for n in files)
        raise TrainError(f"--target {str(model_dir)!r}: no lm_head weight and the "
                         "embeddings are not tied" + (" (its lm_head is quantized; the "
                         "training targets need it in full precision)" if quantized else ""))

    embed = read_tensor(files, embeds[0], device, dtype)
    return config, embed, read_tensor(files, heads[0], device, dtype) if heads else embed


def load_target_norm(model_dir: Path, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """The target's final norm weight [H] (`model.norm.weight`, a multimodal target's
    language model's), None when its files have none by that name."""
    files = tensor_files(model_dir)
    names = text_first(n for n in files if n == "model.norm.weight"
                       or n.endswith(".model.norm.weight"))
    return read_tensor(files, names[0], device, dtype) if names else None
