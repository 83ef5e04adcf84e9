"""Model split (`--device a,b` / `--gpus-per-model K`): the placement plan is contiguous
and balanced, and a split run writes what a single-device run writes. Only CPUs here,
so the cross-device moves themselves are checked on the GPU machine
(bench/extract_split_gpu.py, results in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tests.helpers import make_conversations, worker_env
from workers.eagle3.target.split import balanced_assignment, parse_devices, plan_device_map

REPO = Path(__file__).resolve().parent.parent


def run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.extract", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=worker_env(CUDA_VISIBLE_DEVICES=""))


@pytest.mark.parametrize("sizes,parts", [
    ([10] * 12, 2), ([10] * 12, 3), ([50] + [10] * 30 + [1, 50], 4), ([5] * 8, 8),
    ([7, 1, 1, 1, 30, 2, 2, 9], 3)])
def test_balanced_assignment_is_contiguous_and_balanced(sizes: list[int], parts: int) -> None:
    got = balanced_assignment(sizes, parts)
    assert got == sorted(got) and got[0] == 0 and got[-1] == parts - 1  # contiguous runs
    total, biggest = sum(sizes), max(sizes)
    for part in range(parts):
        held = sum(s for s, p in zip(sizes, got, strict=True) if p == part)
        assert abs(held - total / parts) <= biggest  # off by at most one item


def test_balanced_assignment_edges() -> None:
    assert balanced_assignment([3, 3], 1) == [0, 0]
    assert balanced_assignment([0, 0, 0], 2) == [0, 0, 0]
    assert balanced_assignment([], 2) == []
    with pytest.raises(ValueError):
        balanced_assignment([1], 0)


def test_parse_devices() -> None:
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert parse_devices("cpu") == ["cpu"]
    with pytest.raises(ValueError):
        parse_devices(" , ")


def test_plan_places_layers_in_order_and_balances_bytes(tiny_model: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_hidden_layers = 12
    plan = plan_device_map(config, ["cuda:0", "cuda:1", "cuda:2"], torch.bfloat16)
    layers = [plan[f"model.layers.{i}"] for i in range(12)]
    assert layers == sorted(layers) and set(layers) == {"cuda:0", "cuda:1", "cuda:2"}
    assert layers.count("cuda:1") == 4  # equal layers, embedding and head of equal size
    assert plan["model.embed_tokens"] == "cuda:0" and plan["model.rotary_emb"] == "cuda:0"
    assert plan["model.norm"] == "cuda:2" and plan["lm_head"] == "cuda:2"
    config.tie_word_embeddings = True  # one tensor: the head goes with the embedding
    assert plan_device_map(config, ["cuda:0", "cuda:1"], torch.bfloat16)["lm_head"] == "cuda:0"


@pytest.mark.slow
def test_split_run_writes_what_a_single_device_run_writes(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    single, split = tmp_path / "single", tmp_path / "split"
    first = run("--model", tiny_model, "--data", data, "--out", single, "--dtype", "fp32",
                "--store", "dtype",
                "--device", "cpu")
    assert first.returncode == 0, first.stderr[-2000:]
    second = run("--model", tiny_model, "--data", data, "--out", split, "--dtype", "fp32",
                 "--store", "dtype",
                 "--device", "cpu,cpu", "--batch-tokens", "256")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "model split over 2 devices" in second.stderr
    files = sorted(p.relative_to(single) for p in single.glob("rows_*/*.safetensors"))
    assert files
    assert files == sorted(p.relative_to(split) for p in split.glob("rows_*/*.safetensors"))
    for name in files:
        one, two = load_file(single / name), load_file(split / name)
        assert one.keys() == two.keys()
        for key in one:
            torch.testing.assert_close(one[key], two[key], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--gpus-per-model", "2"], "CUDA device(s) available"),
    (["--gpus", "2", "--gpus-per-model", "2"], "CUDA device(s) available"),
    (["--gpus", "two"], "--gpus takes a number or 'all'"),
    (["--gpus-per-model", "0"], "--gpus-per-model must be >= 1"),
    (["--gpus-per-model", "2", "--ranks", "2"], "not --ranks"),
    (["--gpus", "2", "--device", "cuda:2"], "give --device cuda:2,cuda:3 alone"),
])
def test_wrong_split_options_say_why(tiny_model: Path, tmp_path: Path, args: list[str],
                                     message: str) -> None:
    data = make_conversations(tmp_path / "conv.jsonl")
    result = run("--model", tiny_model, "--data", data, "--out", tmp_path / "out", *args)
    assert result.returncode != 0
    assert message in result.stderr


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, *, shared: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.proj(hidden) + shared[0]


class _Decoder(torch.nn.Module):
    """Two "devices": cpu, then meta (shape-only tensors), like a decoder split in two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer().to("meta"), _Layer().to("meta")])
        self.norm = torch.nn.LayerNorm(4).to("meta")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = (torch.ones(4),)  # like the rotary cos/sin: made once, given to every layer
        for layer in self.layers:
            hidden = layer(hidden, shared=shared)
        return self.norm(hidden)


def test_transfers_move_each_tensor_once_per_device_per_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.eagle3.target.split as split

    moves: list[tuple[tuple[int, ...], str]] = []

    def counting(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        moves.append((tuple(tensor.shape), str(device)))
        return tensor.to(device)

    monkeypatch.setattr(split, "to_device", counting)
    base = _Decoder()
    transfers = split.Transfers(base)
    for passes in (1, 2):
        out = base(torch.zeros(3, 4))
        assert out.device.type == "meta" and out.shape == (3, 4)
        # the boundary's activation and the shared tensor, once each, not once per layer
        assert moves == [((3, 4), "meta"), ((4,), "meta")] * passes
        assert transfers._cache == {}  # a pass's copies are dropped when it ends
