"""GPU benchmark of workers.extract: an 8B-class Llama (random weights) on ~1,450-token
samples. Measured side by side in one run:

1. prefill ceiling: the same packed batches through the model with the capture hooks,
   nothing copied or written (tokens/s);
2. disk ceiling: files of the same sizes written by the same number of threads from
   memory, as the worker writes them (GB/s);
3. the worker with overlap (pinned async copies on a side stream, writer pool);
4. the worker without overlap (compute, then copy, then write);

each in every `--writeback` mode (default all: fsync, range, none), the final sync
counted, and for each `--store` (default bf16; `--store bf16 fp8` compares them side by
side: fp8 is `workers.extract --store fp8`, float8_e4m3fn with per-token, per-layer
scales encoded on the GPU before the copy, about half the bytes). With fp8 a fifth
ceiling is measured: the forward passes plus the fp8 encode, nothing copied or written.

Run on the H200: `python bench/extract_gpu.py --out /tmp/bench-extract`. `--tiny` runs
a small config on the CPU to check the script. Prints a markdown table; `--json FILE`
also writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.eagle3.extraction.extractor import (  # noqa: E402
    Capture,
    Extractor,
    Sample,
    Stats,
    pack_batches,
    pad_batch,
)
from workers.eagle3.extraction.fp8_features import encode  # noqa: E402
from workers.eagle3.extraction.hidden_files import (  # noqa: E402
    WRITEBACK_MODES,
    Writeback,
    sample_path,
    write_atomically,
)
from workers.eagle3.target.model import Target  # noqa: E402


def build_model(tiny: bool, device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    else:  # Llama-3-8B shapes
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8,
                             vocab_size=128256, max_position_embeddings=8192,
                             rope_theta=500000.0)
    dtype = torch.bfloat16
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def make_samples(n: int, mean_len: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        length = max(128, min(4096, int(rng.gauss(mean_len, mean_len * 0.2))))
        ids = [rng.randrange(vocab) for _ in range(length)]
        prompt = length // 5
        samples.append(Sample(i, f"s{i}", ids, [0] * prompt + [1] * (length - prompt)))
    return samples


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


STORES = {"bf16": "dtype", "fp8": "fp8"}
"""The bench's --store names -> workers.extract's (the model computes in bf16)."""


def prefill_ceiling(model: torch.nn.Module, samples: list[Sample], batch_tokens: int,
                    device: str, fp8: bool = False) -> float:
    """Tokens/s of the forward passes alone, hooks included, outputs discarded; with
    `fp8`, the captured states also encoded as `--store fp8` encodes them."""
    base = model.get_decoder()
    layers = [2, len(base.layers) // 2, len(base.layers) - 3]
    capture = Capture(base, layers)
    batches = pack_batches(samples, batch_tokens)
    tokens = sum(len(s.input_ids) for s in samples)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, mask = pad_batch(batch)
            base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            aux = torch.cat([capture.states[i] for i in layers], dim=-1)  # the same concat
            if fp8:
                encode(aux, 3)
                encode(capture.states["final"], 1)
    sync(device)
    capture.remove()
    return tokens / (time.perf_counter() - t0)


def file_sizes(samples: list[Sample], hidden: int, store: str = "bf16") -> list[int]:
    """Bytes of each sample's file (bf16 aux + final, or fp8 with a 4-byte scale per
    token and layer; int64 ids, uint8 mask)."""
    per_token = 4 * hidden * 2 if store == "bf16" else 4 * hidden + 4 * 4
    return [len(s.input_ids) * (per_token + 8 + 1) + 512 for s in samples]


def disk_ceiling(out: Path, sizes: list[int], writers: int, writeback: str) -> float:
    """GB/s writing files of these sizes with `writers` threads as the worker writes
    them (temp + rename, `writeback` mode), the final sync counted."""
    blob = memoryview(os.urandom(max(sizes)))
    policy = Writeback(writeback, in_flight_files=writers)

    def write(i: int) -> None:
        write_atomically(sample_path(out, i), [blob[: sizes[i]]], writeback=policy)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(len(sizes))))
    policy.close()
    os.sync()  # count the writeback, as the disk must take it in the end
    return sum(sizes) / (time.perf_counter() - t0) / 1e9


def run_worker(model: torch.nn.Module, samples: list[Sample], out: Path, *, overlap: bool,
               batch_tokens: int, writers: int, writeback: str, device: str,
               store: str = "bf16") -> tuple[float, float]:
    out.mkdir(parents=True, exist_ok=True)
    stats = Stats(total=len(samples))
    extractor = Extractor(Target.of(model), out, batch_tokens=batch_tokens, writers=writers,
                          queue_depth=3, overlap=overlap, writeback=writeback,
                          stats=stats, store=STORES[store])
    sync(device)
    t0 = time.perf_counter()
    extractor.run(samples)
    os.sync()  # count the writeback, as the disk must take it in the end
    elapsed = time.perf_counter() - t0
    assert stats.written == len(samples), (stats.written, len(samples))
    return stats.tokens / elapsed, stats.bytes_written / elapsed / 1e9


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    with contextlib.suppress(OSError):  # a cold page cache where allowed (root on the device)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-extract"))
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--mean-len", type=int, default=1450)
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--writeback", nargs="+", choices=WRITEBACK_MODES,
                        default=list(WRITEBACK_MODES), help="modes to run (default all)")
    parser.add_argument("--store", nargs="+", choices=list(STORES), default=["bf16"],
                        help="stores to run, side by side (default bf16; bf16 fp8 for both)")
    parser.add_argument("--tiny", action="store_true", help="small CPU config (a smoke run)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        args.samples, args.mean_len, args.batch_tokens = min(args.samples, 24), 200, 2048
    model = build_model(args.tiny, device)
    hidden = int(model.config.hidden_size)
    samples = make_samples(args.samples, args.mean_len, model.config.vocab_size)
    sizes = file_sizes(samples, hidden)  # bf16: the disk ceiling's files
    tokens = sum(len(s.input_ids) for s in samples)
    print(f"{len(samples)} samples, {tokens} tokens (mean {tokens / len(samples):.0f}), "
          f"{sum(sizes) / 1e9:.1f} GB per pass, hidden {hidden}, "
          f"{model.config.num_hidden_layers} layers, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)
    if device == "cuda":  # warm up kernels and the allocator
        prefill_ceiling(model, samples[:16], args.batch_tokens, device, "fp8" in args.store)

    results: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        results.setdefault("prefill tokens/s", []).append(
            prefill_ceiling(model, samples, args.batch_tokens, device))
        if "fp8" in args.store:
            results.setdefault("prefill + fp8 encode tokens/s", []).append(
                prefill_ceiling(model, samples, args.batch_tokens, device, fp8=True))
        for tag in args.writeback:
            clean(args.out)
            results.setdefault(f"disk GB/s ({tag})", []).append(
                disk_ceiling(args.out / "raw", sizes, args.writers, tag))
            for store in args.store:
                for overlap in (True, False):
                    clean(args.out)
                    name = f"worker {'overlap' if overlap else 'serial'} ({tag}, {store})"
                    tps, gbs = run_worker(model, samples, args.out / "w", overlap=overlap,
                                          batch_tokens=args.batch_tokens, writers=args.writers,
                                          writeback=tag, device=device, store=store)
                    results.setdefault(f"{name} tokens/s", []).append(tps)
                    results.setdefault(f"{name} GB/s", []).append(gbs)
        print(json.dumps({k: round(v[-1], 3) for k, v in results.items()}), flush=True)
    clean(args.out)

    median = {k: statistics.median(v) for k, v in results.items()}
    # per store: the bytes of a token on disk, and the compute ceiling it runs under
    gb_per_token = {store: sum(file_sizes(samples, hidden, store)) / tokens / 1e9
                    for store in args.store}
    compute = {"bf16": median["prefill tokens/s"],
               "fp8": median.get("prefill + fp8 encode tokens/s", 0.0)}
    print("\n| run | tokens/s | GB/s | % of the lower ceiling |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| prefill ceiling (hooks, no copy, no write) | {median['prefill tokens/s']:,.0f} | "
          f"{median['prefill tokens/s'] * gb_per_token.get('bf16', 0.0):.2f} | |")
    if "fp8" in args.store:
        print(f"| prefill + fp8 encode ceiling (no copy, no write) | {compute['fp8']:,.0f} | "
              f"{compute['fp8'] * gb_per_token['fp8']:.2f} | |")
    for tag in args.writeback:
        disk = median[f"disk GB/s ({tag})"]
        print(f"| disk ceiling ({tag}, {args.writers} threads) | | {disk:.2f} | |")
        for store in args.store:
            ceiling_tps = min(compute[store], disk / gb_per_token[store])
            for mode in ("overlap", "serial"):
                name = f"worker {mode} ({tag}, {store})"
                tps = median[f"{name} tokens/s"]
                print(f"| {name} | {tps:,.0f} | {median[f'{name} GB/s']:.2f} | "
                      f"{100 * tps / ceiling_tps:.0f}% |")
    per_token = ", ".join(f"{store} {gb * 1e6:.1f} kB" for store, gb in gb_per_token.items())
    print(f"\nmedians of {args.repeats} repeats; per token: {per_token}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "median": median,
                                         "samples": len(samples), "tokens": tokens,
                                         "bytes_per_pass": {
                                             store: sum(file_sizes(samples, hidden, store))
                                             for store in args.store}}, indent=2))
    nvidia = shutil.which("nvidia-smi")
    if nvidia:
        print(subprocess.run([nvidia, "--query-gpu=name,memory.used,memory.total",
                              "--format=csv"], capture_output=True, text=True).stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
