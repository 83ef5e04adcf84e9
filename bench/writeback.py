"""Writeback modes of the extraction worker's file writer, side by side in one run:
`--files` files of `--mb` MB written by `--writers` threads exactly as the worker
writes them (workers/eagle3/extraction/hidden_files.py `write_atomically`: temp + rename) in each
mode of WRITEBACK_MODES, `--repeats` times in rotating order, medians reported.

Measured per run:
- GB/s, the final `os.sync()` included (the disk must take the data in the end);
- peak Dirty + Writeback (/proc/meminfo, sampled every 50 ms): how far the kernel's
  dirty limits are approached (reaching them throttles the writers);
- peak page-cache growth ("Cached" above its value at the start) and what is left of
  it after the sync: how much of the machine's cache the run evicts.

Before each run the output is deleted, `sync`ed and, where allowed (root), the page
cache dropped. `python bench/writeback.py --out /data/bench-writeback` on the target
machine (the output must be on the disk the worker writes to, not tmpfs);
`--files 40 --mb 8` is a quick check. Prints a markdown table; `--json FILE` also
writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.eagle3.extraction.hidden_files import (  # noqa: E402
    WRITEBACK_MODES,
    Writeback,
    sample_path,
    write_atomically,
)

SAMPLE_INTERVAL_S = 0.05


def meminfo_kb() -> dict[str, int]:
    """/proc/meminfo in kB."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0])
    return values


class MemorySampler:
    """Peak Dirty + Writeback and peak Cached (kB) while it runs, every 50 ms."""

    def __init__(self) -> None:
        self.peak_dirty_kb = 0
        self.peak_cached_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        info = meminfo_kb()
        self.peak_dirty_kb = max(self.peak_dirty_kb, info["Dirty"] + info["Writeback"])
        self.peak_cached_kb = max(self.peak_cached_kb, info["Cached"])

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    with contextlib.suppress(OSError):  # a cold page cache where allowed (root)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_mode(out: Path, mode: str, blob: memoryview, files: int,
             writers: int) -> dict[str, float]:
    """One run of `files` files in `mode`; GB/s and page-cache figures in MB."""
    clean(out)
    cached_before_kb = meminfo_kb()["Cached"]
    policy = Writeback(mode, in_flight_files=writers)  # as the worker sets it

    def write(index: int) -> None:
        write_atomically(sample_path(out, index), [blob], writeback=policy)

    with MemorySampler() as sampler:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(write, range(files)))
        policy.close()
        os.sync()
        elapsed_s = time.perf_counter() - t0
    return {"gb_per_s": files * blob.nbytes / elapsed_s / 1e9, "seconds": elapsed_s,
            "peak_dirty_writeback_mb": sampler.peak_dirty_kb / 1024,
            "peak_cache_growth_mb": (sampler.peak_cached_kb - cached_before_kb) / 1024,
            "cache_left_mb": (meminfo_kb()["Cached"] - cached_before_kb) / 1024}


def filesystem(path: Path) -> str:
    result = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                            text=True)
    return result.stdout.strip() or "?"


def dirty_limits() -> str:
    vm = Path("/proc/sys/vm")
    parts = []
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes",
                 "dirty_background_bytes"):
        with contextlib.suppress(OSError):
            parts.append(f"{name}={(vm / name).read_text().strip()}")
    return " ".join(parts)


COLUMNS = [("gb_per_s", "GB/s (final sync incl.)", "{:.2f}"),
           ("peak_dirty_writeback_mb", "peak Dirty+Writeback MB", "{:,.0f}"),
           ("peak_cache_growth_mb", "peak page-cache growth MB", "{:,.0f}"),
           ("cache_left_mb", "page cache left MB", "{:,.0f}")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-writeback"))
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--mb", type=float, default=83.0, help="MB per file (default 83)")
    parser.add_argument("--writers", type=int, default=4, help="writer threads (default 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=WRITEBACK_MODES,
                        default=list(WRITEBACK_MODES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if min(args.files, args.writers, args.repeats) < 1 or args.mb <= 0:
        parser.error("--files, --writers, --repeats must be >= 1 and --mb > 0")

    blob = memoryview(os.urandom(int(args.mb * 1e6)))
    args.out.mkdir(parents=True, exist_ok=True)
    total_gb = args.files * blob.nbytes / 1e9
    print(f"{args.files} files x {blob.nbytes / 1e6:.1f} MB = {total_gb:.2f} GB per run, "
          f"{args.writers} writers, {args.repeats} repeats; {args.out} on "
          f"{filesystem(args.out)}; RAM {meminfo_kb()['MemTotal'] / 2**20:.1f} GiB; "
          f"{dirty_limits()}", flush=True)

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    for repeat in range(args.repeats):
        shift = repeat % len(args.modes)  # no mode always runs first
        for mode in args.modes[shift:] + args.modes[:shift]:
            result = run_mode(args.out, mode, blob, args.files, args.writers)
            runs[mode].append(result)
            print(json.dumps({"repeat": repeat, "mode": mode,
                              **{k: round(v, 3) for k, v in result.items()}}), flush=True)
    clean(args.out)

    median = {mode: {key: statistics.median(r[key] for r in results) for key in results[0]}
              for mode, results in runs.items()}
    print("\n| writeback | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    for mode, values in median.items():
        cells = " | ".join(fmt.format(values[key]) for key, _, fmt in COLUMNS)
        print(f"| {mode} | {cells} |")
    print(f"\nmedians of {args.repeats} repeats")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median": median,
                                         "files": args.files, "bytes_per_file": blob.nbytes,
                                         "writers": args.writers}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
