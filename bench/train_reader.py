"""The training reader's tokens/s on this machine's CPU (no GPU needed): `load_batch` as
`workers.train` calls it on a GPU (cast to bf16, one thread), over extractions of
`--config`'s shapes written by `bench/train_gpu.py`'s writer (random features, lengths
uniform in [64, 512)): an fp8 extraction read the two ways (decoded to bf16 by the reader,
as before; kept as stored for the GPU to decode, `load_batch(fp8=True)`, as now) and a
bf16 extraction for reference, alternating, `--repeats` runs each over the same batches.

    .venv/bin/python bench/train_reader.py --dir /tmp/reader --config smollm2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from train_gpu import draft_config, write_extraction  # noqa: E402

from workers.eagle3.training.train_data import ExtractedData, load_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True,
                        help="where the two extractions are written (kept, reused)")
    parser.add_argument("--config", choices=("8b", "smollm2"), default="smollm2")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = draft_config(False, args.config)
    data = {}
    for store in ("fp8", "bf16"):
        root = args.dir / f"{args.config}-{store}-{args.samples}"
        if not (root / "manifest.jsonl").exists():
            write_extraction(root, config, args.samples, store)
        data[store] = ExtractedData(root)
    arms = {"fp8, decoded to bf16 by the reader (before)": ("fp8", False),
            "fp8, kept as stored (decoded on the GPU)": ("fp8", True),
            "bf16": ("bf16", False)}

    def read(store: str, fp8: bool) -> float:
        extraction = data[store]
        plan = extraction.plan_epoch(0, 0, args.batch_tokens)[:args.batches]
        began = time.perf_counter()
        tokens = sum(load_batch(extraction.root, batch, config.hidden_size, args.batch_tokens,
                                dtype=torch.bfloat16, fp8=fp8).tokens for batch in plan)
        return tokens / (time.perf_counter() - began)

    for store, fp8 in arms.values():  # the page cache warm
        read(store, fp8)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, (store, fp8) in arms.items():
            rates[arm].append(read(store, fp8))
    print(f"| reader ({args.config}, one thread, {args.batches} batches of "
          f"{args.batch_tokens:,} tokens, {args.repeats} runs each) | median tokens/s | min "
          "| max |")
    print("| --- | ---: | ---: | ---: |")
    for arm, values in rates.items():
        print(f"| {arm} | {statistics.median(values):,.0f} | {min(values):,.0f} "
              f"| {max(values):,.0f} |")


if __name__ == "__main__":
    main()
