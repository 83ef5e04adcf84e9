"""Data-parallel extraction scaling (`workers.extract --gpus N`) on a multi-GPU host:
an 8B-class Llama with random weights saved to disk, conversations truncated to 1,450
tokens, the real CLI with --gpus 1, 2, ... all; tokens/s as the ranks report it (model
load excluded), scaling efficiency, and the disk-write ceiling of the same run.
`python bench/extract_multi_gpu.py --work /tmp/mg --samples 512`."""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract_gpu import disk_ceiling  # noqa: E402

from workers.eagle3.extraction.hidden_files import DEFAULT_WRITEBACK  # noqa: E402
from workers.fixtures.tiny import build_tokenizer, corpus  # noqa: E402


def build(work: Path, samples: int) -> tuple[Path, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir, data = work / "model", work / "conv.jsonl"
    tokenizer = build_tokenizer(corpus())
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, rope_theta=500000.0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    rng = random.Random(0)
    words = ["token", "draft", "model", "tensor", "hidden", "state", "layer", "answer"]
    with open(data, "w") as f:
        for i in range(samples):
            text = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(900))
            f.write(json.dumps({"id": f"s{i}", "messages": [
                {"role": "user", "content": "Explain."},
                {"role": "assistant", "content": text}]}) + "\n")
    return model_dir, data


DONE_LINE = re.compile(r"done: \d+ written \([\d.]+ GB, (\d+) tokens/s\)")
"""The line each extraction process logs at its end; tokens/s excludes the model load."""


def extract(model: Path, data: Path, out: Path, *options: str) -> tuple[int, str]:
    """Run the real CLI into a fresh `out`; (exit code, stderr)."""
    shutil.rmtree(out, ignore_errors=True)
    result = subprocess.run([sys.executable, "-m", "workers.extract", "--model", str(model),
                             "--data", str(data), "--out", str(out), "--max-length", "1450",
                             "--store", "dtype",  # bf16: the GB/s and the documented runs
                             *options], capture_output=True, text=True)
    return result.returncode, result.stderr


def run(model: Path, data: Path, out: Path, gpus: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    code, stderr = extract(model, data, out, "--gpus", str(gpus))
    wall = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(stderr[-3000:])
    rates = [float(x) for x in DONE_LINE.findall(stderr)]
    assert len(rates) == gpus, stderr[-2000:]
    return sum(rates), wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("/tmp/mg"))
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()
    n_gpus = torch.cuda.device_count()
    model, data = build(args.work, args.samples)
    print(f"{n_gpus} x {torch.cuda.get_device_name(0)}, {args.samples} samples", flush=True)
    rows = []
    for gpus in range(1, n_gpus + 1):
        rate, wall = run(model, data, args.work / "out", gpus)
        rows.append((gpus, rate, wall))
        print(f"gpus={gpus}: {rate:,.0f} tokens/s (wall {wall:.0f} s)", flush=True)
    shutil.rmtree(args.work / "out", ignore_errors=True)
    disk = disk_ceiling(args.work / "raw", [47_600_000] * 128, 8, DEFAULT_WRITEBACK)
    shutil.rmtree(args.work / "raw", ignore_errors=True)
    print("\n| GPUs | tokens/s (sum of ranks) | scaling efficiency | GB/s (x 32.8 kB) |")
    print("| ---: | ---: | ---: | ---: |")
    for gpus, rate, _ in rows:
        print(f"| {gpus} | {rate:,.0f} | {rate / (rows[0][1] * gpus):.0%} | "
              f"{rate * 32.8e3 / 1e9:.2f} |")
    print(f"\ndisk ceiling (8 threads, --writeback {DEFAULT_WRITEBACK} as the runs, "
          f"48 MB files): {disk:.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
