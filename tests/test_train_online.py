"""workers.train --online on CPU (#50): the target's forward makes each batch's features
inside the trainer. Its batches hold what an extraction of the same conversations
holds, it trains the same losses and draft as offline training on that extraction
(fp32), a run stopped mid-epoch resumes where its stream stopped, and conversations the
target cannot take are skipped and counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import make_conversations, make_model, worker_env
from workers import extract, vocab
from workers.common import ProgressReporter
from workers.eagle3.training.train_data import ExtractedData, load_batch
from workers.train import EXIT_TERMINATED, open_online, parse_args, train

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--batch-tokens", "768", "--epochs", "2", "--save-every", "3", "--seed", "5",
        "--ttt-steps", "3", "--lr", "3e-3", "--draft-dtype", "fp32", "--log-every", "1"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("online")
    model = make_model(root / "tiny")
    conversations = make_conversations(root / "conv.jsonl")
    data = root / "extracted"
    assert extract.main(["--model", str(model), "--data", str(conversations), "--out",
                         str(data), "--dtype", "fp32", "--store", "dtype", "--device",
                         "cpu"]) == 0
    vocab.main(["--data", str(data), "--tokenizer", str(model), "--draft-vocab-size", "64",
                "--out", str(root / "vocab.safetensors")])
    return {"root": root, "model": model, "data": data, "conversations": conversations,
            "vocab": root / "vocab.safetensors"}


def common(tiny: dict[str, Path], out: Path) -> list[str]:
    return ["--target", str(tiny["model"]), "--vocab", str(tiny["vocab"]), "--out", str(out)]


def online(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [*common(tiny, out), "--online", "--conversations", str(tiny["conversations"]),
            *ARGS, *extra]


def offline(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [*common(tiny, out), "--data", str(tiny["data"]), *ARGS, *extra]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_online_batches_hold_the_extractions_features(tiny: dict[str, Path],
                                                       tmp_path: Path) -> None:
    features = open_online(parse_args(online(tiny, tmp_path)), torch.device("cpu"))
    extracted = ExtractedData(tiny["data"])
    assert [(s.index, s.seq_len) for s in features.samples.samples] == \
        [(s.index, s.seq_len) for s in extracted.samples]
    assert features.samples.config["aux_layer_ids"] == extracted.config["aux_layer_ids"]
    for plan in extracted.plan_epoch(0, 5, 768)[:4]:
        made = features.batch(plan, 768, 3)
        read = load_batch(tiny["data"], plan, 64, 768)
        assert torch.equal(made.input_ids, read.input_ids)
        assert torch.equal(made.loss_mask, read.loss_mask)
        assert made.tokens == read.tokens and made.indices == read.indices
        # fp32 on a CPU; the extraction batched the samples otherwise (padding only)
        torch.testing.assert_close(made.aux, read.aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(made.hidden, read.hidden, atol=1e-5, rtol=1e-4)
        assert made.scored is not None and len(made.scored.draft) == 3


def test_online_trains_the_offline_losses_and_draft(tiny: dict[str, Path],
                                                   tmp_path: Path) -> None:
    runs = {}
    for name, argv in (("offline", offline), ("online", online)):
        out = tmp_path / name
        args = parse_args(argv(tiny, out, "--trace-data", str(out) + ".trace"))
        assert train(args, ProgressReporter(None, "step")) == 0
        runs[name] = out
    assert lines(Path(f"{runs['online']}.trace")) == lines(Path(f"{runs['offline']}.trace"))
    for got, want in zip(lines(runs["online"] / "heldout.jsonl"),
                         lines(runs["offline"] / "heldout.jsonl"), strict=True):
        assert got["step"] == want["step"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["acc"] == pytest.approx(want["acc"], abs=1e-6)
        assert got["counts"] == want["counts"]
    got = load_file(runs["online"] / "draft" / "model.safetensors")
    want = load_file(runs["offline"] / "draft" / "model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-3)
    summary = json.loads((runs["online"] / "train_summary.json").read_text())
    assert summary["features"] == "online"
    assert summary["online_skipped"] == {"too_long": 0, "foreign_tokens": 0, "empty": 0,
                                         "malformed_lines": 0}
    # on a CPU the features made are kept (--feature-cache-gb 4 by default): the second
    # epoch's batches, and the held-out ones after the first measure, come from memory
    steps = summary["last_step"]
    assert summary["online_batches"] > steps
    assert summary["online_forwards"] < steps, summary


def test_a_stopped_online_run_resumes_its_stream_where_it_stopped(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    trace = tmp_path / "broken.trace"
    # features made anew each epoch, as on a GPU: the resumed run's batches then hold
    # bit for bit what the uninterrupted run's do
    uncached = ("--feature-cache-gb", "0")
    assert train(parse_args(online(tiny, whole, *uncached)),
                 ProgressReporter(None, "step")) == 0

    def after_four_steps() -> bool:  # a SIGTERM mid-epoch, as workers.train takes it
        return trace.exists() and len(trace.read_text().splitlines()) >= 4

    args = parse_args(online(tiny, broken, "--trace-data", str(trace), *uncached))
    assert train(args, ProgressReporter(None, "step"), stop=after_four_steps) \
        == EXIT_TERMINATED
    state = json.loads((broken / "checkpoints" / "step_0000004" /
                        "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 4  # mid-epoch
    assert train(args, ProgressReporter(None, "step")) == 0
    steps = [x["step"] for x in lines(trace)]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] == state["total_steps"]
    got = load_file(broken / "draft" / "model.safetensors")
    want = load_file(whole / "draft" / "model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5)


def test_conversations_the_target_cannot_take_are_skipped_and_counted(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    conversations = tmp_path / "conv.jsonl"
    text = tiny["conversations"].read_text()
    long_answer = {"id": "long", "messages": [
        {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": " ".join(["word"] * 400)}]}
    empty = {"id": "empty", "messages": []}
    conversations.write_text(text + json.dumps(long_answer) + "\nnot json\n"
                             + json.dumps(empty) + "\n")
    out = tmp_path / "out"
    args = parse_args([*common(tiny, out), "--online", "--conversations", str(conversations),
                       *ARGS, "--max-length", "256", "--max-steps", "2"])
    assert train(args, ProgressReporter(None, "step")) == 0
    skipped = json.loads((out / "train_summary.json").read_text())["online_skipped"]
    # the line that is not JSON, and the conversation with no messages (malformed or
    # empty, as workers.extract reads it)
    assert skipped["too_long"] == 1 and skipped["foreign_tokens"] == 0, skipped
    assert skipped["malformed_lines"] + skipped["empty"] == 2, skipped


@pytest.mark.parametrize("flags", [["--online"], ["--online", "--data", "x",
                                                  "--conversations", "y"],
                                   ["--conversations", "y"], ["--max-length", "9"]])
def test_online_usage_errors(tiny: dict[str, Path], tmp_path: Path,
                             flags: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "workers.train", *common(tiny, tmp_path),
                             *flags], cwd=REPO, env=worker_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--online" in result.stderr or "--data" in result.stderr
