"""A trained draft made ready for vllm-project/speculators (`python -m workers.export --to
speculators --draft DIR --target TARGET --out OUT`): OUT/draft/ and the exact `speculators
convert` command line that turns it into speculators' own format.

Why not the draft as `workers.train` saves it (out/train/draft/), which vLLM and SGLang
load as it is:
- **The embedding.** That draft has no `embed_tokens` (both engines take the target's).
  speculators 0.9.0 fills a missing embedding from the target only when the tensor it
  built still holds the NaN it initialised it with (`DraftVocabMixin._init_vocab`, then
  `_load_verifier_weights`: `if ... self.embed_tokens.weight.isnan().any()`), but
  transformers' `from_pretrained` allocates a missing weight without initialising it:
  uninitialised memory, so the check passes or fails by chance (2 and 6 of 20 loads right
  in two runs on a tiny Llama, std from 1e-42 to 1e+35 otherwise). OUT/draft/ therefore carries the
  target's `embed_tokens.weight`, which its converter keeps and its loader then reads.
- **The layer ids.** `speculators convert` does not read the draft's
  `eagle_aux_hidden_state_layer_ids`; without `--algorithm-kwargs` it writes `null` and
  speculators' default `[2, N//2, N-3]` applies, wrong for a draft trained on others.
  The command line printed passes the draft's own (layer inputs, vLLM's convention,
  which is speculators').
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.eagle3.draft import serving
from workers.eagle3.draft.model import DraftFileError, read_draft_config

DRAFT_DIR = "draft"
"""OUT/draft/: the draft with the target's embedding, the converter's input."""
CONVERTED_DIR = "speculators_draft"
"""OUT/speculators_draft/: where the printed `speculators convert` line writes."""
EMBED_KEY = "embed_tokens.weight"
"""The name speculators' converter looks for (`has_drafter_embedding`) and keeps."""


class SpeculatorsDraftError(Exception):
    """A draft or target that cannot make a speculators draft."""


def target_text_config(target: Path) -> dict[str, Any]:
    file = target / "config.json"
    if not file.is_file():
        raise SpeculatorsDraftError(f"--target {target}: no config.json")
    config = json.loads(file.read_text(encoding="utf-8"))
    text: dict[str, Any] = config.get("text_config") or config
    return text


def draft_tensors(draft_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        raise SpeculatorsDraftError(f"--draft {draft_dir}: no safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def write_speculators_draft(draft_dir: Path, target: Path, out: Path) -> tuple[Path, list[int]]:
    """OUT/draft/: the draft's config.json as it is and its tensors plus the target's
    embedding (in the draft's dtype, which the converter casts everything to anyway),
    built under a temp name and swapped in. Returns the directory and the layer inputs
    the draft was trained on (stated in its config, else the engines' default)."""
    from workers.eagle3.training.target_head import load_target_head
    from workers.eagle3.training.train_data import TrainError

    num_layers = int(target_text_config(target)["num_hidden_layers"])
    try:
        config = read_draft_config(draft_dir, num_layers)
    except DraftFileError as exc:
        raise SpeculatorsDraftError(str(exc)) from exc
    layers = config.aux_layer_ids or serving.default_layer_ids(num_layers)
    tensors = draft_tensors(draft_dir)
    if "fc.weight" not in tensors:
        raise SpeculatorsDraftError(f"--draft {draft_dir}: not an EAGLE-3 draft (no fc.weight)")
    dtype = tensors["fc.weight"].dtype
    try:
        _, embed, _ = load_target_head(target, torch.device("cpu"), dtype)
    except TrainError as exc:
        raise SpeculatorsDraftError(str(exc)) from exc
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise SpeculatorsDraftError(
            f"--target {target}: its embedding is {list(embed.shape)}, the draft needs "
            f"[{config.vocab_size}, {config.hidden_size}]: a draft for another target?")
    tensors[EMBED_KEY] = embed.contiguous()
    final = out / DRAFT_DIR
    tmp = out / f".{DRAFT_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(draft_dir / "config.json", tmp / "config.json")
    old = out / f".{DRAFT_DIR}.old-{os.getpid()}"
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final, layers


def convert_command(draft: Path, target: Path, output: Path, layers: list[int]) -> list[str]:
    """`speculators convert` (0.9.0) for OUT/draft/, the layer ids passed explicitly.
    Absolute paths: the verifier path is written into the converted config and read
    again by every later load."""
    kwargs = json.dumps({"eagle_aux_hidden_state_layer_ids": [int(i) for i in layers]})
    return ["speculators", "convert", str(draft.resolve()), "--algorithm", "eagle3",
            "--verifier", str(target.resolve()), "--output-path", str(output.resolve()),
            "--algorithm-kwargs", kwargs]


def command_line(argv: list[str]) -> str:
    return shlex.join(argv)
