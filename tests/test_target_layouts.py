"""The target as its checkpoint is (workers/eagle3/target/model.py): a dense Llama, Qwen3-MoE,
DeepSeek-V3, and Kimi-K2.5's multimodal wrapper around a DeepSeek-V3 language model
(as transformers saves it, and with the released checkpoint's tensor names), each a
tiny random model built from transformers' own classes. Each layout loads and extracts
exactly what the text model's own `output_hidden_states` holds, on one device and split
over two; the training head and the transformers generation backend read the language
model's tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import make_conversations, saved, worker_env
from workers.common import tokenize_conversation
from workers.eagle3.extraction.extractor import capture_layers
from workers.fixtures.tiny import LAYOUTS, build_tiny_target

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ENV = worker_env(CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module", params=LAYOUTS)
def layout(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, build_tiny_target(tmp_path_factory.mktemp(name) / "model", name)


def reference_model(path: Path) -> torch.nn.Module:
    """The checkpoint loaded by transformers directly (not through
    workers.eagle3.target.loading)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = json.loads((path / "config.json").read_text())
    cls = AutoModelForImageTextToText if "text_config" in config else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def run(module: str, *args: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_each_layout_extracts_the_text_models_own_hidden_states(
        layout: tuple[str, Path], tmp_path: Path) -> None:
    name, model_dir = layout
    data = make_conversations(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    # --batch-tokens 1: every sample alone, so routing cannot depend on batch-mates and
    # the comparison can be exact (batching of MoE targets: tests/test_batch_invariance.py)
    result = run("workers.extract", "--model", model_dir, "--data", data, "--out", out,
                 "--dtype", "fp32",
                 "--store", "dtype", "--device", "cpu", "--batch-tokens", "1", "--limit", "6")
    assert ("Kimi_K25ForConditionalGeneration" in result.stderr) == name.startswith("kimi")
    files = saved(out)
    assert len(files) == 6
    model = reference_model(model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    layers = capture_layers(8)
    for record in map(json.loads, data.read_text().splitlines()[:6]):
        tensors = files[record["id"]]
        tokens = tokenize_conversation(tokenizer, record["messages"])
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([tokens.input_ids]),
                           output_hidden_states=True).hidden_states
        assert len(hidden) == 9  # the language model's: embeddings + 8 layers
        torch.testing.assert_close(tensors["aux_hidden_states"],
                                   torch.cat([hidden[i][0] for i in layers], dim=-1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tensors["hidden_state"], hidden[-1][0], atol=1e-5, rtol=1e-5)
        assert tensors["input_ids"].tolist() == tokens.input_ids
    config = json.loads((out / "extract_config.json").read_text())
    assert (config["num_layers"], config["hidden_size"], config["vocab_size"]) == \
        (8, 64, len(tokenizer))


def test_a_split_moe_writes_what_one_device_writes(tmp_path: Path) -> None:
    """Kimi-K2.5's layout: a DeepSeek-V3 MoE inside the multimodal wrapper."""
    model_dir = build_tiny_target(tmp_path / "model", "kimi_k25_released")
    data = make_conversations(tmp_path / "conv.jsonl")
    single, split = tmp_path / "single", tmp_path / "split"
    common = ("--model", model_dir, "--data", data, "--dtype", "fp32",
              "--store", "dtype", "--batch-tokens", "1",
              "--limit", "8")
    run("workers.extract", *common, "--out", single, "--device", "cpu")
    result = run("workers.extract", *common, "--out", split, "--device", "cpu,cpu")
    assert "model split over 2 devices" in result.stderr
    one, two = saved(single), saved(split)
    assert one.keys() == two.keys() and len(one) == 8
    for key in one:
        for tensor in one[key]:
            torch.testing.assert_close(one[key][tensor], two[key][tensor], atol=1e-6, rtol=1e-6)


def test_the_split_plan_keeps_a_multimodal_models_other_parts_with_the_embedding(
        tmp_path: Path) -> None:
    from workers.eagle3.target.model import load_config
    from workers.eagle3.target.split import plan_device_map

    config = load_config(build_tiny_target(tmp_path / "kimi", "kimi_k25"))
    plan = plan_device_map(config, ["cuda:0", "cuda:1"], torch.bfloat16)
    layers = [plan[f"model.language_model.layers.{i}"] for i in range(8)]
    assert layers == ["cuda:0"] * 4 + ["cuda:1"] * 4  # 7 equal MoE layers and a dense one
    assert plan["model.vision_tower"] == plan["model.mm_projector"] == "cuda:0"
    assert plan["model.language_model.embed_tokens"] == "cuda:0"
    assert plan["model.language_model.norm"] == plan["lm_head"] == "cuda:1"


def test_the_training_head_is_the_language_models(layout: tuple[str, Path]) -> None:
    from workers.train import load_target_head

    name, model_dir = layout
    config, embed, head = load_target_head(model_dir, torch.device("cpu"), torch.float32)
    model = reference_model(model_dir)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    assert not torch.equal(embed, head)  # untied: the head was not taken for the embedding
    assert ("text_config" in config) == name.startswith("kimi")


def test_generation_runs_through_a_multimodal_wrapper(tmp_path: Path) -> None:
    """The transformers backend generates from text alone with Kimi-K2.5's wrapper and
    gives what the wrapper's own greedy `generate` gives."""
    from transformers import AutoTokenizer

    model_dir = build_tiny_target(tmp_path / "kimi", "kimi_k25_released")
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompt = [{"role": "user", "content": "What does the draft model predict?"}]
    prompts.write_text(json.dumps({"id": "p0", "messages": prompt}) + "\n")
    run("workers.generate", "--backend", "transformers", "--model", model_dir,
        "--prompts", prompts, "--out", out, "--max-tokens", "8", "--device", "cpu")
    record = json.loads(out.read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        greedy = reference_model(model_dir).generate(ids, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(greedy[0, ids.shape[1]:], skip_special_tokens=True)
    assert record["usage"]["completion_tokens"] > 0
    assert record["messages"][-1]["content"] == expected.strip() or \
        record["messages"][-1]["content"] == expected


def test_a_model_that_is_not_a_text_decoder_is_refused_clearly(tmp_path: Path) -> None:
    from transformers import T5Config

    model_dir = build_tiny_target(tmp_path / "llama", "llama")
    T5Config(vocab_size=384, d_model=32, num_layers=1).save_pretrained(model_dir)
    data = make_conversations(tmp_path / "conv.jsonl")
    result = subprocess.run([sys.executable, "-m", "workers.extract", "--model", str(model_dir),
                             "--data", str(data), "--out", str(tmp_path / "out"),
                             "--device", "cpu"],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert result.returncode == 2
    assert "model_type 't5'" in result.stderr and "neither a causal LM" in result.stderr
    assert "Traceback" not in result.stderr
