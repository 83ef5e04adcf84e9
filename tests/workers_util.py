"""Shared fixtures for the worker tests: a tiny random Llama and a conversations file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.tiny import DEMO_PROMPTS, build_tiny_llama


def make_model(path: Path) -> Path:
    return build_tiny_llama(path, layers=8, hidden=64)


def make_conversations(path: Path, copies: int = 1) -> Path:
    """The demo prompts with assistant answers of varied length (some with reasoning)."""
    with open(path, "w") as f:
        n = 0
        for _ in range(copies):
            for line in DEMO_PROMPTS.read_text().splitlines():
                record = json.loads(line)
                record["id"] = f"{record['id']}-{n}"
                words = " ".join(["token"] * (3 + n * 7 % 40))
                record["messages"].append({
                    "role": "assistant", "content": f"Answer {n}: {words}.",
                    "reasoning_content": "let me think" if n % 3 == 0 else None})
                f.write(json.dumps(record) + "\n")
                n += 1
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Import into a test module of tiny torch models: tiny ops gain nothing from
    intra-op threads, and on a busy 2-core machine two spinning OpenMP threads made a
    0.1 s step take 8 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
