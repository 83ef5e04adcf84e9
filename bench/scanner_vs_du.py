"""Benchmark: OutputScanner against ``du -sb`` on a large sharded output tree.

Builds (or reuses) ROOT with N small files in shards of 2,000 (``rows_0-2000/item_0.bin``
...), then times, in one run and on the same warm page cache:

* ``du -sb ROOT`` (median of 3): what a naive sampler pays every tick;
* the scanner's first full scan (once): what jobsup pays once per job or daemon start;
* its steady-state scan with nothing changed (median of 20): what it pays every tick;
* a scan after 32 new items land in the newest shard (temp file + rename, as a writer
  does; median of 10 rounds): what it pays on a tick with progress.

    python bench/scanner_vs_du.py [--files 1000000] [--root /tmp/jobsup-bench] [--keep]

Prints a markdown table; ``--doc FILE`` also writes it there (docs/benchmarks.md
holds the recorded results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe  # noqa: E402

from supervisor.runtime.dirwatch import DirWatcher  # noqa: E402
from supervisor.runtime.outputs import OutputScanner  # noqa: E402
from supervisor.runtime.outputs_state import ScanResult  # noqa: E402

MARKER = ".bench_tree.json"  # a dotfile: never an item, never counted by the scanner
PATTERN = "rows_*/*.bin"


def shard_name(first: int, per_dir: int) -> str:
    return f"rows_{first}-{first + per_dir}"


def build_tree(root: Path, files: int, per_dir: int) -> float:
    """Create ``files`` files of 0-4 bytes; returns seconds taken. Reuses a matching tree."""
    marker = root / MARKER
    wanted = {"files": files, "per_dir": per_dir}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        print(f"reusing tree at {root} ({files:,} files)")
        return 0.0
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    started = time.perf_counter()
    flags = os.O_CREAT | os.O_WRONLY | os.O_EXCL
    payloads = [b"x" * size for size in range(5)]
    for first in range(0, files, per_dir):
        shard = root / shard_name(first, per_dir)
        shard.mkdir()
        shard_fd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for index in range(first, min(first + per_dir, files)):
                fd = os.open(f"item_{index}.bin", flags, 0o644, dir_fd=shard_fd)
                payload = payloads[index % 5]
                if payload:
                    os.write(fd, payload)
                os.close(fd)
        finally:
            os.close(shard_fd)
        if first and first % 100_000 == 0:
            rate = first / (time.perf_counter() - started)
            print(f"  {first:,} files, {rate:,.0f} files/s", flush=True)
    marker.write_text(json.dumps(wanted))
    elapsed = time.perf_counter() - started
    print(f"created {files:,} files in {elapsed:.1f} s ({files / elapsed:,.0f} files/s)")
    return elapsed


def time_du(root: Path) -> tuple[float, int]:
    started = time.perf_counter()
    out = subprocess.run(["du", "-sb", str(root)], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, int(out.stdout.split()[0])


def time_scan(scanner: OutputScanner) -> tuple[float, ScanResult]:
    """One scan; a new scanner's first one walks and stats the whole tree."""
    started = time.perf_counter()
    result = scanner.scan(time.time())
    return time.perf_counter() - started, result


def add_items(shard: Path, start: int, count: int) -> None:
    """Write ``count`` items the way a careful worker does: temp file, then rename."""
    for index in range(start, start + count):
        temp = shard / f".item_{index}.bin.tmp"
        temp.write_bytes(b"y" * 4)
        os.rename(temp, shard / f"item_{index}.bin")


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def machine() -> str:
    return describe()


