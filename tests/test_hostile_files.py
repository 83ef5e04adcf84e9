"""The daemon never blocks on, or reads without bound from, a file a job controls.

A job owns its progress file ($JOBSUP_PROGRESS_FILE) and, in practice, its log (it finds
the path through /proc/self/fd/1, can unlink it and put anything there). The daemon reads
both on every tick, on every failure and for `GET /jobs/ID/logs`. A FIFO there used to
block the engine thread for good (while /healthz went on answering 200), /dev/zero was
read until MemoryError, and a log without newlines (tqdm's \\r redraws) was read whole.

The first part tests the helpers in `supervisor/runtime/fileio.py` and
`supervisor/observe/progress_file.py` on real files; the second runs real daemons and real
jobs that do these things.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.observe.progress_file import COUNT_MAX, Reported, from_log, from_progress_file
from supervisor.runtime.fileio import (
    JSON_MAX_BYTES,
    TAIL_LINE_MAX_BYTES,
    TAIL_MAX_BYTES,
    NotRegularFile,
    open_regular,
    read_from,
    read_json,
    tail_lines,
)
from tests.helpers import Daemon, job_module, python_job, wait_for

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """`call()`'s result, failing the test (not hanging it) if it takes longer than
    `seconds`: the call runs in a thread, which a blocked open leaves behind."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    assert result, "raised (see the thread's traceback above)"
    return result[0]


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    """A FIFO nobody writes to; afterwards a writer opens it, so that a reader the test
    left blocked on it (the bug) gets EOF and its thread ends."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    yield path
    with contextlib.suppress(OSError):  # ENXIO: no reader blocked on it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def unix_socket(tmp_path: Path) -> Iterator[Path]:
    cwd = os.getcwd()
    os.chdir(tmp_path)  # bind a short relative name: AF_UNIX paths are limited to 108 bytes
    try:
        server = socket.socket(socket.AF_UNIX)
        server.bind("sock")
    finally:
        os.chdir(cwd)
    server.listen()
    yield tmp_path / "sock"
    server.close()


# -- open_regular -------------------------------------------------------------------------

def test_open_regular_refuses_a_fifo_without_blocking(fifo: Path) -> None:
    def attempt() -> type[BaseException] | None:
        try:
            with open_regular(fifo):
                return None
        except OSError as exc:
            return type(exc)

    assert within(2, attempt) is NotRegularFile


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/null", "."])
def test_open_regular_refuses_devices_and_directories(tmp_path: Path, target: str) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path if target == "." else Path(target))
    with pytest.raises(NotRegularFile), open_regular(link):
        pass


def test_open_regular_refuses_a_socket(unix_socket: Path) -> None:
    with pytest.raises(NotRegularFile), open_regular(unix_socket):
        pass


def test_open_regular_follows_a_symlink_to_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"12345")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with open_regular(tmp_path / "link") as (fd, size):
        assert size == 5
        assert os.pread(fd, 10, 0) == b"12345"
    with pytest.raises(FileNotFoundError), open_regular(tmp_path / "missing"):
        pass


# -- read_json ------------------------------------------------------------------------

def test_read_json_of_a_fifo_is_none_at_once(fifo: Path) -> None:
    assert within(2, lambda: read_json(fifo)) is None


def test_read_json_of_a_socket_is_none(unix_socket: Path) -> None:
    assert read_json(unix_socket) is None


def test_read_json_of_dev_zero_is_none(tmp_path: Path) -> None:
    (tmp_path / "p.json").symlink_to("/dev/zero")
    assert within(2, lambda: read_json(tmp_path / "p.json")) is None


def test_read_json_over_the_cap_is_none(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"done": 1, "pad": "x" * (2 * MiB)}))
    assert read_json(path, max_bytes=MiB) is None
    assert read_json(path, max_bytes=3 * MiB) is not None  # valid, just too large
    assert from_progress_file(path) is None  # a progress file has 1 MiB at most
    path.write_text(json.dumps({"done": 1}))
    assert read_json(path, max_bytes=MiB) == {"done": 1}
    assert from_progress_file(path) == Reported(1, None)
    big = tmp_path / "big.json"  # sparse: 17 MiB of nothing, over the default cap
    with open(big, "wb") as f:
        f.truncate(JSON_MAX_BYTES + 1)
    assert read_json(big) is None


def test_read_json_nested_too_deep_is_none(tmp_path: Path) -> None:
    """Half a MiB of `[` is a small file and a RecursionError in json: invalid, not a crash."""
    path = tmp_path / "p.json"
    path.write_text("[" * 500_000 + "]" * 500_000)
    assert read_json(path) is None


# -- tail_lines -----------------------------------------------------------------------

def test_tail_lines_of_an_ordinary_log(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    assert tail_lines(path, 3) == (["line 997", "line 998", "line 999"], path.stat().st_size)
    assert tail_lines(path, 0) == ([], path.stat().st_size)
    path.write_bytes(b"a\nb\nno newline yet")
    assert tail_lines(path, 2) == (["b", "no newline yet"], 18)
    assert tail_lines(path, 10) == (["a", "b", "no newline yet"], 18)
    path.write_bytes(b"")
    assert tail_lines(path, 5) == ([], 0)
    assert tail_lines(tmp_path / "missing", 5) == ([], 0)


def test_tail_lines_takes_the_last_redraw_of_a_line(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"start\r\n"  # CRLF
                     b"\r 10%|#  | 1/10 [00:01]\r 20%|## | 2/10 [00:02]\n"  # tqdm, closed
                     b"\r 30%|###| 3/10 [00:03]\r                    \r"  # leave=False clears
                     b"done\n"
                     b"\r 40%|###| 4/10 [00:04]")  # still drawing
    lines, _ = tail_lines(path, 10)
    assert lines == ["start", " 20%|## | 2/10 [00:02]", "done", " 40%|###| 4/10 [00:04]"]


def test_tail_lines_marks_a_cut_redraw_only_when_it_is_the_first(tmp_path: Path) -> None:
    """The window starts inside a line: its first redraw is cut, a later one is whole
    (one-byte redraws, which Python shares between equal values, included)."""
    path = tmp_path / "log"
    path.write_bytes(b"abcx\rx")
    assert tail_lines(path, 1, max_bytes=3) == (["x"], 6)  # window "x\rx"
    path.write_bytes(b"abcx\r ")
    assert tail_lines(path, 1, max_bytes=4) == (["…[cut 1+ bytes]cx"], 6)  # "cx\r "


def test_tail_lines_cuts_a_long_line_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"before\n" + b"x" * 10_000 + b"END\nafter\n")
    lines, _ = tail_lines(path, 2)
    assert lines[1] == "after"
    assert lines[0] == f"…[cut {10_003 - TAIL_LINE_MAX_BYTES} bytes]" + "x" * 4093 + "END"


def test_tail_lines_never_starts_inside_a_utf8_character(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes("é".encode() * 5000 + b"\n")  # 2 bytes each: a cut at an odd offset
    (line,), _ = tail_lines(path, 1, max_line=4001)
    assert line == "…[cut 6000 bytes]" + "é" * 2000


def test_tail_lines_of_a_huge_line_without_newline_is_bounded(tmp_path: Path) -> None:
    """50 MB of one line: the answer is its last TAIL_LINE_MAX_BYTES, marked as cut
    (`+`: the line began before what was read), found quickly."""
    path = tmp_path / "log"
    with open(path, "wb") as f:
        f.write(b"start\n")
        f.write(b"y" * (50 * MiB))
        f.write(b"END")
    started = time.monotonic()
    lines, end = tail_lines(path, 5)
    elapsed = time.monotonic() - started
    assert end == 6 + 50 * MiB + 3
    assert len(lines) == 1
    marker = f"…[cut {TAIL_MAX_BYTES + 1 - TAIL_LINE_MAX_BYTES}+ bytes]"
    assert lines[0] == marker + "y" * (TAIL_LINE_MAX_BYTES - 3) + "END"
    assert elapsed < 0.5


def test_tail_lines_of_a_huge_run_of_redraws_is_the_last_redraw(tmp_path: Path) -> None:
    """A tqdm bar that never printed a newline: 20 MB of `\\r` redraws are one line,
    and the last redraw is what it shows."""
    path = tmp_path / "log"
    redraws = b"".join(b"\r%3d%%|#   | %d/200000 [00:01<00:02]" % (i // 2000, i)
                       for i in range(200_000))
    with open(path, "wb") as f:
        for _ in range(3):
            f.write(redraws)
    assert path.stat().st_size > 20 * MiB
    lines, _ = tail_lines(path, 5)
    assert lines == [" 99%|#   | 199999/200000 [00:01<00:02]"]


def test_tail_lines_window_starting_at_a_line_start_marks_nothing(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"head\n" + b"z" * 100 + b"\n")
    assert tail_lines(path, 5, max_bytes=101) == (["z" * 100], 106)
    assert tail_lines(path, 5, max_bytes=100) == (["…[cut 1+ bytes]" + "z" * 99], 106)


def test_tail_lines_of_a_fifo_or_dev_zero_is_empty(fifo: Path, tmp_path: Path) -> None:
    assert within(2, lambda: tail_lines(fifo, 5)) == ([], 0)
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert within(2, lambda: tail_lines(tmp_path / "zero", 5)) == ([], 0)


# -- read_from ------------------------------------------------------------------------

def test_read_from(tmp_path: Path, fifo: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"one\ntwo\nthr")
    assert read_from(path, 0, 100) == (b"one\ntwo\n", 8)
    assert read_from(path, 8, 100) == (b"thr", 11)
    assert read_from(path, 0, 5) == (b"one\n", 4)
    assert read_from(path, 2**63, 100) == (b"", 2**63)
    assert within(2, lambda: read_from(fifo, 0, 100)) == (b"", 0)
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert within(2, lambda: read_from(tmp_path / "zero", 0, 100)) == (b"", 0)


# -- progress -------------------------------------------------------------------------

def test_progress_from_a_fifo_or_dev_zero_is_none(fifo: Path, tmp_path: Path) -> None:
    assert within(2, lambda: from_progress_file(fifo)) is None
    assert within(2, lambda: from_log(fifo)) is None
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert within(2, lambda: from_progress_file(tmp_path / "zero")) is None
    assert within(2, lambda: from_log(tmp_path / "zero")) is None


@pytest.mark.parametrize("report", [
    {"done": 10**20, "total": 10**21},
    {"done": COUNT_MAX + 1},
    {"done": 5, "total": COUNT_MAX + 1},
])
def test_progress_beyond_int64_is_no_report(tmp_path: Path, report: dict[str, int]) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(report))
    assert from_progress_file(path) is None


def test_progress_at_int64_max_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"done": COUNT_MAX, "total": COUNT_MAX}))
    assert from_progress_file(path) == Reported(COUNT_MAX, COUNT_MAX)


@pytest.mark.parametrize("line", [
    b"\r 1%|#  | 100000000000000000000/1000000000000000000000 [00:01]",
    b"step 100000000000000000000/1000000000000000000000",
    b"step " + b"9" * 5000 + b"/" + b"9" * 5001,  # int() of these raises
])
def test_log_counts_beyond_int64_are_skipped(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"step 3/10\n" + line + b"\n")
    assert from_log(path) == Reported(3, 10)  # the earlier, storable count


# -- a real daemon and hostile jobs ---------------------------------------------------

def vm_kib(pid: int, field: str) -> int:
    """`VmRSS`/`VmHWM` (peak) of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


class HealthProbe:
    """Asks /healthz every 0.1 s from a thread and keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest = 0.0
        self.count = 0
        self.failures: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as http:
            while not self._done.is_set():
                started = time.monotonic()
                try:
                    status = http.get("/healthz").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.count += 1
                self._done.wait(0.1)


LOG_PATH = "os.readlink('/proc/self/fd/1')"
SETUP = "import os, socket, sys, time\nprogress = os.environ['JOBSUP_PROGRESS_FILE']\n"
HOSTILE: dict[str, str] = {
    # what the job puts in place, then it sleeps until stopped
    "fifo-progress": "os.mkfifo(progress)",
    "fifo-log": f"log = {LOG_PATH}; os.unlink(log); os.mkfifo(log)",
    "socket": (f"log = {LOG_PATH}; os.unlink(log); os.chdir(os.path.dirname(log))\n"
               "a = socket.socket(socket.AF_UNIX); a.bind('output.log')\n"
               "b = socket.socket(socket.AF_UNIX); b.bind('../progress.json')"),
    "zero-progress": "os.symlink('/dev/zero', progress)",
    "huge-count": ("import json\n"
                   "json.dump({'done': 10**20, 'total': 10**21}, open(progress, 'w'))"),
}


def hostile_in_place(daemon: Daemon, job_id: str, name: str) -> bool:
    jobs = daemon.data_dir / "jobs" / job_id
    progress, log = jobs / "progress.json", jobs / "attempt-1" / "output.log"
    try:
        if name == "fifo-progress":
            return stat.S_ISFIFO(os.stat(progress).st_mode)
        if name == "fifo-log":
            return stat.S_ISFIFO(os.stat(log).st_mode)
        if name == "socket":
            return stat.S_ISSOCK(os.stat(log).st_mode) and stat.S_ISSOCK(
                os.stat(progress).st_mode)
        if name == "zero-progress":
            return progress.is_symlink()
        return progress.exists()
    except FileNotFoundError:
        return False


def samples(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    response = daemon.http.get(f"/api/v1/jobs/{job_id}/samples")
    assert response.status_code == 200, response.text
    return list(response.json())


def run_hostile_jobs(make_daemon: Callable[..., Daemon], tmp_path: Path,
                     hostile: dict[str, str], *, failing: bool = True) -> dict[str, Any]:
    """Start the `hostile` jobs; once each has its trap in place, an honest job (and,
    with `failing`, one that puts a FIFO at its log and exits 3); check the honest job's
    progress and end, the failing job's record, the daemon's health and RSS, and the
    observation of the hostile jobs; stop them. Returns the measurements."""
    daemon = make_daemon()
    pid = daemon.proc.pid if daemon.proc else 0
    rss_start = vm_kib(pid, "VmRSS")
    with HealthProbe(daemon.url) as probe:
        ids = {name: daemon.submit(python_job(SETUP + code + "\ntime.sleep(120)\n"),
                                   name=name)["id"]
               for name, code in hostile.items()}
        for name, job_id in ids.items():
            wait_for(lambda: hostile_in_place(daemon, job_id, name), 15, what=name)  # noqa: B023
        # a failing job whose log is a FIFO: its failure is recorded at once
        fails = daemon.submit(python_job(
            f"import os, sys, time\nlog = {LOG_PATH}; os.unlink(log); os.mkfifo(log)\n"
            "time.sleep(1); sys.exit(3)"), name="fifo-log-fails")["id"] if failing else None

        out = tmp_path / "out"
        out.mkdir()
        n = 20
        honest = daemon.submit(job_module("honest_items", out, n), name="honest",
                               output_dir=str(out))["id"]
        finished = daemon.wait_state(honest, "succeeded", "failed", timeout=30)
        failed = daemon.wait_state(fails, "failed", "succeeded", timeout=10) if fails else None

        # every hostile job is still observed: samples keep coming
        counts = {name: len(samples(daemon, job_id)) for name, job_id in ids.items()}
        wait_for(lambda: all(len(samples(daemon, job_id)) >= counts[name] + 2  # noqa: B023
                             for name, job_id in ids.items()), 10, what="more samples")
        metrics = daemon.http.get("/metrics")
        views = {name: daemon.job(job_id) for name, job_id in ids.items()}
        for job_id in ids.values():
            assert daemon.http.post(f"/api/v1/jobs/{job_id}/stop").status_code == 202
        for job_id in ids.values():
            daemon.wait_state(job_id, "stopped", timeout=20)
    rss_end, hwm = vm_kib(pid, "VmRSS"), vm_kib(pid, "VmHWM")

    assert finished["state"] == "succeeded", finished
    assert finished["progress"]["items_done"] == n
    assert finished["progress"]["items_total"] == n
    assert finished["progress"]["source"] == "progress_file"
    reported = [s["items_done"] for s in samples(daemon, honest)]
    assert reported, "no sample of the honest job"
    assert all(isinstance(d, int) and 0 <= d <= n for d in reported), reported
    assert reported == sorted(reported)
    assert len(set(reported)) >= 3, f"progress not followed live: {reported}"

    if failed is not None:
        assert failed["state"] == "failed" and failed["exit_code"] == 3, failed
        assert failed["reason"].startswith("exited with code 3"), failed["reason"]
    assert probe.failures == [] and probe.count > 20
    assert probe.slowest < 1.0, f"/healthz took {probe.slowest:.2f} s"
    assert metrics.status_code == 200 and "jobsup_" in metrics.text
    for name, view in views.items():
        assert view["progress"]["items_done"] is None, (name, view["progress"])
        assert view["state"] == "running"
    assert hwm - rss_start < 100 * 1024, f"peak RSS {hwm} KiB, started at {rss_start} KiB"
    return {"rss_start_kib": rss_start, "rss_end_kib": rss_end, "hwm_kib": hwm,
            "healthz_slowest_s": probe.slowest, "healthz_count": probe.count}


@pytest.mark.slow
def test_hostile_files_beside_an_honest_job(make_daemon: Callable[..., Daemon],
                                            tmp_path: Path) -> None:
    """FIFOs at the progress file and the log, sockets at both, /dev/zero as the
    progress file and a count beyond int64, all at once beside an honest job: the honest
    job keeps exact progress and succeeds, the daemon stays healthy and small, and the
    hostile jobs are observed (samples stored) and stoppable."""
    measured = run_hostile_jobs(make_daemon, tmp_path, HOSTILE)
    print(measured)


# -- logs without newlines ------------------------------------------------------------

@pytest.mark.slow
def test_tail_of_a_300mb_log_without_newline(make_daemon: Callable[..., Daemon]) -> None:
    """`logs?tail=5` of ~300 MB of tqdm redraws without a newline answers at once, with
    the last redraw, and the daemon's memory does not grow with the log."""
    daemon = make_daemon()
    assert daemon.proc is not None
    job_id = daemon.submit(job_module("tqdm_redraws"), name="tqdm")["id"]
    written = daemon.data_dir / "jobs" / job_id / "progress.json.written"
    wait_for(written.exists, 60, interval=0.2, what="300 MB written")
    log = daemon.data_dir / "jobs" / job_id / "attempt-1" / "output.log"
    size = log.stat().st_size
    assert size > 300 * 10**6
    rss_before = vm_kib(daemon.proc.pid, "VmRSS")
    hwm_before = vm_kib(daemon.proc.pid, "VmHWM")

    slowest = 0.0
    for _ in range(3):
        started = time.monotonic()
        response = daemon.http.get(f"/api/v1/jobs/{job_id}/logs", params={"tail": 5})
        slowest = max(slowest, time.monotonic() - started)
        assert response.status_code == 200
        assert response.text == "100%|##########| 1000000/1000000 [00:22<00:00, 45.0it/s]\n"
        assert response.headers["x-jobsup-log-offset"] == str(size)
    big = daemon.http.get(f"/api/v1/jobs/{job_id}/logs", params={"tail": 1_000_000})
    assert big.text == response.text  # one line, however many are asked for
    hwm_after = vm_kib(daemon.proc.pid, "VmHWM")
    rss_after = vm_kib(daemon.proc.pid, "VmRSS")
    # the log is also where the job's progress is found: its last redraw
    wait_for(lambda: daemon.job(job_id)["progress"]["items_done"] == 1_000_000, 10,
             what="progress read from the log's last redraw")
    print({"log_bytes": size, "slowest_s": slowest, "rss_before_kib": rss_before,
           "rss_after_kib": rss_after, "hwm_before_kib": hwm_before, "hwm_after_kib": hwm_after})
    assert slowest < 1.0, f"tail took {slowest:.2f} s"
    assert hwm_after - hwm_before < 32 * 1024, (hwm_before, hwm_after)


@pytest.mark.slow
def test_a_single_50mb_line_comes_back_cut(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    assert daemon.proc is not None
    job_id = daemon.submit(job_module("one_long_line"), name="one-line")["id"]
    log = daemon.data_dir / "jobs" / job_id / "attempt-1" / "output.log"
    wait_for(lambda: log.exists() and log.stat().st_size == 6 + 50 * MiB + 4, 30,
             what="50 MB written")
    hwm_before = vm_kib(daemon.proc.pid, "VmHWM")
    started = time.monotonic()
    text = daemon.logs(job_id, tail=5)
    elapsed = time.monotonic() - started
    hwm_after = vm_kib(daemon.proc.pid, "VmHWM")
    print({"elapsed_s": elapsed, "bytes": len(text.encode()), "hwm_before_kib": hwm_before,
           "hwm_after_kib": hwm_after})
    marker = f"…[cut {TAIL_MAX_BYTES - TAIL_LINE_MAX_BYTES}+ bytes]"  # the last byte is \n
    assert text == marker + "A" * (TAIL_LINE_MAX_BYTES - 3) + "END\n"
    assert elapsed < 1.0
    assert hwm_after - hwm_before < 32 * 1024, (hwm_before, hwm_after)


@pytest.mark.slow
def test_failure_with_a_log_of_one_huge_line_is_recorded_promptly(
        make_daemon: Callable[..., Daemon]) -> None:
    """Every failure reads the log's tail to classify the exit: a log of one 300 MB line
    neither delays the record nor swells the daemon."""
    daemon = make_daemon()
    assert daemon.proc is not None
    hwm_before = vm_kib(daemon.proc.pid, "VmHWM")
    job_id = daemon.submit(job_module("fails_with_huge_line"), name="fails")["id"]
    exiting = daemon.data_dir / "jobs" / job_id / "progress.json.exiting"
    wait_for(exiting.exists, 20, interval=0.02, what="the job about to exit")
    started = time.monotonic()
    job = daemon.wait_state(job_id, "failed", "succeeded", timeout=20)
    elapsed = time.monotonic() - started
    hwm_after = vm_kib(daemon.proc.pid, "VmHWM")
    print({"elapsed_s": elapsed, "hwm_before_kib": hwm_before, "hwm_after_kib": hwm_after})
    assert job["state"] == "failed" and job["exit_code"] == 3, job
    assert job["reason"].startswith("exited with code 3"), job["reason"]
    tail = daemon.logs(job_id, tail=5)
    assert tail.endswith("RuntimeError: the end of a very long line\n")
    assert len(tail.encode()) < TAIL_LINE_MAX_BYTES + 64
    assert elapsed < 3.0, f"failure recorded {elapsed:.2f} s after the exit"
    assert hwm_after - hwm_before < 32 * 1024, (hwm_before, hwm_after)
