"""Progress reported by a job, from the best source available (DESIGN.md):
(1) the progress file a cooperating worker replaces atomically, (2) tqdm-style
`n/total` in the tail of its log, (3) files in its output directory (the scanner).

The progress file's format is defined once, in docs/progress-file.md; its writer is
`workers.common.ProgressReporter`, its reader `from_progress_file` here, and
tests/test_progress_contract.py runs the one against the other."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from supervisor.runtime.fileio import open_regular, read_at, read_json

DONE, TOTAL, UNIT, METRICS = "done", "total", "unit", "metrics"
"""The progress file's fields (docs/progress-file.md)."""
FIELDS = (DONE, TOTAL, UNIT, METRICS)
"""Every field the reader knows; any other key is ignored."""

PROGRESS_MAX_BYTES = 1 << 20
"""A progress file larger than this is malformed (a real one is under a KB)."""
LOG_TAIL_BYTES = 16 * 1024
"""How much of the log's end is searched for a progress bar."""

TQDM_RE = re.compile(rb"\|\s*(\d+)/(\d+|\?)\s*\[")
"""tqdm's default bar: ` 45%|####      | 450/1000 [00:10<00:12, 45.0it/s]`."""
PLAIN_RE = re.compile(rb"(?<![\d/.:-])(\d+)\s*/\s*(\d+)(?![\d/.:-])")
"""A bare `n/total` (`step 120/5000`), accepted only when n <= total, the word next to it
names a counter (`COUNTER_WORDS`) and no tqdm bar is in the window."""
COUNTER_WORDS = frozenset(
    b"step iter iteration it batch sample item epoch shard chunk file row record example "
    b"doc document sequence seq prompt update round part page image task".split())
"""Words that make a bare `n/total` a count: `step 40/100`, `Epoch [2/3]`, `[3/10] shards`.
Singular forms; a trailing `s` or `es` is dropped first. `rank 0/8`, `GPU 0/1` or a lone
`11/29` name no counter and are not progress."""
WORD_RE = re.compile(rb"[A-Za-z]+")
WORD_NEAR_BYTES = 32
"""How far from the numbers the counter word is looked for (a bounded slice: no regex
over a whole long line)."""
METRICS_MAX = 64
"""Metrics kept from one progress file (the first ones, in the file's order)."""
METRIC_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
"""A metric name: up to 64 characters, no spaces or control characters."""
UNIT_MAX_CHARS = 32
COUNT_MAX = 2**63 - 1
"""The largest count stored: SQLite's integers are signed 64-bit. A report beyond it is
no report (stored, it would fail the whole batch of samples, every job's)."""


@dataclass(frozen=True)
class Reported:
    items_done: int
    items_total: int | None
    unit: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def from_progress_file(path: str | os.PathLike[str]) -> Reported | None:
    """The worker's own report (`FIELDS`, docs/progress-file.md); None when the file is
    missing or malformed (a malformed file is ignored, never fatal): not a regular file,
    over PROGRESS_MAX_BYTES, not a JSON object, no `done`, or a count beyond COUNT_MAX."""
    data = read_json(path, max_bytes=PROGRESS_MAX_BYTES)  # never a FIFO or /dev/zero
    if not isinstance(data, dict):
        return None
    done, total = data.get(DONE), data.get(TOTAL)
    if not isinstance(done, int) or isinstance(done, bool) or not 0 <= done <= COUNT_MAX:
        return None
    if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
        total = None
    elif total > COUNT_MAX:
        return None
    metrics: dict[str, float] = {}
    raw_metrics = data.get(METRICS)
    if isinstance(raw_metrics, dict):
        for name, value in raw_metrics.items():
            if len(metrics) >= METRICS_MAX:
                break  # each name is a /metrics series: a job must not mint thousands
            if isinstance(name, str) and METRIC_NAME_RE.fullmatch(name) \
                    and isinstance(value, int | float) and not isinstance(value, bool) \
                    and math.isfinite(value):
                metrics[name] = float(value)
    unit = data.get(UNIT) if isinstance(data.get(UNIT), str) else None
    unit = unit[:UNIT_MAX_CHARS] if unit else unit
    return Reported(done, total, unit, metrics)


def from_log(path: str | os.PathLike[str]) -> Reported | None:
    """The last tqdm bar in the log's tail (a finished one only if no counted line
    follows it), else the last bare `n/total` that names a counter (`step 40/100`;
    never `rank 0/8 ready`). tqdm redraws
    with `\\r`, so the tail is split on both `\\r` and `\\n` and searched from the end.
    A line cut by the window's start is dropped: the end of `4500/5000` is not
    `500/5000`."""
    try:
        with open_regular(path) as (fd, size):  # never a FIFO, device, or past `size`
            start = max(0, size - LOG_TAIL_BYTES)
            first = max(0, start - 1)  # one byte more: is the window's first line whole?
            tail = read_at(fd, first, size - first)
    except OSError:
        return None
    lines = re.split(rb"[\r\n]", tail)
    if start > 0:
        lines = lines[1:]  # the cut line, or b"" when the byte before was a line break
    # the last tqdm bar with a storable count wins over every bare count, unless it is
    # finished (n == total: the checkpoint shards loaded) and a counted line came after
    # it (`step 40/1000` of the training that followed); else the last bare count next
    # to a counter word
    plain_found: Reported | None = None
    for line in reversed(lines):
        match = TQDM_RE.search(line)
        if match:
            done = _count(match.group(1))
            total = None if match.group(2) == b"?" else _count(match.group(2))
            if done is None or (total is None and match.group(2) != b"?"):
                continue  # beyond what can be stored: not a count
            if plain_found is not None and total is not None and done == total:
                return plain_found
            return Reported(done, total or None)
        if plain_found is None:
            plain_found = _plain_count(line)
    return plain_found


def _plain_count(line: bytes) -> Reported | None:
    """The line's last bare `n/total`, if it names a counter and n <= total."""
    plain = list(PLAIN_RE.finditer(line))
    if not plain:
        return None
    last = plain[-1]
    before = line[max(0, last.start() - WORD_NEAR_BYTES):last.start()].rstrip(b" \t:=#[(")
    after = line[last.end():last.end() + WORD_NEAR_BYTES].lstrip(b" \t])")
    word_before = WORD_RE.findall(before)
    if not ((word_before and before.endswith(word_before[-1]) and _is_counter(word_before[-1]))
            or ((word_after := WORD_RE.match(after)) and _is_counter(word_after.group()))):
        return None
    done, total = _count(last.group(1)), _count(last.group(2))
    if done is not None and total is not None and total > 0 and done <= total:
        return Reported(done, total)
    return None


def _is_counter(word: bytes) -> bool:
    word = word.lower()
    return any(form in COUNTER_WORDS for form in
               (word, word.removesuffix(b"s"), word.removesuffix(b"es")))


def _count(digits: bytes) -> int | None:
    """The number, or None beyond COUNT_MAX (checked on the digits first: int() of a
    line of 5000 digits raises)."""
    digits = digits.lstrip(b"0") or b"0"
    if len(digits) > len(str(COUNT_MAX)):
        return None
    value = int(digits)
    return value if value <= COUNT_MAX else None
