"""Progress from a worker's progress file and from the tail of its log, on real files.

What the log patterns accept (see `supervisor/observe/progress_file.py`):

* a tqdm bar, `|<spaces>N/TOTAL<spaces>[` or `|<spaces>N/?<spaces>[` (total unknown):
  taken as is, even when N > TOTAL (tqdm overshoots); TOTAL 0 means unknown;
* only when no such bar is in the window: the last bare `N/TOTAL` of a line
  (`step 120/5000`, `[3 / 10] shards`), accepted only when the word right before or
  after it names a counter (`COUNTER_WORDS`: step, iter, batch, sample, item, epoch,
  shard, file, ...; plurals too), 0 < TOTAL and N <= TOTAL. Neither number may touch a
  digit, `/`, `.`, `:` or `-`, so `2026/11/29`, `12:00/30`, `0.5/1.5`, `10.0.0.0/24`,
  `a/1/2/b` are rejected; a rejected last match makes the line count as having none;
  `rank 0/8 ready`, `GPU 0/1` and a day/month `11/29` name no counter and are not read;
* lines are split on `\\r` and `\\n` and searched from the end of the last
  `LOG_TAIL_BYTES`; the first, possibly cut, line of that window is not used.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.observe.progress_file import (
    LOG_TAIL_BYTES,
    LogReader,
    ProgressFileReader,
    Reported,
    from_log,
    from_progress_file,
)
from supervisor.runtime.fileio import atomic_write_json

pytestmark = pytest.mark.timeout(10)


# -- the progress file ----------------------------------------------------------------------

def write_raw(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_progress_file(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    atomic_write_json(path, {"done": 450, "total": 1000, "unit": "rows",
                             "metrics": {"loss": 0.25, "tokens": 12}})
    assert from_progress_file(path) == Reported(450, 1000, "rows",
                                                {"loss": 0.25, "tokens": 12.0})


def test_minimal_progress_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "p.json", '{"done": 0}')
    assert from_progress_file(path) == Reported(0, None, None, {})


@pytest.mark.parametrize(
    "text",
    [
        '{"done": 450, "total": 10',  # torn: a writer that does not rename atomically
        "",
        "not json",
        "[450, 1000]",
        '"450/1000"',
        "null",
        '{"total": 1000}',  # no done
        '{"done": -1, "total": 1000}',
        '{"done": true, "total": 1000}',  # a bool is not a count
        '{"done": 4.5e2, "total": 1000}',  # a float is not a count, even a whole one
        '{"done": "450", "total": 1000}',
        '{"done": null}',
    ],
)
def test_unusable_progress_file_is_none(tmp_path: Path, text: str) -> None:
    assert from_progress_file(write_raw(tmp_path / "p.json", text)) is None


def test_missing_progress_file_is_none(tmp_path: Path) -> None:
    assert from_progress_file(tmp_path / "nope.json") is None
    assert from_progress_file(tmp_path) is None  # a directory


@pytest.mark.parametrize("total", ["null", "0", "-5", "true", "false", '"1000"', "12.5", "[]"])
def test_unusable_total_means_unknown(tmp_path: Path, total: str) -> None:
    path = write_raw(tmp_path / "p.json", f'{{"done": 7, "total": {total}}}')
    assert from_progress_file(path) == Reported(7, None)


def test_metrics_keep_finite_numbers_only(tmp_path: Path) -> None:
    # Python's json writes and reads NaN / Infinity; they must not reach the store
    text = json.dumps({"done": 3, "metrics": {
        "loss": 0.5, "step": 3, "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
        "huge": 1e400, "flag": True, "name": "x", "none": None, "list": [1], "nested": {"a": 1},
    }})
    assert "NaN" in text and "Infinity" in text
    reported = from_progress_file(write_raw(tmp_path / "p.json", text))
    assert reported is not None
    assert reported.metrics == {"loss": 0.5, "step": 3.0}
    assert all(type(value) is float for value in reported.metrics.values())


@pytest.mark.parametrize("metrics", ["[1, 2]", '"loss=0.5"', "3", "null"])
def test_metrics_that_are_not_an_object_are_ignored(tmp_path: Path, metrics: str) -> None:
    path = write_raw(tmp_path / "p.json", f'{{"done": 3, "metrics": {metrics}}}')
    assert from_progress_file(path) == Reported(3, None, None, {})


def test_unit_must_be_a_string(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "p.json", '{"done": 3, "total": 9, "unit": 5}')
    assert from_progress_file(path) == Reported(3, 9, None)


# -- the log --------------------------------------------------------------------------------

def bar(done: int, total: int | str, width: int = 10) -> bytes:
    """One tqdm redraw, as tqdm writes it to a non-tty: `\\r` before each refresh."""
    if total == "?":
        return f"\r{done}it [00:10, 45.00it/s]".encode()
    assert isinstance(total, int)
    percent = done * 100 // total
    filled = "#" * (done * width // total)
    return (f"\r{percent:3d}%|{filled:<{width}}| {done}/{total} "
            f"[00:10<00:12, 45.00it/s]").encode()


def write_log(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_tqdm_redraws_take_the_last(tmp_path: Path) -> None:
    data = (b"loading model\nLoading checkpoint shards: 100%|##########| 4/4 [00:03<00:00]\n"
            + b"".join(bar(n, 1000) for n in range(0, 461, 10)))
    assert bar(450, 1000) == b"\r 45%|####      | 450/1000 [00:10<00:12, 45.00it/s]"
    assert from_log(write_log(tmp_path / "log", data)) == Reported(460, 1000)


def test_tqdm_bar_exactly_as_in_the_docs(tmp_path: Path) -> None:
    data = (b" 45%|####5     | 450/1000 [00:10<00:12, 45.00it/s]"
            b"\r 46%|####6     | 460/1000 [00:10<00:12, 45.10it/s]")
    assert from_log(write_log(tmp_path / "log", data)) == Reported(460, 1000)


def test_tqdm_bar_with_description_and_postfix(tmp_path: Path) -> None:
    # the description and the postfix hold n/total-like text; the bar's own count wins
    data = b"\repoch 2/3:  46%|####6     | 460/1000 [00:10<00:12, 45.1it/s, shard=7/9]\n"
    assert from_log(write_log(tmp_path / "log", data)) == Reported(460, 1000)


def test_tqdm_unknown_total(tmp_path: Path) -> None:
    # custom bar_format with total_fmt when tqdm has no total
    data = b"\r|          | 450/? [00:10<?, 45.00it/s]"
    assert from_log(write_log(tmp_path / "log", data)) == Reported(450, None)


def test_tqdm_total_zero_is_unknown_and_overshoot_is_kept(tmp_path: Path) -> None:
    assert from_log(write_log(tmp_path / "a", b"\r|| 5/0 [00:01]")) == Reported(5, None)
    assert from_log(write_log(tmp_path / "b", b"\r|##| 1005/1000 [00:01]")) \
        == Reported(1005, 1000)


def test_tqdm_without_total_has_no_count_to_read(tmp_path: Path) -> None:
    # tqdm's default for an unknown total is `450it [...]`: no n/total, nothing read
    data = b"".join(bar(n, "?") for n in (10, 20, 450))
    assert from_log(write_log(tmp_path / "log", data)) is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"step 120/5000 loss=0.31", Reported(120, 5000)),
        (b"[rank0] epoch 1/3 step 120/5000", Reported(120, 5000)),  # the last one wins
        (b"2026/11/29 14:02:11 step 120 / 5000", Reported(120, 5000)),
        (b"[3/10] shards written", Reported(3, 10)),
        (b"step 5000/5000 done", Reported(5000, 5000)),
        (b"step 0/5000", Reported(0, 5000)),
    ],
)
def test_plain_counts(tmp_path: Path, line: bytes, expected: Reported) -> None:
    assert from_log(write_log(tmp_path / "log", b"starting\n" + line + b"\n")) == expected


@pytest.mark.parametrize(
    "line",
    [
        b"2026/11/29 14:02:11 INFO loading",  # a date, year first
        b"[11/29/2026 14:02:11] INFO loading",  # a date, year last
        b"ratio 1/0",  # zero total
        b"found 12/3 duplicates",  # more done than total
        b"lr 0.5/1.5",  # decimals
        b"listening on 10.0.0.0/24",  # CIDR
        b"saved to /data/shard_3/10/x.bin",  # a path
        b"eta 12:00/30",  # a clock
        b"range 3-4/10",
        b"nothing to see here",
        b"",
    ],
)
def test_not_a_count(tmp_path: Path, line: bytes) -> None:
    assert from_log(write_log(tmp_path / "log", line + b"\n")) is None


@pytest.mark.parametrize("line", [b"11/29 job started", b"rank 0/8 ready", b"GPU 0/1",
                                  b"[rank 3/8] init done", b"node 2/4 joined", b"ratio 1/3"])
def test_bare_count_without_a_counter_word_is_not_progress(tmp_path: Path,
                                                           line: bytes) -> None:
    assert from_log(write_log(tmp_path / "log", b"starting\n" + line + b"\n")) is None


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"Epoch [2/3]", Reported(2, 3)),
        (b"batches: 4/10", Reported(4, 10)),
        (b"processed 3/10 files", Reported(3, 10)),
        (b"Iteration=7/9 lr=3e-4", Reported(7, 9)),
        (b"samples 12/64 written", Reported(12, 64)),
    ],
)
def test_counter_word_before_or_after(tmp_path: Path, line: bytes, expected: Reported) -> None:
    assert from_log(write_log(tmp_path / "log", line + b"\n")) == expected


def test_rank_ready_after_a_finished_bar_is_not_progress(tmp_path: Path) -> None:
    """The issue's case: a finished tqdm bar (redrawn with `\\r`), then a torch.distributed
    banner. The bar is the progress, not `rank 0/8`: 0/8 would read as a restart."""
    data = (b"Loading checkpoint shards:   0%|          | 0/8 [00:00<?, ?it/s]"
            + b"".join(b"\rLoading checkpoint shards: %3d%%|%-10s| %d/8 [00:%02d<00:00]"
                       % (n * 100 // 8, b"#" * (n * 10 // 8), n, n) for n in range(1, 9))
            + b"\nrank 0/8 ready\nrank 1/8 ready\n")
    assert from_log(write_log(tmp_path / "log", data)) == Reported(8, 8)
    # and without the bar, the banner alone is no progress either
    assert from_log(write_log(tmp_path / "b", b"rank 0/8 ready\nrank 1/8 ready\n")) is None


def test_step_lines_are_progress_without_a_bar(tmp_path: Path) -> None:
    data = b"".join(b"step %d/100 loss=%.1f\n" % (n, 2.0 - n / 100) for n in range(0, 41, 10))
    assert data.endswith(b"step 40/100 loss=1.6\n")
    log = b"[rank0] init\nrank 0/8 ready\n" + data.replace(b"1.6", b"1.2")
    assert from_log(write_log(tmp_path / "log", log)) == Reported(40, 100)


def test_a_bar_in_the_window_wins_over_later_step_lines(tmp_path: Path) -> None:
    """A bare count never overrides a tqdm bar seen in the same window, even a later one:
    the step lines come back once the bar has scrolled out of the window."""
    data = b"".join(bar(n, 1000) for n in range(0, 461, 10)) + b"\nstep 40/100 loss=1.2\n"
    assert from_log(write_log(tmp_path / "log", data)) == Reported(460, 1000)
    noise = b"".join(b"step %d/100 loss=1.2\n" % (n % 100) for n in range(1000))
    assert len(noise) > LOG_TAIL_BYTES
    assert from_log(write_log(tmp_path / "b", data + noise)) == Reported(99, 100)


def test_counted_lines_after_a_finished_bar_are_the_progress(tmp_path: Path) -> None:
    """A finished bar (checkpoint shards 8/8) is over: the training steps logged after it
    are the progress, while `rank 0/8 ready` still is not."""
    data = (bar(8, 8) + b"\nrank 0/8 ready\n"
            + b"".join(b"step %d/1000 loss=2.0\n" % n for n in range(1, 41)))
    assert from_log(write_log(tmp_path / "log", data)) == Reported(40, 1000)
    assert from_log(write_log(tmp_path / "b", bar(8, 8) + b"\nrank 0/8 ready\n")) \
        == Reported(8, 8)


def test_rejected_line_falls_back_to_an_earlier_line(tmp_path: Path) -> None:
    data = b"step 40/100\nratio 1/0\n2026/11/29 12:00:00 saved\n"
    assert from_log(write_log(tmp_path / "log", data)) == Reported(40, 100)


def test_tqdm_after_plain_and_plain_after_tqdm(tmp_path: Path) -> None:
    assert from_log(write_log(tmp_path / "a", b"step 1/9\n" + bar(460, 1000) + b"\n")) \
        == Reported(460, 1000)
    # the bar in the window wins (test_a_bar_in_the_window_wins_over_later_step_lines)
    assert from_log(write_log(tmp_path / "b", bar(460, 1000) + b"\nstep 2/9\n")) \
        == Reported(460, 1000)


def test_missing_and_empty_log(tmp_path: Path) -> None:
    assert from_log(tmp_path / "missing.log") is None
    assert from_log(write_log(tmp_path / "empty.log", b"")) is None
    assert from_log(tmp_path) is None  # a directory


def test_log_larger_than_the_tail_window(tmp_path: Path) -> None:
    head = b"".join(bar(n, 10**6) for n in range(0, 200_000, 7))  # ~1.4 MB of redraws
    assert len(head) > 50 * LOG_TAIL_BYTES
    data = head + bar(200_000, 10**6) + b"\n"
    assert from_log(write_log(tmp_path / "a", data)) == Reported(200_000, 10**6)


def test_bar_older_than_the_tail_window_is_not_found(tmp_path: Path) -> None:
    noise = b"".join(b"warning: something unremarkable happened %d\n" % i for i in range(2000))
    assert len(noise) > LOG_TAIL_BYTES
    data = bar(450, 1000) + b"\n" + noise
    assert from_log(write_log(tmp_path / "log", data)) is None


@pytest.mark.parametrize("cut", [1, 2, 3])
@pytest.mark.parametrize("line", [b"step 4500/5000", b"\r 90%|######### | 4500/5000 [00:10<00:01]"])
def test_line_cut_by_the_tail_window_is_not_misread(tmp_path: Path, line: bytes,
                                                    cut: int) -> None:
    """The window may start inside `4500/5000`; what is left of it (`500/5000`, `00/5000`,
    `0/5000`) must not be read as the count."""
    window_start = line.index(b"4500") + cut
    body_len = window_start + LOG_TAIL_BYTES - len(line) - 1
    body = (b"x" * 63 + b"\n") * (body_len // 64) + b"z" * (body_len % 64)
    data = line + b"\n" + body
    assert len(data) - LOG_TAIL_BYTES == window_start
    assert data[window_start:].startswith(b"4500"[cut:] + b"/5000")
    assert from_log(write_log(tmp_path / "log", data)) is None


def test_window_starting_at_a_line_start_keeps_that_line(tmp_path: Path) -> None:
    """Only a cut line is dropped: a window that starts at a whole line is searched whole,
    with the bytes before it ending in a newline."""
    line = b"step 4500/5000\n"
    body_len = LOG_TAIL_BYTES - len(line)
    data = b"head\n" + line + (b"x" * 63 + b"\n") * (body_len // 64) + b"z" * (body_len % 64)
    assert len(data) - LOG_TAIL_BYTES == len(b"head\n")
    assert from_log(write_log(tmp_path / "log", data)) == Reported(4500, 5000)


OPENED: list[str] = []
"""Paths `os.open`ed while a test listens (`opens_of`): Python's audit events, real."""
_LISTENING: list[bool] = []


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _LISTENING and event == "open" and isinstance(args[0], str | Path):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)  # (a hook cannot be removed: it records only while listening)


