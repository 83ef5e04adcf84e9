"""The four EAGLE-3 workers end to end on a GPU with real (generated) data: a small
random Llama (hidden 1024, 16 layers) and the 32 demo prompts, each step run as its
CLI would be (`python -m workers.<step>`), with per-step wall time and a check of
what each wrote. It exercises the GPU code paths the CPU tests cannot: generation on
the device, extraction's pinned async copies, the trainer's data loader feeding GPU
steps. `python bench/pipeline_gpu.py --out /tmp/pipe` (needs a CUDA device).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.fixtures.tiny import DEMO_PROMPTS, build_tiny_llama  # noqa: E402


def step(name: str, *args: str) -> float:
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", f"workers.{name}", *args],
                            capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    tail = "\n".join(result.stderr.strip().splitlines()[-3:])
    print(f"{name}: rc={result.returncode} {elapsed:.1f} s\n{tail}\n", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-4000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("/tmp/pipeline-gpu"))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    out = args.out
    model = build_tiny_llama(out / "model", layers=16, hidden=1024, heads=16, kv_heads=4,
                             intermediate=2816)
    times = {
        "generate": step("generate", "--prompts", str(DEMO_PROMPTS), "--out",
                         str(out / "conv.jsonl"), "--backend", "transformers", "--model",
                         str(model), "--device", args.device, "--max-tokens", "256",
                         "--batch-size", "16"),
        "extract": step("extract", "--model", str(model), "--data", str(out / "conv.jsonl"),
                        "--out", str(out / "hs"), "--device", args.device,
                        "--store", "dtype"),  # bf16, as the documented run
        "vocab": step("vocab", "--data", str(out / "hs"), "--tokenizer", str(model),
                      "--draft-vocab-size", "128", "--out", str(out / "vocab.safetensors")),
        "train": step("train", "--data", str(out / "hs"), "--target", str(model), "--vocab",
                      str(out / "vocab.safetensors"), "--out", str(out / "train"),
                      "--device", args.device, "--epochs", "20", "--batch-tokens", "2048",
                      "--log-every", "20"),
    }
    manifest = (out / "hs" / "manifest.jsonl").read_text().splitlines()
    config = json.loads((out / "train" / "draft" / "config.json").read_text())
    print("| step | seconds |\n| --- | ---: |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.1f} |")
    print(f"\n{len(manifest)} samples extracted; draft: {config['architectures']}, "
          f"draft_vocab_size {config['draft_vocab_size']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
