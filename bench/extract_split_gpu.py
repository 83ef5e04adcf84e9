"""Model-split extraction (`workers.extract --gpus-per-model K`) on a multi-GPU host,
side by side in one run with one GPU and with data parallelism:

1. speed: the 8B-class Llama of bench/extract_multi_gpu.py, 1,450-token samples, the
   real CLI with `--gpus 1`, `--gpus-per-model N` and `--gpus N`; tokens/s as the
   workers report them (model load excluded) and each device's peak memory;
2. correctness: every file of the split run against the one-GPU run (max |diff|,
   files bit-identical);
3. capacity: a ballast process leaves only `--free-gb` on each GPU, less than the
   model's weights: one GPU must fail, the split model must run.

`python bench/extract_split_gpu.py --work /tmp/split --samples 512`."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract_gpu import make_samples  # noqa: E402
from extract_multi_gpu import DONE_LINE, build, extract  # noqa: E402

BALLAST = """
import sys, time, torch
keep = float(sys.argv[1]) * 1e9
held = []
for i in range(torch.cuda.device_count()):
    free, _ = torch.cuda.mem_get_info(i)
    held.append(torch.empty(int(free - keep), dtype=torch.uint8, device=f"cuda:{i}"))
print("ready", flush=True)
time.sleep(3600)
"""


def rate_and_peaks(stderr: str) -> tuple[float, str]:
    rates = DONE_LINE.findall(stderr)
    peaks = re.findall(r"peak GPU memory: (.*)", stderr)
    return sum(map(float, rates)), "; ".join(peaks)


def timed_run(model: Path, data: Path, work: Path, label: str,
              options: list[str]) -> tuple[str, float, str, float]:
    """One CLI run into `work/<label>`: (label, tokens/s, peak memory, wall s incl. load)."""
    t0 = time.perf_counter()
    code, stderr = extract(model, data, work / label.replace(" ", "_"), *options)
    if code != 0:
        raise SystemExit(f"{label} failed:\n{stderr[-3000:]}")
    rate, peaks = rate_and_peaks(stderr)
    print(f"{label}: {rate:,.0f} tokens/s, peak {peaks}", flush=True)
    return label, rate, peaks, time.perf_counter() - t0


def print_runs(rows: list[tuple[str, float, str, float]]) -> None:
    """(label, tokens/s, peak memory, wall s) per run, the first the baseline."""
    print("\n| run | tokens/s | vs 1 GPU | peak memory per device | wall (load incl.) |")
    print("| --- | ---: | ---: | --- | ---: |")
    for label, rate, peaks, wall in rows:
        print(f"| {label} | {rate:,.0f} | {rate / rows[0][1]:.2f}x | {peaks} | {wall:.0f} s |")


def compare(a: Path, b: Path) -> tuple[int, int, float]:
    """(files compared, files bit-identical, max |difference| over all tensors)."""
    files = sorted(p.relative_to(a) for p in a.glob("rows_*/*.safetensors"))
    identical, worst = 0, 0.0
    for name in files:
        one, two = load_file(a / name), load_file(b / name)
        same = one.keys() == two.keys()
        for key in one:
            x, y = one[key], two[key]
            same = same and torch.equal(x, y)
            worst = max(worst, (x.double() - y.double()).abs().max().item())
        identical += same
    return len(files), identical, worst


def forward_ceiling(model_dir: Path, devices: list[str], samples: int) -> float:
    """Tokens/s of the worker's forward passes alone (capture, gather on the last
    device, finite check; no copies to the host, no files): what compute allows."""
    from workers.eagle3.extraction.extractor import Capture, Extractor, pack_batches
    from workers.extract import load_model

    target, _ = load_model(model_dir, device=",".join(devices), dtype=torch.bfloat16)
    extractor = Extractor(target, Path("/dev/null"), overlap=False)
    batch = make_samples(samples, 1450, target.vocab_size)
    batches = pack_batches(batch, extractor.batch_tokens)
    capture = Capture(extractor.base, extractor.layer_ids)
    with torch.inference_mode():
        for warm in batches[:2]:
            extractor._forward(warm, capture)
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for one in batches:
            extractor._forward(one, capture)
        for d in devices:
            torch.cuda.synchronize(d)
    capture.remove()
    extractor.writers.shutdown()
    return sum(len(s.input_ids) for s in batch) / (time.perf_counter() - t0)


def diagnose(model: Path, data: Path, work: Path, n: int, samples: int) -> None:
    """Where the split's time goes: compute alone, then the worker with more writers."""
    one = forward_ceiling(model, ["cuda:0"], samples)
    split = forward_ceiling(model, [f"cuda:{i}" for i in range(n)], samples)
    print(f"\nforward only: 1 GPU {one:,.0f} tokens/s, split over {n} {split:,.0f} "
          f"({split / one:.2f}x)", flush=True)
    code, stderr = extract(model, data, work / "diag", "--gpus-per-model", str(n),
                           "--writers", "8", "--queue-depth", "6")
    rate, peaks = rate_and_peaks(stderr)
    print(f"split worker, 8 writers, queue depth 6: exit {code}, {rate:,.0f} tokens/s",
          flush=True)
    shutil.rmtree(work / "diag", ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("/tmp/split"))
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--free-gb", type=float, default=13.0)
    parser.add_argument("--no-capacity", action="store_true",
                        help="skip the capacity check (ballast on each GPU)")
    parser.add_argument("--diagnose", action="store_true",
                        help="only: forward-only tokens/s, 1 GPU vs split, and the split "
                             "worker with more writers")
    args = parser.parse_args()
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit("needs at least 2 GPUs")
    model, data = build(args.work, args.samples)
    if args.diagnose:
        diagnose(model, data, args.work, n, args.samples)
        return 0
    print(f"{n} x {torch.cuda.get_device_name(0)}, {args.samples} samples", flush=True)
    runs = {"1 GPU": ["--gpus", "1"], f"split over {n}": ["--gpus-per-model", str(n)],
            f"data-parallel x{n}": ["--gpus", str(n)]}
    rows = []
    for label, options in runs.items():
        t0 = time.perf_counter()
        os.sync()  # each run starts with no dirty pages of the one before
        print(f"sync before {label}: {time.perf_counter() - t0:.1f} s", flush=True)
        rows.append(timed_run(model, data, args.work, label, options))
        if label.startswith("data-parallel"):  # not compared: free its disk space
            shutil.rmtree(args.work / label.replace(" ", "_"), ignore_errors=True)
    print_runs(rows)
    files, identical, worst = compare(args.work / "1_GPU", args.work / f"split_over_{n}")
    print(f"\nsplit vs 1 GPU: {files} files, {identical} bit-identical, max |diff| {worst:g}")
    for label, *_ in rows:
        shutil.rmtree(args.work / label.replace(" ", "_"), ignore_errors=True)

    if args.no_capacity:
        return 0
    ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(args.free_gb)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert ballast.stdout is not None and ballast.stdout.readline().strip() == "ready"
        print(f"\ncapacity: {args.free_gb:g} GB left free on each GPU (weights 16.1 GB)")
        for label, options in (("1 GPU", ["--gpus", "1"]),
                               (f"split over {n}", ["--gpus-per-model", str(n)])):
            code, stderr = extract(model, data, args.work / "capacity", *options,
                                   "--limit", "64", "--batch-tokens", "8192")
            oom = "out of memory" in stderr.lower()
            rate, peaks = rate_and_peaks(stderr)
            print(f"| {label} | exit {code} | {'CUDA OOM' if oom else 'no OOM'} | "
                  f"{rate:,.0f} tokens/s | peak {peaks or '-'} |", flush=True)
    finally:
        ballast.kill()
        ballast.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
