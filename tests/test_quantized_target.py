"""Quantized targets: a compressed-tensors INT4 checkpoint (`pack-quantized`, groups of
32, symmetric, routed experts only: the format Kimi-K2.5 ships in), made by the
compressed-tensors library from a tiny random DeepSeek-V3 (workers/fixtures/tiny_int4.py), loads
through transformers and the `compressed-tensors` package, computes what the library's
own dequantization of its weights computes, and extracts exactly its hidden states."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("compressed_tensors",
                    reason="compressed-tensors is not installed (pip install "
                           "'jobsup[workers]'): INT4 compressed-tensors targets cannot load")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
)

from tests.helpers import make_conversations, worker_env  # noqa: E402
from workers.common import tokenize_conversation  # noqa: E402
from workers.eagle3.extraction.extractor import capture_layers  # noqa: E402
from workers.fixtures.tiny_int4 import EXPERT, build_tiny_int4_target, library_dequantized  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ["deepseek_v3", "kimi_k25"]
AUTO = {"deepseek_v3": AutoModelForCausalLM, "kimi_k25": AutoModelForImageTextToText}
PREFIX = {"deepseek_v3": "model.layers.", "kimi_k25": "language_model.model.layers."}
HIDDEN, MOE_INTERMEDIATE, EXPERTS = 64, 64, 8


@pytest.fixture(scope="module", params=LAYOUTS)
def int4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Path, Path]:
    """(layout, the INT4 checkpoint, the same model before quantization)."""
    root = tmp_path_factory.mktemp(request.param)
    path = build_tiny_int4_target(root / "int4", layout=request.param,
                                  original_dir=root / "original")
    return request.param, path, root / "original"


def load(layout: str, path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return AUTO[layout].from_pretrained(path, dtype=dtype).eval()


def hidden_states(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True).hidden_states


def experts_of(model: Any, layer: int) -> Any:
    return model.get_decoder().layers[layer].mlp.experts


def expert_weight(experts: Any, expert: int, proj: str) -> torch.Tensor:
    """One expert's projection in transformers' fused layout ([gate; up] in gate_up_proj)."""
    if proj == "down":
        return experts.down_proj[expert]
    gate, up = experts.gate_up_proj[expert].chunk(2, dim=0)
    return gate if proj == "gate" else up


def test_checkpoint_is_kimi_k25s_format(int4: tuple[str, Path, Path]) -> None:
    layout, path, _ = int4
    config = json.loads((path / "config.json").read_text())
    if layout == "kimi_k25":  # where the released config keeps it
        assert "quantization_config" not in config
        assert config["model_type"] == "kimi_k25"
        assert config["text_config"]["model_type"] == "kimi_k2"
        qconfig = config["text_config"]["quantization_config"]
    else:
        qconfig = config["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["format"] == "pack-quantized"
    assert qconfig["quantization_status"] == "compressed"
    (group,) = qconfig["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy",
                                              "group_size")} == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    assert "lm_head" in qconfig["ignore"] and "re:.*self_attn.*" in qconfig["ignore"]

    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        expert = f"{PREFIX[layout]}1.mlp.experts.0.gate_proj"
        packed = f.get_tensor(f"{expert}.weight_packed")
        scale = f.get_tensor(f"{expert}.weight_scale")
        shape = f.get_tensor(f"{expert}.weight_shape")
    # 8 INT4 values per int32 along the input dim, a scale per group of 32 inputs
    assert packed.dtype == torch.int32 and packed.shape == (MOE_INTERMEDIATE, HIDDEN // 8)
    assert scale.dtype == torch.bfloat16 and scale.shape == (MOE_INTERMEDIATE, HIDDEN // 32)
    assert shape.tolist() == [MOE_INTERMEDIATE, HIDDEN]
    quantized = {name.rpartition(".")[0] for name in names if name.endswith(".weight_packed")}
    assert quantized and all(EXPERT.search(module) for module in quantized)
    assert len(quantized) == (8 - 1) * EXPERTS * 3  # every routed expert; layer 0 is dense
    assert not [name for name in names if ".experts." in name and name.endswith(".weight")]
    for dense in (f"{PREFIX[layout]}0.mlp.gate_proj.weight",  # the dense layer
                  f"{PREFIX[layout]}1.mlp.shared_experts.up_proj.weight",
                  f"{PREFIX[layout]}1.self_attn.q_a_proj.weight"):
        assert dense in names


def test_loads_through_compressed_tensors_as_the_library_dequantizes_it(
        int4: tuple[str, Path, Path]) -> None:
    layout, path, original_path = int4
    model = load(layout, path)
    assert model.is_quantized
    assert model.config.quantization_config.quant_method == "compressed-tensors"
    # transformers dequantizes the INT4 experts while loading (into its fused 3-D
    # expert tensors): exactly the weights compressed-tensors' own decompression gives
    dense = library_dequantized(path)
    assert len(dense) == (8 - 1) * EXPERTS * 3
    for name, weight in dense.items():
        layer, expert, proj = EXPERT.search(name).groups()
        loaded = expert_weight(experts_of(model, int(layer)), int(expert), proj)
        assert torch.equal(loaded, weight.to(loaded.dtype)), name

    # the same model with the library-dequantized experts computes the same states
    reference = load(layout, original_path)
    original = load(layout, original_path)
    experts_dtype = experts_of(model, 1).gate_up_proj.dtype  # see the report: bf16 here
    with torch.no_grad():
        for name, weight in dense.items():
            layer, expert, proj = EXPERT.search(name).groups()
            expert_weight(experts_of(reference, int(layer)), int(expert), proj).copy_(weight)
        for layer in range(1, 8):
            experts_of(reference, layer).to(experts_dtype)
    ids = torch.randint(8, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    got, expected, unquantized = (hidden_states(m, ids) for m in (model, reference, original))
    assert len(got) == 8 + 1
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # and differs from the unquantized model by INT4's error, from the first MoE layer on
    errors = [((a - b).norm() / b.norm()).item() for a, b in zip(got, unquantized, strict=True)]
    assert errors[0] == errors[1] == 0.0  # embeddings, then the dense layer 0
    assert all(0.005 < e < 0.25 for e in errors[2:]), errors


def test_extraction_equals_the_quantized_models_hidden_states(
        int4: tuple[str, Path, Path], tmp_path: Path) -> None:
    layout, path, _ = int4
    data = make_conversations(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "workers.extract", "--model", str(path), "--data", str(data),
         "--out", str(out), "--dtype", "fp32",
         "--store", "dtype", "--batch-tokens", "4096", "--device", "cpu",
         "--limit", "8"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    files = {entry["id"]: load_file(out / entry["file"]) for entry in manifest}
    assert len(files) == 8

    model = load(layout, path)
    for layer in range(1, 8):  # extraction's packed experts compute in fp32; transformers
        experts_of(model, layer).to(torch.float32)  # leaves the dequantized ones in bf16
    tokenizer = AutoTokenizer.from_pretrained(path)
    layers = capture_layers(8)
    records = [json.loads(line) for line in data.read_text().splitlines()][:8]
    for record in records:
        tensors = files[record["id"]]
        tokens = tokenize_conversation(tokenizer, record["messages"])
        hidden = hidden_states(model, torch.tensor([tokens.input_ids]))
        # batched with right padding vs alone: fp32 kernels agree to rounding
        torch.testing.assert_close(tensors["aux_hidden_states"],
                                   torch.cat([hidden[i][0] for i in layers], dim=-1),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tensors["hidden_state"], hidden[-1][0], atol=1e-4, rtol=1e-4)
        assert tensors["input_ids"].tolist() == tokens.input_ids
    config = json.loads((out / "extract_config.json").read_text())
    assert config["aux_layer_ids"] == layers and config["hidden_size"] == HIDDEN
