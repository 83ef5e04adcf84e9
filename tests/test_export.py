"""workers.export: a tiny extraction exported to SpecForge's and speculators' offline
formats: the files' layout, dtypes and shapes, read with the tools' own file readers
(SpecForge `list_local_files` / `load_feature_file`, hs-connectors `FileTransfer`), the
vocabulary files, the pre-norm option, the refusal without it, resume, progress, and
`conversations` inputs. tests/test_interop.py reads the same exports through the tools'
datasets and training loaders and compares every sample with the extraction.

"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.helpers import make_conversations, make_model, worker_env
from workers import export
from workers.common import record_messages, tokenize_conversation
from workers.eagle3.draft.vocab_mapping import build_mapping, select_draft_vocab
from workers.eagle3.extraction.hidden_files import PRENORM_KEY
from workers.generate import load_prompts

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
    common = ("--model", model, "--data", data, "--dtype", "fp32",
              "--store", "dtype", "--device", "cpu",
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


# -- the two formats, read with the tools' own file readers -------------------------------

def test_specforge_export_layout_and_dtypes(setup: dict[str, Path], tmp_path: Path) -> None:
    from specforge.data.preprocessing import list_local_files
    from specforge.runtime.data_plane.feature_store import load_feature_file

    out = tmp_path / "sf"
    assert run_export("--to", "specforge", "--hidden-states", setup["plain"], "--out", out,
                      "--vocab", setup["vocab"]) == 0
    files = list_local_files(str(out))
    assert len(files) == SAMPLES
    expected = ours(setup["plain"])
    for path in files:
        name = Path(path)
        index = int(name.name[len("data_"):-len(".ckpt")])
        assert name.parent.name == "rows_0-2000"  # their rows_<a>-<a+2000>/data_<i>.ckpt
        raw, length = load_feature_file(path), expected[index]["input_ids"].numel()
        assert raw["aux_hidden_state"].shape == (1, length, 3 * 64)
        assert raw["hidden_state"].shape == (1, length, 64)
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert raw["aux_hidden_state"].dtype == torch.float32  # the extraction's dtype
        # tensors only: SpecForge loads with weights_only=False, we prove it need not
        assert set(torch.load(path, weights_only=True)) == set(raw)
    mapping = torch.load(out / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    vocab = load_file(setup["vocab"])
    assert torch.equal(mapping["d2t"], vocab["d2t"]) and mapping["d2t"].dtype == torch.int64
    assert torch.equal(mapping["t2d"], vocab["t2d"]) and mapping["t2d"].dtype == torch.bool
    assert json.loads((out / "export.json").read_text())["aux_layer_ids"] == [2, 4, 5]


def test_speculators_export_layout_and_dtypes(setup: dict[str, Path], tmp_path: Path) -> None:
    import datasets  # the workers extra has it
    import numpy as np
    from hs_connectors import FileTransfer

    out = tmp_path / "spec"
    assert run_export("--to", "speculators", "--hidden-states", setup["prenorm"], "--out", out,
                      "--vocab", setup["vocab"]) == 0
    dataset = datasets.load_from_disk(str(out))
    assert set(dataset.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert len(dataset) == SAMPLES  # every tiny sample has assistant tokens
    expected = ours(setup["prenorm"])
    transfer = FileTransfer(out / "hidden_states")
    for index in range(SAMPLES):
        loaded, mine = transfer.get_cached(index), expected[index]
        assert loaded is not None and set(loaded) == {"hidden_states", "token_ids"}
        length = mine["input_ids"].numel()
        assert loaded["hidden_states"].shape == (length, 4, 64)
        assert loaded["hidden_states"].dtype == torch.float32
        assert loaded["token_ids"].dtype == torch.int64
        for slot in range(3):  # the three aux layers, low|mid|high, then the pre-norm state
            assert torch.equal(loaded["hidden_states"][:, slot],
                               mine["aux_hidden_states"][:, 64 * slot:64 * (slot + 1)])
        assert torch.equal(loaded["hidden_states"][:, 3], mine[PRENORM_KEY])
    # the mapping under both names: d2t-<N>.npy for the released CLI, d2t.npy for the
    # repository's scripts/train.py (tests/test_interop.py runs the CLI's lookup)
    vocab = load_file(setup["vocab"])
    for suffix in ("-64", ""):
        d2t, t2d = np.load(out / f"d2t{suffix}.npy"), np.load(out / f"t2d{suffix}.npy")
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
        from specforge.data.preprocessing import list_local_files

        assert len(list_local_files(str(out))) == SAMPLES


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
    for args, message in (
            ((), "give --hidden-states (the features), --draft"),
            (("--draft", setup["plain"]), "--draft needs --target"),
            (("--draft", setup["plain"], "--target", setup["model"]), "no config.json")):
        with pytest.raises(SystemExit) as exit_info:
            run_export("--to", "speculators", "--out", tmp_path / "d", *args)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    (tmp_path / "train" / "draft").mkdir(parents=True)
    (tmp_path / "train" / "draft" / "config.json").write_text("{}")
    with pytest.raises(SystemExit):  # OUT/draft would be the trained draft itself
        run_export("--to", "speculators", "--out", tmp_path / "train", "--draft",
                   tmp_path / "train" / "draft", "--target", setup["model"])
    assert "replacing --draft" in capsys.readouterr().err
    assert (tmp_path / "train" / "draft" / "config.json").read_text() == "{}"
    checkpoint = tmp_path / "out" / "draft" / "checkpoint-3"  # a draft inside OUT/draft
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(SystemExit):  # replacing OUT/draft would delete it
        run_export("--to", "speculators", "--out", tmp_path / "out", "--draft", checkpoint,
                   "--target", setup["model"])
    assert "replacing --draft" in capsys.readouterr().err
    assert (checkpoint / "config.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        run_export("--to", "specforge", "--out", tmp_path / "d", "--draft", setup["plain"],
                   "--target", setup["model"])
    assert "--draft is for --to speculators" in capsys.readouterr().err
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
            "--store", "dtype",
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
