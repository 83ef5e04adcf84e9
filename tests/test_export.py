"""workers.export: a tiny extraction exported to SpecForge's and speculators' offline
formats, read back the way each tool's own loader reads it (written from their source:
SpecForge specforge/data/preprocessing.py `list_local_files` + `OfflineEagle3Dataset`;
speculators src/speculators/train/data.py `ArrowDataset` + hs_connectors `FileTransfer`),
and checked against our files and the model's own forward pass. Also: the pre-norm
option, the refusal without it, resume, progress, and `conversations` inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import make_conversations, make_model, worker_env
from workers import export
from workers.common import record_messages, tokenize_conversation
from workers.generate import load_prompts
from workers.hidden_files import PRENORM_KEY
from workers.vocab_mapping import build_mapping, select_draft_vocab

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SAMPLES = 8


def extract(*args: str | Path) -> None:
    result = subprocess.run([sys.executable, "-m", "workers.extract", *map(str, args)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    model = make_model(root / "tiny")
    data = make_conversations(root / "conv.jsonl")
    common = ("--model", model, "--data", data, "--dtype", "fp32", "--device", "cpu",
              "--limit", str(SAMPLES))
    extract(*common, "--out", root / "plain")
    extract(*common, "--out", root / "prenorm", "--keep-prenorm-last")
    vocab_size = json.loads((root / "plain" / "extract_config.json").read_text())["vocab_size"]
    counts = torch.randint(0, 50, (vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_mapping(select_draft_vocab(counts, 64), vocab_size)
    save_file({"d2t": d2t, "t2d": t2d}, root / "vocab.safetensors")
    return {"root": root, "model": model, "data": data, "plain": root / "plain",
            "prenorm": root / "prenorm", "vocab": root / "vocab.safetensors"}


def ours(extraction: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Our files by sample index."""
    manifest = [json.loads(x) for x in (extraction / "manifest.jsonl").read_text().splitlines()]
    return {e["index"]: load_file(extraction / e["file"]) for e in manifest}


def run_export(*args: str | Path) -> int:
    return export.main([str(a) for a in args])


# -- SpecForge: what its offline loader does -----------------------------------------------

def specforge_list_local_files(path: Path) -> list[str]:
    """specforge/data/preprocessing.py list_local_files: every *.ckpt / *.ckpt.gz under
    the directory (os.walk), sorted."""
    found = [os.path.join(r, f) for r, _, files in os.walk(path) for f in files]
    return sorted(f for f in found if f.endswith((".ckpt", ".ckpt.gz")))


def specforge_process(path: str, max_len: int = 2048) -> dict[str, torch.Tensor]:
    """OfflineEagle3Dataset._open_file (torch.load, mmap) + process_data. We load with
    weights_only=True (they pass False): it also proves the file holds tensors only."""
    data = torch.load(path, weights_only=True, mmap=True)
    assert set(data) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
    loss_mask = data["loss_mask"][:max_len][None, :].clone()
    loss_mask[0, -1] = 0
    return {"hidden_state": data["aux_hidden_state"].squeeze(0)[:max_len][None, :],
            "target": data["hidden_state"].squeeze(0)[:max_len][None, :],
            "input_ids": data["input_ids"][:max_len][None, :], "loss_mask": loss_mask,
            "raw": data}


