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
import stat
from collections.abc import Callable
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

LINE_BREAK_RE = re.compile(rb"[\r\n]")
"""tqdm redraws its bar after a `\\r`: both end a line."""
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


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
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


class ProgressFileReader:
    """`from_progress_file` for one job's progress file, read again every tick: a file
    unchanged since the last read (its device, inode, size, mtime and ctime: a worker
    replaces it with a new file) gives the last answer without being opened, and a
    missing one costs one stat (#30: most jobs have none, or one that changes every few
    seconds, and the tick reads each one's every 2 s)."""

    def __init__(self) -> None:
        self._last = LastAnswer()

    def read(self, path: str | os.PathLike[str]) -> Reported | None:
        return self._last.read(path, from_progress_file)


class LastAnswer:
    """A reader's last answer from a regular file, given again while the file's
    (device, inode, size, mtime, ctime) are unchanged, so the file is not opened; a
    missing file costs one stat and answers None."""

    def __init__(self) -> None:
        self._seen: tuple[int, int, int, int, int] | None = None
        self._answer: Reported | None = None

    def read(self, path: str | os.PathLike[str],
             read: Callable[[str | os.PathLike[str]], Reported | None]) -> Reported | None:
        try:
            info = os.stat(path)
        except OSError:
            return None
        seen = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if seen == self._seen:
            return self._answer
        answer = read(path)
        self._seen = seen if stat.S_ISREG(info.st_mode) else None
        self._answer = answer
        return answer


def from_log(path: str | os.PathLike[str]) -> Reported | None:
    """The last tqdm bar in the log's tail (a finished one only if no counted line
    follows it), else the last bare `n/total` that names a counter (`step 40/100`;
    never `rank 0/8 ready`). tqdm redraws with `\\r`, so the tail is split on both
    `\\r` and `\\n`. A line cut by the window's start is dropped: the end of
    `4500/5000` is not `500/5000`. One look; `LogReader` follows a log tick after tick."""
    return LogReader().read(path)


class LogReader:
    """`from_log` for one job's log, read again every tick: only what was appended
    since the last read is parsed (a log of bare lines meant searching all 16 KiB of
    the tail, ~800 lines, every tick: #15). The lines are folded front to back: a
    valid tqdm bar replaces the bar and clears the count after it; a counted line
    replaces the count. The answer equals `from_log`'s on the same window: the log
    is read whole again when it was replaced or cut (shorter than what was read, or no
    line break where the last read ended), when more than the window was appended, or
    when the bar or count kept has left the window."""

    def __init__(self) -> None:
        self._reset(None)
        self._last = LastAnswer()
        """A log that has not changed since the last read gives the same answer without
        being opened (#30: most jobs' logs, most ticks)."""

    def _reset(self, inode: int | None) -> None:
        self._inode = inode
        self._consumed = 0  # offset after the last line break folded in
        self._bar: Reported | None = None  # the last valid tqdm bar
        self._bar_finished = False
        self._bar_at = -1  # offset of its line
        self._plain: Reported | None = None  # the last counted line after that bar
        self._plain_at = -1

    def read(self, path: str | os.PathLike[str]) -> Reported | None:
        return self._last.read(path, self._read)

    def _read(self, path: str | os.PathLike[str]) -> Reported | None:
        try:
            with open_regular(path) as (fd, size):  # never a FIFO, device, or past `size`
                inode = os.fstat(fd).st_ino
                window = max(0, size - LOG_TAIL_BYTES)
                base, data = 0, None
                if (inode == self._inode and window <= self._consumed <= size
                        and not 0 <= self._bar_at < window
                        and not 0 <= self._plain_at < window):
                    # what was appended, read with the byte before it: a line break
                    # there, or the log was cut and grew again (copytruncate)
                    start = max(0, self._consumed - 1)
                    appended = read_at(fd, start, size - start)
                    if self._consumed == 0:
                        data = appended
                    elif appended[:1] in (b"\n", b"\r"):
                        base, data = self._consumed, appended[1:]
                if data is None:
                    self._reset(inode)
                    first = max(0, window - 1)  # one byte more: is the first line whole?
                    base, data = first, read_at(fd, first, size - first)
                    if window > 0:  # drop the cut line (b"" if the byte before is a break)
                        cut = _first_break(data)
                        if cut < 0:  # one cut line all through: nothing whole yet
                            return None
                        base, data = first + cut + 1, data[cut + 1:]
        except OSError:
            return None
        end = _last_break(data)
        if end >= 0:
            at = base
            for line in LINE_BREAK_RE.split(data[:end]):
                self._fold(line, at)
                at += len(line) + 1
            self._consumed = base + end + 1
        bar, finished, plain = self._bar, self._bar_finished, self._plain
        partial = data[end + 1:]  # a line still being written (tqdm's redraws): not kept
        if partial:
            kind, found, done_all = _classify(partial)
            if kind == "bar":
                bar, finished, plain = found, done_all, None
            elif found is not None:
                plain = found
        if bar is not None and not (plain is not None and finished):
            return bar
        return plain

    def _fold(self, line: bytes, at: int) -> None:
        kind, found, finished = _classify(line)
        if kind == "bar":
            self._bar, self._bar_finished, self._bar_at = found, finished, at
            self._plain, self._plain_at = None, -1
        elif found is not None:
            self._plain, self._plain_at = found, at


def _first_break(data: bytes) -> int:
    found = [index for index in (data.find(b"\n"), data.find(b"\r")) if index >= 0]
    return min(found, default=-1)


def _last_break(data: bytes) -> int:
    return max(data.rfind(b"\n"), data.rfind(b"\r"))


def _classify(line: bytes) -> tuple[str, Reported | None, bool]:
    """("bar", the bar, whether n == total) for a tqdm bar with a storable count;
    ("skip", None, False) for a bar whose count cannot be stored (not a count either);
    ("plain", the line's bare count or None, False) for any other line."""
    if b"/" not in line:  # neither a bar nor a count: most lines of most logs
        return "plain", None, False
    match = TQDM_RE.search(line)
    if match:
        done = _count(match.group(1))
        total = None if match.group(2) == b"?" else _count(match.group(2))
        if done is None or (total is None and match.group(2) != b"?"):
            return "skip", None, False  # beyond what can be stored: not a count
        return "bar", Reported(done, total or None), total is not None and done == total
    return "plain", _plain_count(line), False


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