def opens_of(path: Path, read: Callable[[], object]) -> tuple[object, int]:
    """What `read()` answers, and how many times it opened `path`."""
    OPENED.clear()
    _LISTENING.append(True)
    try:
        answer = read()
    finally:
        _LISTENING.clear()
    return answer, OPENED.count(str(path))


def test_a_log_unchanged_since_the_last_read_is_not_opened_again(tmp_path: Path) -> None:
    """Most jobs' logs do not change from one tick to the next: `LogReader` answers from
    its last read after one stat (#30: an open, two fstats, a read and a close per job
    per tick before); any change (an append, a rewrite, a replacement) is read."""
    path = tmp_path / "output.log"
    path.write_bytes(b"step 3/10\n")
    reader = LogReader()
    assert opens_of(path, lambda: reader.read(path)) == (Reported(3, 10), 1)
    assert opens_of(path, lambda: reader.read(path)) == (Reported(3, 10), 0)
    with path.open("ab") as handle:
        handle.write(b"step 4/10\n")
    assert opens_of(path, lambda: reader.read(path)) == (Reported(4, 10), 1)
    replaced = tmp_path / "new.log"
    replaced.write_bytes(b"step 9/10\n")  # same size, another file
    replaced.replace(path)
    assert opens_of(path, lambda: reader.read(path)) == (Reported(9, 10), 1)
    assert opens_of(path, lambda: reader.read(path)) == (Reported(9, 10), 0)
    path.unlink()
    assert opens_of(path, lambda: reader.read(path)) == (None, 0)


