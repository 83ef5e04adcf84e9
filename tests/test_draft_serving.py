"""A saved draft is what the serving engines load correctly (docs/eagle3.md, "Serving"):
the layer ids in both conventions, no embedding, no d2t when the vocabulary is the
target's; `load_draft` reads it back with the target's embedding; `--init` refuses a
draft trained on other layers; the default extract -> train path works on a CPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers import make_conversations, make_model, worker_env
from workers import extract, vocab
from workers.eagle3.draft import serving
from workers.eagle3.draft.model import (
    DraftConfig,
    Eagle3Draft,
    load_draft,
    read_draft_config,
    read_draft_mapping,
    write_draft,
)
from workers.eagle3.training.train_data import ExtractedData
from workers.train import build_model, parse_args

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
ENV = worker_env()
N = 8
"""Decoder layers of the target in the config tests (and of tests.helpers.make_model's Llama)."""


def small_draft(*, vocab_size: int = 40, draft_vocab_size: int = 16, hidden: int = 32,
                layers: list[int] | None = None) -> Eagle3Draft:
    config = DraftConfig(hidden_size=hidden, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=vocab_size,
                         draft_vocab_size=draft_vocab_size,
                         aux_layer_ids=[2, 4, 5] if layers is None else layers)
    torch.manual_seed(0)
    model = Eagle3Draft(config, embed_weight=torch.randn(vocab_size, hidden), init_std=0.2)
    chosen = torch.arange(draft_vocab_size) * (vocab_size // draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    model.set_vocab(chosen - torch.arange(draft_vocab_size), t2d)
    return model


# -- 1. layer ids: both conventions written, either read back -----------------------------

def test_written_config_makes_both_engines_capture_the_trained_layers(tmp_path: Path) -> None:
    draft = write_draft(tmp_path, small_draft(layers=[2, 4, 5]), torch.float32)
    config = json.loads((draft / "config.json").read_text())
    assert config[serving.TOP_LEVEL_KEY] == [2, 4, 5]  # inputs: vLLM, speculators
    assert config["eagle_config"][serving.TOP_LEVEL_KEY] == [1, 3, 4]  # inputs - 1: SGLang
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 16 and config["vocab_size"] == 40
    assert "n_predict" not in config  # vLLM would require it to divide num_speculative_tokens
    assert serving.vllm_capture_layers(config, N) == [2, 4, 5]
    assert serving.sglang_capture_layers(config, N) == [2, 4, 5]
    assert serving.engine_mismatches(config, N, [2, 4, 5]) == []
    assert serving.layer_id_conflict(config, N) is None
    assert serving.trained_layer_inputs(config, N) == [2, 4, 5]
    assert DraftConfig.from_hf(config).aux_layer_ids == [2, 4, 5]
    assert read_draft_config(draft, N).aux_layer_ids == [2, 4, 5]


@pytest.mark.parametrize("entries", [
    {serving.TOP_LEVEL_KEY: [2, 4, 5]},  # vLLM's convention alone
    {"eagle_config": {serving.TOP_LEVEL_KEY: [1, 3, 4]}},  # SGLang's/SpecForge's alone
    serving.config_layer_entries([2, 4, 5]),  # both, as written
], ids=["top-level", "nested", "both"])
def test_either_convention_reads_back_as_the_layer_inputs(entries: dict[str, object]) -> None:
    config = {**small_draft().config.to_hf("float32"), "eagle_config": {}}
    config.pop(serving.TOP_LEVEL_KEY, None)
    config.update(entries)
    assert serving.trained_layer_inputs(config, N) == [2, 4, 5]
    assert DraftConfig.from_hf(config, target_num_layers=N).aux_layer_ids == [2, 4, 5]


def test_old_style_config_is_read_as_sglang_does_and_flagged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What workers.train wrote before: layer inputs in the nested key, no top-level key.
    SGLang feeds such a draft the inputs of layers value + 1, vLLM the values."""
    draft = write_draft(tmp_path, small_draft(), torch.float32)
    config = json.loads((draft / "config.json").read_text())
    config.pop(serving.TOP_LEVEL_KEY, None)
    config["eagle_config"][serving.TOP_LEVEL_KEY] = [2, 4, 5]
    (draft / "config.json").write_text(json.dumps(config))
    assert serving.sglang_capture_layers(config, N) == [3, 5, 6]
    assert serving.vllm_capture_layers(config, N) == [2, 4, 5]
    assert serving.trained_layer_inputs(config, N) == [3, 5, 6]
    conflict = serving.layer_id_conflict(config, N)
    assert conflict is not None and "[2, 4, 5]" in conflict and "[3, 5, 6]" in conflict
    with caplog.at_level(logging.WARNING, logger="workers.eagle3.draft.model"):
        assert read_draft_config(draft, N).aux_layer_ids == [3, 5, 6]
    assert "engines disagree" in caplog.text and "[3, 5, 6]" in caplog.text


# -- 2. the files: no embedding, no mapping for a full vocabulary; load_draft -------------

def test_saved_draft_has_no_embedding_and_loads_with_the_targets(tmp_path: Path) -> None:
    vocab_size, hidden = 4096, 32
    model = small_draft(vocab_size=vocab_size, draft_vocab_size=64, hidden=hidden)
    draft = write_draft(tmp_path, model, torch.bfloat16)
    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" not in names and {"d2t", "t2d", "fc.weight"} <= names
    weights = sum(p.numel() * 2 for p in model.trainable().values())  # bf16
    mapping = 64 * 8 + vocab_size  # d2t int64, t2d bool
    size = (draft / "model.safetensors").stat().st_size
    assert weights + mapping <= size < weights + mapping + 4096  # + the JSON header
    assert vocab_size * hidden * 2 > weights  # the embedding would have been most of it

    embedding = model.embed_tokens.weight.detach().clone()
    full = write_draft(tmp_path / "fp32", model, torch.float32)
    loaded = load_draft(full, embedding)
    assert loaded.embed_tokens.weight.data_ptr() == embedding.data_ptr()  # not copied
    assert loaded.config == model.config and not loaded.training
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    for name, param in model.trainable().items():
        assert torch.equal(loaded.trainable()[name], param), name
    aux, ids = torch.randn(1, 5, 3 * hidden), torch.randint(0, vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(
            [loaded.logits(h) for h in loaded.unroll(aux, ids, 2)],
            [model.logits(h) for h in model.unroll(aux, ids, 2)])
    with pytest.raises(Exception, match="vocab_size 4096 and hidden_size 32"):
        load_draft(full, torch.zeros(4096, 16))


def test_full_vocabulary_draft_writes_no_mapping_and_loads(tmp_path: Path) -> None:
    model = small_draft(vocab_size=40, draft_vocab_size=40)
    draft = write_draft(tmp_path, model, torch.bfloat16)
    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # vLLM has no draft_id_to_target_id parameter when draft_vocab_size == vocab_size
    assert not names & {"d2t", "t2d", "embed_tokens.weight"}
    loaded = load_draft(draft, torch.randn(40, 32))
    assert torch.equal(loaded.d2t, torch.zeros(40, dtype=torch.int64))
    assert bool(loaded.t2d.all()) and loaded.lm_head.weight.shape == (40, 32)
    d2t, t2d = read_draft_mapping(draft)
    assert torch.equal(d2t, loaded.d2t) and torch.equal(t2d, loaded.t2d)


# -- 3. --init and the default dtype, on a tiny Llama extracted in bf16 ---------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (8 layers: captures inputs [2, 4, 5]) extracted in bf16 (the GPU
    default), and its vocab mapping."""
    root = tmp_path_factory.mktemp("serving")
    model = make_model(root / "tiny")
    conversations = make_conversations(root / "conv.jsonl")
    data = root / "extracted"
    assert extract.main(["--model", str(model), "--data", str(conversations), "--out",
                         str(data), "--device", "cpu", "--dtype", "bf16", "--limit", "8"]) == 0
    assert json.loads((data / "extract_config.json").read_text())["dtype"] == "bf16"
    vocab.main(["--data", str(data), "--tokenizer", str(model), "--draft-vocab-size", "64",
                "--out", str(root / "vocab.safetensors")])
    assert (root / "vocab.safetensors").is_file()
    return {"root": root, "model": model, "data": data, "vocab": root / "vocab.safetensors"}


def untrained_draft(tiny: dict[str, Path], out: Path, layers: list[int],
                    full_vocab: bool = False) -> Path:
    """A draft for the tiny target whose config says it was trained on `layers`."""
    target = json.loads((tiny["model"] / "config.json").read_text())
    embed = load_file(tiny["model"] / "model.safetensors")["model.embed_tokens.weight"]
    if full_vocab:
        d2t, t2d = torch.zeros(384, dtype=torch.int64), torch.ones(384, dtype=torch.bool)
    else:
        d2t, t2d, _ = vocab.load_mapping(tiny["vocab"])
    config = DraftConfig.from_hf(target, draft_vocab_size=d2t.numel(), aux_layer_ids=layers)
    model = Eagle3Draft(config, embed_weight=embed)
    model.set_vocab(d2t, t2d)
    return write_draft(out, model, torch.bfloat16)


@pytest.mark.slow
def test_init_from_a_draft_trained_on_other_layers_is_refused(tiny: dict[str, Path],
                                                              tmp_path: Path) -> None:
    init = untrained_draft(tiny, tmp_path / "other", [1, 3, 6])
    result = subprocess.run(
        [sys.executable, "-m", "workers.train", "--data", str(tiny["data"]), "--target",
         str(tiny["model"]), "--init", str(init), "--out", str(tmp_path / "out"),
         "--device", "cpu", "--max-steps", "1", "--ttt-steps", "1"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: --init" in result.stderr and "Traceback" not in result.stderr
    assert "[1, 3, 6]" in result.stderr and "[2, 4, 5]" in result.stderr
    assert not (tmp_path / "out" / "draft").exists()


def test_init_with_an_old_style_config_is_refused_with_the_fix(tiny: dict[str, Path],
                                                               tmp_path: Path) -> None:
    init = untrained_draft(tiny, tmp_path / "old", [2, 4, 5])
    config = json.loads((init / "config.json").read_text())
    config.pop(serving.TOP_LEVEL_KEY, None)
    config["eagle_config"][serving.TOP_LEVEL_KEY] = [2, 4, 5]  # inputs, nested: the old way
    (init / "config.json").write_text(json.dumps(config))
    args = parse_args(["--data", str(tiny["data"]), "--target", str(tiny["model"]), "--init",
                       str(init), "--out", str(tmp_path / "out")])
    with pytest.raises(Exception, match=r"\[3, 5, 6\].*\[2, 4, 5\]") as caught:
        build_model(args, ExtractedData(tiny["data"]), torch.device("cpu"))
    assert json.dumps(serving.config_layer_entries([2, 4, 5])) in str(caught.value)
    config.update(serving.config_layer_entries([2, 4, 5]))  # the fix it names
    (init / "config.json").write_text(json.dumps(config))
    build_model(args, ExtractedData(tiny["data"]), torch.device("cpu"))


def test_init_from_a_full_vocabulary_draft(tiny: dict[str, Path], tmp_path: Path) -> None:
    init = untrained_draft(tiny, tmp_path / "full", [2, 4, 5], full_vocab=True)
    with safe_open(str(init / "model.safetensors"), framework="pt") as f:
        assert "d2t" not in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    args = parse_args(["--data", str(tiny["data"]), "--target", str(tiny["model"]), "--init",
                       str(init), "--out", str(tmp_path / "out")])
    model, _ = build_model(args, ExtractedData(tiny["data"]), torch.device("cpu"))
    assert model.config.draft_vocab_size == 384 and bool(model.t2d.all())


def test_vocab_reuses_a_full_vocabulary_drafts_identity_mapping(tiny: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """`workers.vocab --from-checkpoint` on a draft with no d2t/t2d (the target's whole
    vocabulary) writes the identity mapping instead of failing on the missing tensors."""
    init = untrained_draft(tiny, tmp_path / "full", [2, 4, 5], full_vocab=True)
    out = tmp_path / "vocab.safetensors"
    vocab.main(["--tokenizer", str(tiny["model"]), "--from-checkpoint", str(init),
                "--out", str(out)])
    d2t, t2d, _ = vocab.load_mapping(out)
    assert d2t.numel() == 384 and not bool(d2t.any()) and bool(t2d.all())


@pytest.mark.slow
def test_default_extract_then_train_on_cpu(tiny: dict[str, Path], tmp_path: Path) -> None:
    """bf16 hidden states (a GPU extraction's default) into the fp32 CPU trainer."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "workers.train", "--data", str(tiny["data"]), "--target",
         str(tiny["model"]), "--vocab", str(tiny["vocab"]), "--out", str(out), "--device",
         "cpu", "--max-steps", "2", "--ttt-steps", "2", "--batch-tokens", "1024"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 2 steps" in result.stderr
    loaded = load_draft(out / "draft", torch.zeros(384, 64))
    assert loaded.config.aux_layer_ids == [2, 4, 5]
    # a checkpoint carries its config, so it can be an --init too
    assert read_draft_config(out / "checkpoints" / "step_0000002").aux_layer_ids == [2, 4, 5]