def test_specforge_export_reads_back_as_specforge_reads_it(setup: dict[str, Path],
                                                          tmp_path: Path) -> None:
    out = tmp_path / "sf"
    assert run_export("--to", "specforge", "--hidden-states", setup["plain"], "--out", out,
                      "--vocab", setup["vocab"]) == 0
    files = specforge_list_local_files(out)
    assert len(files) == SAMPLES
    expected = ours(setup["plain"])
    for path in files:
        name = Path(path)
        index = int(name.name[len("data_"):-len(".ckpt")])
        assert name.parent.name == "rows_0-2000"  # their rows_<a>-<a+2000>/data_<i>.ckpt
        got, mine = specforge_process(path), expected[index]
        raw, length = got["raw"], mine["input_ids"].numel()
        assert raw["aux_hidden_state"].shape == (1, length, 3 * 64)
        assert raw["hidden_state"].shape == (1, length, 64)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["aux_hidden_state"].dtype == torch.float32  # the extraction's dtype
        assert torch.equal(got["hidden_state"][0], mine["aux_hidden_states"])
        assert torch.equal(got["target"][0], mine["hidden_state"])
        assert torch.equal(got["input_ids"][0], mine["input_ids"])
        assert raw["loss_mask"].tolist() == mine["loss_mask"].tolist()
    mapping = torch.load(out / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    vocab = load_file(setup["vocab"])
    assert torch.equal(mapping["d2t"], vocab["d2t"]) and mapping["d2t"].dtype == torch.int64
    assert torch.equal(mapping["t2d"], vocab["t2d"]) and mapping["t2d"].dtype == torch.bool
    assert json.loads((out / "export.json").read_text())["aux_layer_ids"] == [2, 4, 5]


# -- speculators: what its offline loader does ---------------------------------------------

def speculators_item(data_path: Path, dataset: object, index: int) -> dict[str, torch.Tensor]:
    """ArrowDataset._get_raw_data with FileTransfer(data_path / "hidden_states")."""
    loaded = load_file(data_path / "hidden_states" / f"hs_{index}.safetensors")
    assert set(loaded) == {"hidden_states", "token_ids"}
    row = dataset[index]  # type: ignore[index]
    assert torch.equal(loaded["token_ids"], row["input_ids"])  # else they drop the sample
    return {"hidden_states": loaded["hidden_states"][:, :-1].flatten(1),
            "input_ids": loaded["token_ids"],
            "verifier_last_hidden_states": loaded["hidden_states"][:, -1],
            "loss_mask": row["loss_mask"], "raw": loaded["hidden_states"]}


def prenorm_by_forward(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(input of model.norm, HF's last hidden state) from the model's own forward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        hidden = model(ids[None], output_hidden_states=True).hidden_states
    handle.remove()
    return seen[0][0], hidden[-1][0]


def test_speculators_export_reads_back_as_speculators_reads_it(setup: dict[str, Path],
                                                              tmp_path: Path) -> None:
    import datasets  # the workers extra has it
    import numpy as np
    out = tmp_path / "spec"
    assert run_export("--to", "speculators", "--hidden-states", setup["prenorm"], "--out", out,
                      "--vocab", setup["vocab"]) == 0
    dataset = datasets.load_from_disk(str(out))
    assert set(dataset.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert len(dataset) == SAMPLES  # every tiny sample has assistant tokens
    lengths = list(dataset.with_format(None)["seq_len"])  # ArrowDataset's approx lengths
    expected = ours(setup["prenorm"])
    assert sorted(expected) == list(range(SAMPLES))  # rows follow our index order
    for index in range(SAMPLES):
        got, mine = speculators_item(out, dataset, index), expected[index]
        length = mine["input_ids"].numel()
        assert lengths[index] == length
        assert got["raw"].shape == (length, 4, 64) and got["raw"].dtype == torch.float32
        assert got["input_ids"].dtype == torch.int64
        assert torch.equal(got["hidden_states"], mine["aux_hidden_states"])
        for slot in range(3):  # the three aux layers, low|mid|high
            assert torch.equal(got["raw"][:, slot], mine["aux_hidden_states"][:, 64 * slot:
                                                                              64 * (slot + 1)])
        assert torch.equal(got["verifier_last_hidden_states"], mine[PRENORM_KEY])
        assert got["loss_mask"].tolist() == mine["loss_mask"].tolist()
        assert got["loss_mask"].dtype == torch.int64
    # the pre-norm state is the input of the model's final norm, not HF's last hidden
    # state (which is after the norm, and is what our hidden_state holds)
    ids = expected[0]["input_ids"]
    before_norm, hf_last = prenorm_by_forward(setup["model"], ids)
    last = speculators_item(out, dataset, 0)["verifier_last_hidden_states"]
    torch.testing.assert_close(last, before_norm, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(expected[0]["hidden_state"], hf_last, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(last, hf_last, atol=1e-2)
    # train.py's default mapping files: DATA_PATH/d2t.npy, t2d.npy (np.load)
    vocab = load_file(setup["vocab"])
    d2t, t2d = np.load(out / "d2t.npy"), np.load(out / "t2d.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert torch.equal(torch.from_numpy(d2t), vocab["d2t"])
    assert torch.equal(torch.from_numpy(t2d), vocab["t2d"])


def test_speculators_export_refuses_without_the_prenorm_state(
        setup: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spec"
    with pytest.raises(SystemExit) as exit_info:
        run_export("--to", "speculators", "--hidden-states", setup["plain"], "--out", out)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--keep-prenorm-last" in err and "before the final norm" in err
    assert not out.exists()  # refused before writing anything
    # a tree whose config claims the state but whose files lack it (resumed the old way)
    mixed = tmp_path / "mixed"
    shutil.copytree(setup["plain"], mixed)
    config = json.loads((mixed / "extract_config.json").read_text())
    (mixed / "extract_config.json").write_text(json.dumps({**config,
                                                           "keep_prenorm_last": True}))
    with pytest.raises(SystemExit):
        run_export("--to", "speculators", "--hidden-states", mixed, "--out", out)
    err = capsys.readouterr().err
    assert f"has no {PRENORM_KEY}" in err and "--keep-prenorm-last" in err
    assert not list((out / "hidden_states").glob("hs_*"))


@pytest.mark.parametrize("to", ["specforge", "speculators"])
def test_rerun_skips_complete_outputs_and_reports_progress(
        setup: dict[str, Path], tmp_path: Path, to: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    progress = tmp_path / "progress.json"
    monkeypatch.setenv("JOBSUP_PROGRESS_FILE", str(progress))
    out = tmp_path / "out"
    args = ("--to", to, "--hidden-states", setup["prenorm"], "--out", out, "--workers", "2")
    assert run_export(*args) == 0
    report = json.loads(progress.read_text())
    assert report["done"] == report["total"] == SAMPLES and report["unit"] == "sample"
    pattern = "*.ckpt" if to == "specforge" else "hs_*.safetensors"
    files = sorted(out.rglob(pattern))
    assert len(files) == SAMPLES
    stamps = {f: f.stat().st_mtime_ns for f in files}
    files[3].unlink()  # an interrupted run: one output missing
    (files[3].parent / f".{files[3].name}.tmp").write_bytes(b"torn")  # and a torn temp file
    caplog.clear()
    with caplog.at_level("INFO", logger="workers.export"):
        assert run_export(*args) == 0
    assert f"{SAMPLES - 1} already exported, 1 to write" in caplog.text
    assert all(f.stat().st_mtime_ns == stamps[f] for f in files if f != files[3])
    assert files[3].is_file()
    if to == "specforge":  # the temp file is not something SpecForge lists
        assert len(specforge_list_local_files(out)) == SAMPLES


def test_errors_are_clear(setup: dict[str, Path], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (("--hidden-states", tmp_path / "nothing"), "is --hidden-states a workers.extract"),
        (("--hidden-states", setup["plain"], "--vocab", tmp_path / "missing.safetensors"),
         "does not exist"),
    ]
    small = tmp_path / "small.safetensors"
    save_file({"d2t": torch.zeros(4, dtype=torch.int64),
               "t2d": torch.tensor([True] * 4 + [False] * 6)}, small)
    cases.append((("--hidden-states", setup["plain"], "--vocab", small),
                  "another target's mapping"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            run_export("--to", "specforge", "--out", tmp_path / "o", *extra)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_export("--to", "specforge", "--hidden-states", setup["plain"],
                   "--out", setup["plain"] / "inside")
    assert "overlap" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run_export("--help")
    assert exit_info.value.code == 0
    assert "--keep-prenorm-last" in capsys.readouterr().out


# -- `conversations` inputs ---------------------------------------------------------------

SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def as_sharegpt(record: dict) -> dict:
    turns = []
    for m in record["messages"]:
        turn = {"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]}
        if m.get("reasoning_content"):
            turn["reasoning_content"] = m["reasoning_content"]
        turns.append(turn)
    return {"id": record["id"], "conversations": turns}


def test_record_messages_normalizes_sharegpt_and_rejects_unknown_roles() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert record_messages({"messages": messages}) is messages
    assert record_messages({"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"},
        {"role": "assistant", "content": "a", "thinking": "t"}]}) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "t"}]
    for bad, message in (({"conversations": [{"from": "robot", "value": "x"}]}, "'robot'"),
                         ({"conversations": [{"from": "human"}]}, "must be a string"),
                         ({"conversations": "text"}, "not a list"),
                         ({"id": "x"}, "missing messages (or conversations)")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            record_messages(bad)


def test_conversations_input_extracts_as_the_messages_input(setup: dict[str, Path],
                                                           tmp_path: Path) -> None:
    records = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps(as_sharegpt(r)) + "\n" for r in records))
    out = tmp_path / "from_conversations"
    extract("--model", setup["model"], "--data", sharegpt, "--out", out, "--dtype", "fp32",
            "--device", "cpu", "--limit", str(SAMPLES))
    got, expected = ours(out), ours(setup["plain"])
    assert sorted(got) == sorted(expected)
    for index, tensors in expected.items():
        for key, tensor in tensors.items():
            torch.testing.assert_close(got[index][key], tensor, atol=1e-5, rtol=1e-5)
    # the other readers take the same file: prompts for workers.generate, the tokenizer
    # counts of workers.vocab (both through workers.common.record_messages)
    prompts, malformed = load_prompts(sharegpt, None)
    assert not malformed and [p.messages for p in prompts] == [
        [{k: v for k, v in m.items() if v is not None} for m in r["messages"]]
        for r in records]
    tokenizer = AutoTokenizer.from_pretrained(setup["model"])
    for record, prompt in zip(records, prompts, strict=True):
        assert tokenize_conversation(tokenizer, prompt.messages) == \
            tokenize_conversation(tokenizer, record["messages"])


def test_vocab_counts_conversations_as_messages(setup: dict[str, Path], tmp_path: Path) -> None:
    from workers import vocab

    records = [json.loads(x) for x in setup["data"].read_text().splitlines()]
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps(as_sharegpt(r)) + "\n" for r in records))
    outputs = {}
    for name, data in (("messages", setup["data"]), ("conversations", sharegpt)):
        out = tmp_path / f"{name}.safetensors"
        vocab.run(vocab.parse_args(["--data", str(data), "--tokenizer", str(setup["model"]),
                                    "--draft-vocab-size", "64", "--out", str(out)]))
        outputs[name] = load_file(out)
    assert torch.equal(outputs["messages"]["d2t"], outputs["conversations"]["d2t"])
    assert torch.equal(outputs["messages"]["t2d"], outputs["conversations"]["t2d"])
