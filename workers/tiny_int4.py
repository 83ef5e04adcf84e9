"""A tiny random DeepSeek-V3 MoE whose routed experts are INT4 in compressed-tensors'
`pack-quantized` format, the format Kimi-K2.5 ships in: for tests of quantized targets,
built locally with no download. `python -m workers.tiny_int4 OUT_DIR [--layout kimi_k25]`.

The quantization is the compressed-tensors library's own (needs `compressed-tensors`):
`QuantizationConfig` with one group — `targets: [Linear]`, weights `num_bits 4, type int,
symmetric, strategy group, group_size 32` — and an `ignore` list that leaves attention,
shared experts, the dense MLP layers, `lm_head` (and for `kimi_k25` the vision tower and
projector) unquantized, so only the routed experts are INT4; `apply_quantization_config`,
scales from each group's min/max (the `minmax` observer), `ModelCompressor.compress_model`,
and `ModelCompressor.update_config` for config.json (`quantization_status: compressed`).

transformers 5 keeps each MoE layer's experts as fused 3-D parameters (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), which compressed-tensors (it quantizes
`nn.Linear` modules) cannot see; released checkpoints store one Linear per expert. So the
experts are split into per-expert Linear modules first, and the checkpoint has the released
layout: `...mlp.experts.<e>.{gate,up,down}_proj.{weight_packed,weight_scale,weight_shape}`
(transformers' deepseek_v3 conversion mapping merges them back when loading).

Layouts:
- `deepseek_v3`: `DeepseekV3ForCausalLM`, tensor names `model.layers.*`, `lm_head.*`.
- `kimi_k25`: Kimi-K2.5's wrapper (`model_type: kimi_k25`, the DeepSeek-V3 language model
  under `text_config` with `model_type: kimi_k2`, a tiny vision tower and projector), the
  language model's tensors under `language_model.model.*` / `language_model.lm_head.*` as in
  the released checkpoint, and `quantization_config` inside `text_config`.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from workers.tiny import build_tokenizer, corpus

LAYOUTS = ("deepseek_v3", "kimi_k25")
GROUP_SIZE = 32
# Kimi-K2's list (only the routed experts are quantized); Kimi-K2.5 adds its vision parts
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
          r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
KIMI_IGNORE = [*IGNORE, "re:.*vision_tower.*", "re:.*mm_projector.*"]
EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj$")


def quantization_config(ignore: list[str]) -> Any:
    """INT4 weights, symmetric, groups of 32 along the input dim, on every Linear not
    ignored: Kimi-K2.5's `quantization_config` (status `initialized` until compressed)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=GROUP_SIZE, dynamic=False, observer="minmax")
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format="pack-quantized", ignore=list(ignore),
        quantization_status=QuantizationStatus.INITIALIZED)


