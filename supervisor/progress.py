"""Progress reported by a job, from the best source available (DESIGN.md):
(1) the progress file a cooperating worker replaces atomically, (2) tqdm-style
`n/total` in the tail of its log, (3) files in its output directory (the scanner)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from supervisor.fileio import read_json

LOG_TAIL_BYTES = 16 * 1024
"""How much of the log's end is searched for a progress bar."""

TQDM_RE = re.compile(rb"\|\s*(\d+)/(\d+|\?)\s*\[")
"""tqdm's default bar: ` 45%|####      | 450/1000 [00:10<00:12, 45.0it/s]`."""
PLAIN_RE = re.compile(rb"(?<![\d/.:-])(\d+)\s*/\s*(\d+)(?![\d/.:-])")
"""A bare `n/total` (`step 120/5000`), accepted only when n <= total."""


@dataclass(frozen=True)
class Reported:
    items_done: int
    items_total: int | None
    unit: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def from_progress_file(path: str | os.PathLike[str]) -> Reported | None:
    """The worker's own report: `{"done", "total", "unit", "metrics"}`; None when the
    file is missing or malformed (a malformed file is ignored, never fatal)."""
    data = read_json(path)
    if not isinstance(data, dict):
        return None
    done, total = data.get("done"), data.get("total")
    if not isinstance(done, int) or isinstance(done, bool) or done < 0:
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        total = None
    metrics: dict[str, float] = {}
    raw_metrics = data.get("metrics")
    if isinstance(raw_metrics, dict):
        for name, value in raw_metrics.items():
            if isinstance(name, str) and isinstance(value, int | float) \
                    and not isinstance(value, bool) and math.isfinite(value):
                metrics[name] = float(value)
    unit = data.get("unit") if isinstance(data.get("unit"), str) else None
    return Reported(done, total, unit, metrics)


def from_log(path: str | os.PathLike[str]) -> Reported | None:
    """The last progress bar (or `n/total`) in the log's tail. tqdm redraws with `\\r`,
    so the tail is split on both `\\r` and `\\n` and searched from the end. A line cut
    by the window's start is dropped: the end of `4500/5000` is not `500/5000`."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - LOG_TAIL_BYTES)
            f.seek(max(0, start - 1))  # one byte more: is the window's first line whole?
            tail = f.read()
    except OSError:
        return None
    lines = re.split(rb"[\r\n]", tail)
    if start > 0:
        lines = lines[1:]  # the cut line, or b"" when the byte before was a line break
    for line in reversed(lines):
        match = TQDM_RE.search(line)
        if match:
            total = None if match.group(2) == b"?" else int(match.group(2))
            return Reported(int(match.group(1)), total or None)
        plain = list(PLAIN_RE.finditer(line))
        if plain:
            done, total = int(plain[-1].group(1)), int(plain[-1].group(2))
            if total > 0 and done <= total:
                return Reported(done, total)
    return None