def filesystem(root: Path) -> str:
    out = subprocess.run(
        ["df", "--output=fstype", str(root)], capture_output=True, text=True, check=False
    )
    lines = out.stdout.split()
    return lines[-1] if len(lines) > 1 else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--per-dir", type=int, default=2000)
    parser.add_argument("--root", type=Path, default=Path("/tmp/jobsup-bench-tree"))
    parser.add_argument("--repeats", type=int, default=20, help="steady-state scans")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of 32 new items")
    parser.add_argument("--doc", type=Path, default=None,
                        help="also write the table to this markdown file")
    parser.add_argument("--keep", action="store_true", help="keep the tree for reuse")
    parser.add_argument("--append", action="store_true", help="append to --doc, not replace")
    args = parser.parse_args()

    settle_s = 10.0
    created_s = build_tree(args.root, args.files, args.per_dir)
    # A real job has a handful of files younger than settle_s; a fixture written at
    # ~50k files/s has a hundred thousand. Let them age, as they would in a real job.
    age_s = time.time() - max(p.stat().st_mtime for p in args.root.iterdir())
    if age_s < settle_s + 1:
        time.sleep(settle_s + 1 - age_s)

    du_runs = [time_du(args.root) for _ in range(3)]
    du_s = statistics.median(seconds for seconds, _ in du_runs)
    du_bytes = du_runs[0][1]

    newest = args.root / shard_name((args.files - 1) // args.per_dir * args.per_dir, args.per_dir)
    added = 0

    def measure(watcher: DirWatcher | None) -> tuple[tuple[float, ScanResult], ...]:
        """(first scan, median steady scan, median scan after 32 new items) of a new
        scanner, listing (`watcher` None) or watching the directories."""
        nonlocal added
        scanner = OutputScanner(str(args.root), PATTERN, settle_s=settle_s, watcher=watcher)
        first = time_scan(scanner)  # a new scanner: the full walk
        assert first[1].files == args.files + added, first
        steady = [time_scan(scanner) for _ in range(args.repeats)]
        grow: list[tuple[float, ScanResult]] = []
        for _ in range(args.rounds):
            add_items(newest, args.files + added, 32)
            added += 32
            grow.append(time_scan(scanner))
            assert grow[-1][1].files == args.files + added, grow[-1][1]
        scanner.close()
        return (first, (statistics.median(s for s, _ in steady), steady[-1][1]),
                (statistics.median(s for s, _ in grow), grow[len(grow) // 2][1]))

    (first_s, first), (steady_s, steady_last), (grow_s, grow_mid) = measure(None)
    watcher = DirWatcher()
    (w_first_s, w_first), (w_steady_s, w_steady), (w_grow_s, w_grow) = measure(watcher)
    watcher.close()

    def cost(result: ScanResult) -> str:
        return f"{result.dirs_statted} / {result.dirs_listed} / {result.files_statted}"

    def ratio(seconds: float) -> str:
        return f"{100 * seconds / du_s:.3f} %"

    rows = [
        ("`du -sb ROOT` (median of 3)", du_s, "-", "100 %"),
        ("scanner, first full scan (once)", first_s, cost(first), ratio(first_s)),
        (
            f"scanner, steady state, no change (median of {args.repeats})",
            steady_s,
            cost(steady_last),
            ratio(steady_s),
        ),
        (
            f"scanner, 32 new items in newest shard (median of {args.rounds})",
            grow_s,
            cost(grow_mid),
            ratio(grow_s),
        ),
        ("scanner with inotify watches, first full scan (once)", w_first_s, cost(w_first),
         ratio(w_first_s)),
        (f"scanner with inotify watches, steady state (median of {args.repeats})",
         w_steady_s, cost(w_steady), ratio(w_steady_s)),
        (f"scanner with inotify watches, 32 new items (median of {args.rounds})",
         w_grow_s, cost(w_grow), ratio(w_grow_s)),
    ]
    table = [
        "| measurement | wall time | dirs statted / listed / files statted | vs du |",
        "| --- | ---: | ---: | ---: |",
    ]
    table += [f"| {name} | {fmt_ms(secs)} | {c} | {r} |" for name, secs, c, r in rows]
    goal = "met" if steady_s / du_s < 0.01 else "NOT met"
    shards = -(-args.files // args.per_dir)
    created = f"{created_s:.1f} s" if created_s else "reused from an earlier run"
    text = "\n".join(
        [
            "## Output scanner vs `du` "
            f"({args.files:,} files, {shards:,} shards of {args.per_dir:,})",
            "",
            *table,
            "",
            f"Goal (steady-state scan under 1 % of `du`): **{goal}** "
            f"({100 * steady_s / du_s:.3f} %).",
            "",
            f"- Machine: {machine()}; tree on {filesystem(args.root)} "
            f"(`{args.root}`), warm page cache for every measurement.",
            f"- Tree: {args.files:,} files of 0-4 bytes in `rows_<a>-<b>/item_<i>.bin`, "
            f"created with an `os.open`/`os.write`/`os.close` loop in {created}. "
            f"`du` reported {du_bytes:,} bytes (files and directories); the scanner "
            f"{first.bytes:,} bytes in {first.files:,} items (files only).",
            f"- Method: `bench/scanner_vs_du.py --files {args.files}`, one process, "
            "in this order: `du -sb` 3 times; `OutputScanner(root, "
            f"'{PATTERN}').scan()` once (the first: a full walk); `scan()` "
            f"{args.repeats} times with "
            f"nothing changed; then {args.rounds} rounds of: 32 items written "
            "to the newest shard (temp file + rename), one `scan()`. Files were "
            f"older than `settle_s` = {settle_s:.0f} s before the first scan, as "
            "almost all files of a long job are.",
            "- Steady-state cost is one `stat` per directory; a tick with progress "
            "adds one re-listing of the shard that changed plus one `stat` per new "
            "(or still-growing) file. With inotify watches (the daemon's default on "
            "local filesystems, `supervisor/runtime/dirwatch.py`) the same scanner, "
            "new, then does the same rounds: no directory is statted or listed after "
            "the first walk, and a tick with progress costs the new files' stats.",
            "",
        ]
    )
    print()
    print(text)
    if args.doc is not None:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        previous = args.doc.read_text() + "\n" if args.append and args.doc.exists() else ""
        args.doc.write_text(previous + text)
        print(f"wrote {args.doc}")
    if args.keep:  # leave the tree as built, so that the next run can reuse it
        for index in range(args.files, args.files + args.rounds * 32):
            (newest / f"item_{index}.bin").unlink()
    else:
        shutil.rmtree(args.root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