def test_a_progress_file_unchanged_since_the_last_read_is_not_opened_again(
        tmp_path: Path) -> None:
    """As the log: the progress file is opened only when it changed (a worker replaces
    it: a new file), and a missing one is looked at, not opened (#30)."""
    path = tmp_path / "progress.json"
    reader = ProgressFileReader()
    assert opens_of(path, lambda: reader.read(path)) == (None, 0)
    atomic_write_json(path, {"done": 3, "total": 10, "unit": "items", "metrics": {}})
    assert opens_of(path, lambda: reader.read(path)) == (Reported(3, 10, "items"), 1)
    assert opens_of(path, lambda: reader.read(path)) == (Reported(3, 10, "items"), 0)
    atomic_write_json(path, {"done": 4, "total": 10, "unit": "items", "metrics": {}})
    assert opens_of(path, lambda: reader.read(path)) == (Reported(4, 10, "items"), 1)
    time.sleep(0.02)  # (past the kernel's coarse file times: same size, another mtime)
    path.write_text('{"done": 5, "total": 10, "unit": "items", "metrics": {}}')  # in place
    assert opens_of(path, lambda: reader.read(path)) == (Reported(5, 10, "items"), 1)
    path.unlink()
    assert opens_of(path, lambda: reader.read(path)) == (None, 0)


