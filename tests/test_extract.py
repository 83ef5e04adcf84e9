"""workers.extract on CPU with a tiny random Llama: exact tensors, batching, resume,
NaN samples, long samples, a full disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import make_conversations, saved, wait_for, worker_env
from workers.common import tokenize_conversation
from workers.eagle3.extraction.extractor import capture_layers, pack_batches

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

REPO = Path(__file__).resolve().parent.parent


def extract(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "workers.extract", *map(str, args)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=worker_env())
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_saved_tensors_equal_the_models_own_hidden_states(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    extract("--model", tiny_model, "--data", data, "--out", out, "--dtype", "fp32",
            "--store", "dtype", "--batch-tokens", "4096", "--device", "cpu")
    files = saved(out)
    assert len(files) == 32
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    layers = capture_layers(model.config.num_hidden_layers)
    assert layers == [2, 4, 5]
    records = [json.loads(line) for line in data.read_text().splitlines()]
    for record in records:
        tensors = files[record["id"]]
        tokens = tokenize_conversation(tokenizer, record["messages"])
        ids = torch.tensor([tokens.input_ids])
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states
        expected_aux = torch.cat([hidden[i][0] for i in layers], dim=-1)
        # batched with right padding vs alone: fp32 kernels agree to rounding
        torch.testing.assert_close(tensors["aux_hidden_states"], expected_aux,
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tensors["hidden_state"], hidden[-1][0], atol=1e-4, rtol=1e-4)
        assert tensors["input_ids"].tolist() == tokens.input_ids
        assert tensors["loss_mask"].tolist() == tokens.loss_mask
        assert tensors["aux_hidden_states"].shape == (len(tokens.input_ids), 3 * 64)
        assert tensors["input_ids"].dtype == torch.int64
    config = json.loads((out / "extract_config.json").read_text())
    assert config["aux_layer_ids"] == [2, 4, 5] and config["hidden_size"] == 64


def test_batching_keeps_request_identity(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    batched, single = tmp_path / "batched", tmp_path / "single"
    extract("--model", tiny_model, "--data", data, "--out", batched, "--dtype", "fp32",
            "--store", "dtype", "--batch-tokens", "2048", "--writers", "3")
    extract("--model", tiny_model, "--data", data, "--out", single, "--dtype", "fp32",
            "--store", "dtype", "--batch-tokens", "1", "--writers", "1")
    a, b = saved(batched), saved(single)
    assert a.keys() == b.keys()
    for sample_id in a:
        for key in ("aux_hidden_states", "hidden_state", "input_ids", "loss_mask"):
            torch.testing.assert_close(a[sample_id][key], b[sample_id][key],
                                       atol=1e-4, rtol=1e-4)


def test_default_dtype_store_and_files_are_sharded(tiny_model: Path, tmp_path: Path) -> None:
    """The default dtype is `auto`: bf16 on a GPU, fp32 on the CPU (where bf16 matmuls
    run many times slower); the default store is fp8 (one scale per token and layer);
    --store dtype keeps the compute dtype, and --dtype bf16 is bf16 anywhere."""
    data = make_conversations(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    extract("--model", tiny_model, "--data", data, "--out", out, "--limit", "5", "--device", "cpu")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.safetensors"))
    assert files == [f"rows_0-2000/{i:08d}.safetensors" for i in range(5)]
    stored = load_file(out / files[0])
    assert stored["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["aux_hidden_states_scale"].shape == (stored["input_ids"].numel(), 3)
    config = json.loads((out / "extract_config.json").read_text())
    assert (config["dtype"], config["store"]) == ("fp32", "fp8")
    for dtype, expected in (("auto", torch.float32), ("bf16", torch.bfloat16)):
        kept = tmp_path / dtype
        extract("--model", tiny_model, "--data", data, "--out", kept, "--limit", "1",
                "--device", "cpu", "--dtype", dtype, "--store", "dtype")
        assert load_file(kept / files[0])["aux_hidden_states"].dtype == expected


def test_resume_after_sigkill_completes_without_duplicates(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=12)  # 384 samples
    out = tmp_path / "out"
    args = [sys.executable, "-m", "workers.extract", "--model", str(tiny_model),
            "--data", str(data), "--out", str(out), "--batch-tokens", "64", "--writers", "2"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=worker_env())
    try:
        wait_for(lambda: len(list(out.glob("rows_*/*.safetensors"))) >= 40, 120,
                 what="some samples written")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    first_run = {p: p.stat().st_ino for p in out.glob("rows_*/*.safetensors")}
    assert 40 <= len(first_run) < 384
    result = extract("--model", tiny_model, "--data", data, "--out", out)
    assert f"{len(first_run)} already done" in result.stderr
    files = list(out.glob("rows_*/*.safetensors"))
    assert len(files) == 384
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    for path, inode in first_run.items():
        assert path.stat().st_ino == inode  # not written twice
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    indexes = [entry["index"] for entry in manifest]
    assert sorted(indexes) == list(range(384))  # each exactly once
    for entry in manifest[::37]:
        tensors = load_file(out / entry["file"])
        assert tensors["input_ids"].shape[0] == entry["seq_len"]
        assert (out / entry["file"]).stat().st_size == entry["bytes"]


def test_nonfinite_samples_are_skipped_and_counted(tiny_model: Path, tmp_path: Path) -> None:
    poisoned = tmp_path / "poisoned"
    shutil.copytree(tiny_model, poisoned)
    model = AutoModelForCausalLM.from_pretrained(poisoned, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(poisoned)
    bad_token = tokenizer.convert_tokens_to_ids("<think>") if "<think>" in tokenizer.get_vocab() \
        else tokenizer("let me think", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_token] = float("nan")
    model.save_pretrained(poisoned)
    data = make_conversations(tmp_path / "conv.jsonl")
    records = [json.loads(line) for line in data.read_text().splitlines()]
    poisoned_ids = {r["id"] for r in records if bad_token in
                    tokenize_conversation(tokenizer, r["messages"]).input_ids}
    assert 0 < len(poisoned_ids) < len(records)
    out = tmp_path / "out"
    extract("--model", poisoned, "--data", data, "--out", out, "--dtype", "fp32")
    summary = json.loads((out / "extract_summary.json").read_text())
    assert set(summary["nonfinite_skipped"]) == poisoned_ids
    assert set(saved(out)) == {r["id"] for r in records} - poisoned_ids


def test_too_long_samples_truncate_or_skip(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    truncated, skipped = tmp_path / "t", tmp_path / "s"
    extract("--model", tiny_model, "--data", data, "--out", truncated, "--max-length", "40")
    assert max(e["seq_len"] for e in map(json.loads, (truncated / "manifest.jsonl")
                                         .read_text().splitlines())) == 40
    extract("--model", tiny_model, "--data", data, "--out", skipped, "--max-length", "40",
            "--on-too-long", "skip")
    summary = json.loads((skipped / "extract_summary.json").read_text())
    assert summary["too_long_skipped"] and summary["written"] == 32 - len(
        summary["too_long_skipped"])


def test_bad_input(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    missing = extract("--model", tmp_path / "nope", "--data", data, "--out", tmp_path / "o",
                      check=False)
    assert missing.returncode == 2 and missing.stderr.startswith("error: model")
    assert "Traceback" not in missing.stderr
    with open(data, "a") as f:
        f.write("{broken\n")
    result = extract("--model", tiny_model, "--data", data, "--out", tmp_path / "o")
    assert "skipping malformed line 33" in result.stderr
    assert json.loads((tmp_path / "o" / "extract_summary.json").read_text())[
        "malformed_lines"] == [33]


def test_full_disk_stops_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=4)
    disk = tmp_path / "disk"
    disk.mkdir()
    command = (f"mount -t tmpfs -o size=600k tmpfs {disk} && "
               f"{sys.executable} -m workers.extract --model {tiny_model} --data {data} "
               f"--out {disk}/out --dtype fp32; echo rc=$?; ls -a {disk}/out/rows_0-2000 | "
               f"grep -c tmp; umount {disk}")
    prefix = [] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    result = subprocess.run([*prefix, "sh", "-c", command], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=worker_env())
    assert "rc=4" in result.stdout, result.stdout + result.stderr[-2000:]
    assert "error: disk full" in result.stderr and "rerun the same command" in result.stderr
    assert result.stdout.strip().endswith("0")  # no temp file left behind
    assert "Traceback" not in result.stderr


def test_pack_batches_respects_the_token_budget() -> None:
    from workers.eagle3.extraction.extractor import Sample

    samples = [Sample(i, str(i), [1] * n, [0] * n) for i, n in enumerate([5, 50, 7, 30, 8, 100])]
    batches = pack_batches(samples, 64)
    assert sorted(s.index for b in batches for s in b) == list(range(6))
    for batch in batches:
        longest = max(len(s.input_ids) for s in batch)
        assert len(batch) == 1 or len(batch) * longest <= 64