def text_config(tokenizer: Any, *, layers: int, hidden: int, experts: int) -> Any:
    """A DeepSeek-V3 shaped like Kimi-K2 in miniature: MLA attention, a dense first layer,
    sigmoid-routed grouped top-k experts plus one shared expert."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=experts,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def build_model(layout: str, text: Any) -> Any:
    from transformers import DeepseekV3ForCausalLM

    if layout == "deepseek_v3":
        return DeepseekV3ForCausalLM(text)
    from transformers.models.kimi_k25 import (
        Kimi_K25Config,
        Kimi_K25ForConditionalGeneration,
        Kimi_K25VisionConfig,
    )

    vision = Kimi_K25VisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, pos_emb_height=8, pos_emb_width=8)
    config = Kimi_K25Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                            projection_hidden_size=vision.hidden_size,
                            tie_word_embeddings=False, bos_token_id=text.bos_token_id,
                            eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    return Kimi_K25ForConditionalGeneration(config)


def split_experts(model: Any) -> int:
    """Replace each fused experts module by a ModuleList of per-expert MLPs with Linear
    gate/up/down projections holding the same weights (the released layout); returns
    how many were split."""
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    class ExpertMLP(nn.Module):
        def __init__(self, gate: Any, up: Any, down: Any) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False)
            self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False)
            self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False)
            for linear, weight in ((self.gate_proj, gate), (self.up_proj, up),
                                   (self.down_proj, down)):
                linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    fused = [(name, module) for name, module in model.named_modules()
             if isinstance(module, DeepseekV3Experts)]
    for name, module in fused:
        parent = model.get_submodule(name.rpartition(".")[0])
        gate, up = module.gate_up_proj.data.chunk(2, dim=1)  # [gate; up] along dim 1
        parent.experts = nn.ModuleList(
            ExpertMLP(gate[e], up[e], module.down_proj.data[e])
            for e in range(module.num_experts))
    return len(fused)


def quantize_experts(model: Any, ignore: list[str]) -> Any:
    """Quantize and compress (in place) the Linear modules the config targets — the
    routed experts — with compressed-tensors; returns the compressor (its config is
    now `compressed`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    config = quantization_config(ignore)
    apply_quantization_config(model, config, show_progress=False)
    quantized = {name: module for name, module in model.named_modules()
                 if getattr(module, "quantization_scheme", None) is not None}
    stray = [name for name in quantized if not EXPERT.search(name)]
    if stray or not quantized:
        raise RuntimeError(f"the ignore list should leave exactly the routed experts "
                           f"quantized, not {stray or 'nothing'}")
    for module in quantized.values():  # calibration: the minmax observer on the weight
        scale, zero_point = compute_dynamic_scales_and_zp(
            module.weight.data, module.quantization_scheme.weights, module)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    return compressor


def released_name(name: str, layout: str) -> str:
    """The tensor's name in the released checkpoint of `layout`."""
    if layout == "kimi_k25":
        if name.startswith("model.language_model."):
            return "language_model.model." + name.removeprefix("model.language_model.")
        if name.startswith("lm_head."):
            return "language_model." + name
    return name


def build_tiny_int4_target(out_dir: str | Path, *, layout: str = "deepseek_v3",
                           layers: int = 8, hidden: int = 64, experts: int = 8,
                           seed: int = 0, texts: Iterable[str] | None = None,
                           original_dir: str | Path | None = None) -> Path:
    """Save the INT4 checkpoint (config.json with its `quantization_config`,
    model.safetensors, the tokenizer of workers/tiny.py) to `out_dir`; returns it.
    `original_dir`: also save the same model before quantization there (bf16, the
    dtype of the rest of the checkpoint), to measure the quantization error against."""
    import torch
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if hidden % GROUP_SIZE:
        raise ValueError(f"hidden {hidden}: a multiple of the group size {GROUP_SIZE}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts if texts is not None else corpus(), 384)
    text = text_config(tokenizer, layers=layers, hidden=hidden, experts=experts)
    torch.manual_seed(seed)
    model = build_model(layout, text).to(torch.bfloat16).eval()
    if original_dir is not None:
        model.save_pretrained(original_dir)
        tokenizer.save_pretrained(original_dir)
    with tempfile.TemporaryDirectory() as tmp:  # the config exactly as transformers writes it
        model.config.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
    if not split_experts(model):
        raise RuntimeError("no fused experts module found to quantize")
    compressor = quantize_experts(model, KIMI_IGNORE if layout == "kimi_k25" else IGNORE)
    state = {released_name(name, layout): tensor.detach().contiguous()
             for name, tensor in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    compressor.update_config(str(out))  # adds quantization_config at the top level
    if layout == "kimi_k25":  # where the released Kimi-K2.5 config.json keeps it
        config = json.loads((out / "config.json").read_text())
        config["text_config"]["quantization_config"] = config.pop("quantization_config")
        config["text_config"]["model_type"] = "kimi_k2"
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out)
    return out


def library_dequantized(path: str | Path) -> dict[str, Any]:
    """Every packed weight of the checkpoint at `path` dequantized by compressed-tensors'
    own compressor for its format: {module name as in the file: dense weight}."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    raw = config.get("quantization_config") or config["text_config"]["quantization_config"]
    qconfig = QuantizationConfig.model_validate(raw)
    (scheme,) = qconfig.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
    tensors = load_file(Path(path) / "model.safetensors")
    dense = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            module = key.removesuffix(".weight_packed")
            local = {name.removeprefix(module + "."): tensors[name] for name in tensors
                     if name.startswith(module + ".weight_")}
            dense[module] = compressor.decompress(local, scheme)["weight"]
    return dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write the model into")
    parser.add_argument("--layout", choices=LAYOUTS, default="deepseek_v3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_tiny_int4_target(args.out, layout=args.layout, layers=args.layers,
                                 seed=args.seed))


if __name__ == "__main__":
    main()