def test_a_log_followed_tick_after_tick_reads_as_a_fresh_look(tmp_path: Path) -> None:
    """`LogReader` parses only what was appended; after every append (whole lines, a line
    cut in the middle, tqdm redraws with no newline, more than the window at once) and
    after the log is cut or replaced, it answers what a fresh `from_log` answers."""
    rng = random.Random(15)
    pieces = [b"step %d/500\n", b"wrote item_%d.txt\n", b"rank 0/8 ready %d\n",
              b"\r 40%%|####      | %d/100 [00:01<00:02]", b"\rshards: 100%%|#| 4/4 [00:%02d]\n",
              b"epoch [%d/90]", b"\n", b"x" * 300 + b" %d\n", b"| 99999999999999999999999/5 [%d",
              b"\r|##| 7/7 [00:%02d]"]
    path = tmp_path / "output.log"
    path.write_bytes(b"")
    reader = LogReader()
    reads = largest = 0
    for round_ in range(400):
        if round_ % 97 == 96:  # rotated: a new file under the name
            path.unlink()
            path.write_bytes(b"fresh start\n")
        elif round_ % 131 == 130:  # cut in place
            path.write_bytes(path.read_bytes()[: rng.randint(0, 100)])
        elif round_ % 61 == 60:  # cut in place and grown again past the last read
            kept = path.read_bytes()[: rng.randint(0, 100)]
            path.write_bytes(kept + b"epoch [3/9] " + b"x" * path.stat().st_size)
        else:
            count = 500 if round_ % 50 == 25 else rng.choice([1, 1, 2, 5, 3])  # 500: ~20 KiB
            with path.open("ab") as handle:
                for _ in range(count):
                    piece = rng.choice(pieces)
                    handle.write(piece % rng.randint(0, 120) if b"%" in piece else piece)
        assert reader.read(path) == from_log(path), (round_, path.read_bytes()[-300:])
        reads += 1
        largest = max(largest, path.stat().st_size)
    assert largest > LOG_TAIL_BYTES  # the window was left behind
    assert reads == 400
