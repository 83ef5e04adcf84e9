"""workers.vocab on real files: crafted data with a known top-N, the real CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from workers import vocab  # noqa: E402
from workers.common import tokenize_conversation  # noqa: E402
from workers.eagle3.draft import vocab_mapping  # noqa: E402
from workers.fixtures.tiny import build_tokenizer, corpus  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(corpus(), vocab_size=300).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_size(tokenizer_dir: Path) -> int:
    return vocab.load_tokenizer(tokenizer_dir)[1]


def write_sample(path: Path, ids: list[int], mask: list[int],
                 mask_dtype: torch.dtype = torch.int64) -> None:
    """One file as workers.extract writes it (hidden states included, never read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    seq_len = len(ids)
    save_file({"aux_hidden_states": torch.zeros(seq_len, 12, dtype=torch.bfloat16),
               "hidden_state": torch.zeros(seq_len, 4, dtype=torch.bfloat16),
               "input_ids": torch.tensor(ids, dtype=torch.int64),
               "loss_mask": torch.tensor(mask).to(mask_dtype)}, str(path))


def run_vocab(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    """`python -m workers.vocab ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        vocab.main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_out(out: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    tensors = load_file(str(out))
    report = json.loads(Path(f"{out}.json").read_text())
    return tensors["d2t"], tensors["t2d"], report


def assert_mapping(d2t: torch.Tensor, t2d: torch.Tensor, chosen: list[int],
                   target_size: int) -> None:
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.shape == (target_size,) and d2t.shape == (len(chosen),)
    assert int(t2d.sum()) == len(chosen)
    assert torch.nonzero(t2d).reshape(-1).tolist() == sorted(chosen)
    for draft_id in range(len(chosen)):
        assert draft_id + int(d2t[draft_id]) == sorted(chosen)[draft_id]


def reference_top(counts: list[int], n: int) -> list[int]:
    """The spec, spelled out: highest count first, ties by lower id."""
    return sorted(sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:n])


@pytest.fixture
def crafted(tmp_path: Path) -> Path:
    """Counted (loss_mask 1): 10 x5, 30 x3, 20 x3, 7 x3, 5 x1 -> 15 tokens; top 3 is
    {10, 7, 20} (30 loses the tie). Ids 50, 60 and extra 30s sit where loss_mask is 0,
    ids 98/99 only in files that must be ignored."""
    data = tmp_path / "extracted"
    write_sample(data / "rows_0-2" / "s0.safetensors",
                 [50] * 100 + [10] * 5 + [30] * 3, [0] * 100 + [1] * 8, torch.bool)
    write_sample(data / "rows_2-4" / "s1.safetensors",
                 [20, 7] * 3 + [5] + [30] * 10 + [60] * 50, [1] * 7 + [0] * 60)
    for ignored in (".s2.safetensors", "s3.safetensors.tmp", "s4.tmp.safetensors",
                    ".cache/s5.safetensors"):
        write_sample(data / "rows_2-4" / ignored, [99] * 1000 + [98] * 1000, [1] * 2000)
    return data


def test_top_n_counts_only_assistant_tokens_and_ties_go_to_lower_id(
        crafted: Path, tokenizer_dir: Path, target_size: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    progress_file = tmp_path / "progress.json"
    monkeypatch.setenv("JOBSUP_PROGRESS_FILE", str(progress_file))
    out = tmp_path / "out" / "vocab.safetensors"
    code, stdout, stderr = run_vocab(capsys, "--data", crafted, "--tokenizer", tokenizer_dir,
                                     "--draft-vocab-size", 3, "--out", out)
    assert code == 0, stderr
    d2t, t2d, report = read_out(out)
    assert_mapping(d2t, t2d, [7, 10, 20], target_size)
    assert d2t.tolist() == [7, 9, 18]
    assert report["coverage"] == 11 / 15
    assert (report["tokens_counted"], report["distinct_tokens"], report["samples"]) == (15, 5, 2)
    assert report["source"] == "counted" and report["target_vocab_size"] == target_size
    assert report["skipped_lines"] == [] and report["skipped_files"] == []
    assert "73.33%" in stdout
    progress = json.loads(progress_file.read_text())
    assert progress["done"] == progress["total"] == 2
    assert progress["metrics"] == {"coverage": pytest.approx(11 / 15)}
    assert not list(out.parent.glob(".*tmp")), "temp files left behind"


@pytest.mark.parametrize("seed", range(5))
def test_selection_matches_the_spec_on_random_data_with_many_ties(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.randint(20, 80)
    counter = vocab.TokenCounter(size, flush_tokens=rng.randint(1, 50))
    expected = [0] * size
    for _ in range(rng.randint(1, 30)):
        ids = [rng.randrange(size // 2) * 2 for _ in range(rng.randint(0, 40))]  # even only
        mask = [rng.randint(0, 1) for _ in ids]
        counter.add(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask), "sample")
        for token, counted in zip(ids, mask, strict=True):
            expected[token] += counted
    counts = counter.counts()
    assert counts.tolist() == expected
    n = rng.randint(1, size)
    used = vocab_mapping.select_draft_vocab(counts, n)
    assert used.tolist() == reference_top(expected, n)
    d2t, t2d = vocab_mapping.build_mapping(used, size)
    vocab_mapping.validate_mapping(d2t, t2d, "built")
    assert_mapping(d2t, t2d, used.tolist(), size)


def test_fewer_distinct_ids_than_asked_are_filled_with_smallest_unused(
        tmp_path: Path, tokenizer_dir: Path, target_size: int,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "extracted"
    write_sample(data / "a.safetensors", [9, 5, 5, 2, 4, 4], [1, 1, 1, 1, 0, 0])
    save_file({"input_ids": torch.tensor([1, 2, 3])}, str(data / "no_mask.safetensors"))
    (data / "garbage.safetensors").write_bytes(b"not a safetensors file")
    write_sample(data / "lengths.safetensors", [1, 2, 3], [1, 1])
    out = tmp_path / "vocab.safetensors"
    code, stdout, stderr = run_vocab(capsys, "--data", data, "--tokenizer", tokenizer_dir,
                                     "--draft-vocab-size", 6, "--out", out)
    assert code == 0, stderr
    d2t, t2d, report = read_out(out)
    assert_mapping(d2t, t2d, [0, 1, 2, 3, 5, 9], target_size)
    assert report["coverage"] == 1.0 and report["distinct_tokens"] == 3
    skipped = ["garbage.safetensors", "lengths.safetensors", "no_mask.safetensors"]
    assert report["skipped_files"] == skipped
    assert all(name in caplog.text for name in skipped)
    assert "skipped 3 files: garbage.safetensors" in stdout


def test_max_length_counts_only_the_first_tokens(
        tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "extracted"
    write_sample(data / "a.safetensors", [1, 1, 1, 2, 2, 2, 2], [1] * 7)
    out = tmp_path / "vocab.safetensors"
    code, _, stderr = run_vocab(capsys, "--data", data, "--tokenizer", tokenizer_dir,
                                "--draft-vocab-size", 1, "--max-length", 4, "--out", out)
    assert code == 0, stderr
    _, t2d, report = read_out(out)
    assert torch.nonzero(t2d).reshape(-1).tolist() == [1]  # 2 wins without the cut
    assert report["truncated_samples"] == 1 and report["coverage"] == 3 / 4


@pytest.mark.slow
def test_jsonl_end_to_end_through_the_cli(tmp_path: Path, tokenizer_dir: Path,
                                          target_size: int) -> None:
    conversations = [
        [{"role": "user", "content": "Give three facts about the water cycle."},
         {"role": "assistant", "content": "Water evaporates, condenses and falls as rain."}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Why do prime numbers matter?"},
         {"role": "assistant", "content": "They are the building blocks of all numbers.",
          "reasoning_content": "The answer is that every number factors into primes."}],
        [{"role": "user", "content": "Explain binary search."},
         {"role": "assistant", "content": "Halve the range until the item is found."},
         {"role": "user", "content": "And its cost?"},
         {"role": "assistant", "content": "Numbers: 0 1 2 3, so log n steps."}],
    ]
    lines = [json.dumps({"id": "c0", "messages": conversations[0]}), "{not json",
             json.dumps({"id": "c1", "messages": conversations[1]}),
             json.dumps({"id": "bad", "messages": "not a list"}),
             json.dumps({"id": "c2", "messages": conversations[2]})]
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(lines) + "\n")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    expected = [0] * target_size
    for messages in conversations:
        tokenized = tokenize_conversation(tokenizer, messages)
        for token, counted in zip(tokenized.input_ids, tokenized.loss_mask, strict=True):
            expected[token] += counted
    draft_size = 12
    chosen = reference_top(expected, draft_size)

    out = tmp_path / "vocab.safetensors"
    progress_file = tmp_path / "progress.json"
    env = {**os.environ, "JOBSUP_PROGRESS_FILE": str(progress_file)}
    proc = subprocess.run(
        [sys.executable, "-m", "workers.vocab", "--data", str(data), "--tokenizer",
         str(tokenizer_dir), "--draft-vocab-size", str(draft_size), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "line 2" in proc.stderr and "line 4" in proc.stderr
    d2t, t2d, report = read_out(out)
    assert_mapping(d2t, t2d, chosen, target_size)
    assert report["skipped_lines"] == [2, 4] and report["samples"] == 3
    assert report["tokens_counted"] == sum(expected)
    assert report["coverage"] == sum(expected[i] for i in chosen) / sum(expected)
    assert f"{100 * report['coverage']:.2f}%" in proc.stdout
    progress = json.loads(progress_file.read_text())
    assert progress["done"] == progress["total"] == 5
    assert progress["metrics"]["coverage"] == pytest.approx(report["coverage"])


def make_checkpoint(path: Path, d2t: torch.Tensor, t2d: torch.Tensor,
                    lm_head_rows: int | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rows = lm_head_rows if lm_head_rows is not None else d2t.numel()
    save_file({"fc.weight": torch.zeros(4, 12), "lm_head.weight": torch.zeros(rows, 4),
               "d2t": d2t, "t2d": t2d}, str(path / "model.safetensors"))
    return path


def test_from_checkpoint_reuses_the_mapping_exactly(
        crafted: Path, tokenizer_dir: Path, target_size: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    used = torch.tensor([1, 5, 10, 100, 200])  # not what counting crafted would pick
    d2t, t2d = vocab_mapping.build_mapping(used, target_size)
    checkpoint = make_checkpoint(tmp_path / "draft", d2t, t2d)
    out = tmp_path / "vocab.safetensors"
    code, stdout, stderr = run_vocab(capsys, "--data", crafted, "--tokenizer", tokenizer_dir,
                                     "--from-checkpoint", checkpoint, "--out", out)
    assert code == 0, stderr
    got_d2t, got_t2d, report = read_out(out)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    assert report["source"] == "checkpoint" and report["draft_vocab_size"] == 5
    assert report["coverage"] == 6 / 15  # ids 10 (x5) and 5 (x1) of the 15 counted

    # a vocab file this worker wrote is a checkpoint too; no --data: no coverage
    again = tmp_path / "again.safetensors"
    code, stdout, stderr = run_vocab(capsys, "--tokenizer", tokenizer_dir,
                                     "--from-checkpoint", out, "--out", again)
    assert code == 0, stderr
    got_d2t, got_t2d, report = read_out(again)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    assert report["coverage"] is None and "coverage n/a" in stdout


@pytest.mark.parametrize("case, message", [
    ("count", "t2d marks 4 target ids but d2t has 5"),
    ("positions", "not the ids where t2d is true"),
    ("other_vocab", "target vocab of"),
    ("lm_head", "lm_head has 7 rows"),
    ("draft_size", "differs from the checkpoint's draft vocab of 5"),
    ("no_mapping", "no d2t and t2d tensor"),
])
def test_from_checkpoint_rejects_a_mapping_that_does_not_fit(
        case: str, message: str, tokenizer_dir: Path, target_size: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    used = torch.tensor([1, 5, 10, 100, 200])
    d2t, t2d = vocab_mapping.build_mapping(used, target_size)
    extra: list[Any] = []
    if case == "count":
        t2d[200] = False
    elif case == "positions":
        t2d[200], t2d[201] = False, True
    elif case == "other_vocab":
        d2t, t2d = vocab_mapping.build_mapping(used, target_size + 10)
    elif case == "draft_size":
        extra = ["--draft-vocab-size", 6]
    checkpoint = make_checkpoint(tmp_path / "draft", d2t, t2d,
                                 lm_head_rows=7 if case == "lm_head" else None)
    if case == "no_mapping":
        save_file({"lm_head.weight": torch.zeros(5, 4)}, str(checkpoint / "model.safetensors"))
    out = tmp_path / "vocab.safetensors"
    code, _, stderr = run_vocab(capsys, "--tokenizer", tokenizer_dir, "--from-checkpoint",
                                checkpoint, "--out", out, *extra)
    assert code == 2
    assert stderr.startswith("error: ") and message in stderr
    assert not out.exists()


def test_config_vocab_size_beside_the_tokenizer_sets_the_target_size(
        crafted: Path, tokenizer_dir: Path, target_size: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": target_size + 16}))
    out = tmp_path / "vocab.safetensors"
    code, _, stderr = run_vocab(capsys, "--data", crafted, "--tokenizer", model_dir,
                                "--draft-vocab-size", 3, "--out", out)
    assert code == 0, stderr
    d2t, t2d, report = read_out(out)
    assert_mapping(d2t, t2d, [7, 10, 20], target_size + 16)
    assert report["target_vocab_size"] == target_size + 16


def test_user_mistakes_exit_2_with_one_line(
        crafted: Path, tokenizer_dir: Path, target_size: int, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "vocab.safetensors"
    common = ["--tokenizer", tokenizer_dir, "--out", out]
    cases = [
        (["--data", crafted, "--draft-vocab-size", target_size + 1], "must be between 1 and"),
        (["--data", crafted, "--draft-vocab-size", 0], "must be between 1 and"),
        (["--data", tmp_path / "missing.jsonl"], "does not exist"),
        (["--data", crafted, "--tokenizer", tmp_path / "nope"], "does not exist"),
        ([], "--data is required"),
    ]
    out_of_vocab = tmp_path / "foreign"
    write_sample(out_of_vocab / "a.safetensors", [3, target_size], [1, 1])
    cases.append((["--data", out_of_vocab, "--draft-vocab-size", 3],
                  f"token id {target_size} is outside"))
    prompts_only = tmp_path / "prompts"
    write_sample(prompts_only / "a.safetensors", [3, 4], [0, 0])
    cases.append((["--data", prompts_only, "--draft-vocab-size", 3], "no assistant tokens"))
    (tmp_path / "empty").mkdir()
    cases.append((["--data", tmp_path / "empty", "--draft-vocab-size", 3], "no usable samples"))
    cases.append((["--data", crafted, "--draft-vocab-size", 3, "--out", tmp_path], "directory"))
    for args, message in cases:
        code, _, stderr = run_vocab(capsys, *common, *args)
        assert code == 2, (args, stderr)
        assert stderr.startswith("error: ") and message in stderr, (args, stderr)
        assert not out.exists()


def test_cli_error_has_no_traceback(tmp_path: Path, tokenizer_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "workers.vocab", "--data", str(tmp_path / "missing"),
         "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "v.safetensors")],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: data") and "Traceback" not in proc.stderr
