"""Each job's observation stands alone: a reading that raises costs only its job fresh
figures (and says so), a slow output scan holds neither the tick nor the other jobs, an
ended job's last scan still lands, and no stuck scan keeps the daemon from exiting.

Engine-level tests: an in-process engine over a real SQLite database with real job
processes, the scanner of one job replaced (through `supervisor.observe.readings.OutputScanner`)
by one that raises or blocks. Observer-level tests: real files and a real process tree
(the test's own), the progress file written by the test."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.api.submission import submit_job
from supervisor.daemon.loop import Engine
from supervisor.observe import observer as observer_module
from supervisor.observe import readings as readings_module
from supervisor.observe.observer import Observer
from supervisor.observe.readings import ObservedJob
from supervisor.observe.threads import FilePool
from supervisor.runtime.files import progress_path
from supervisor.runtime.outputs import OutputScanner
from supervisor.runtime.outputs_state import ScanResult
from supervisor.spec import JobSpec
from supervisor.storage import store
from tests.helpers import REPO, Daemon, in_process_engine, job_module, python_job, wait_for

pytestmark = pytest.mark.timeout(90)


class FailingScanner:
    """Raises on every scan, as a bug in reading one job's output would."""

    def __init__(self, root: str, pattern: str) -> None:
        self.root = root

    def scan(self, now: float, *, final: bool = False) -> ScanResult:
        raise RuntimeError(f"cannot read {self.root}: disk on fire")

    def watched(self) -> bool:
        return True  # never asked: an observer given its own scanners reads in threads

    def close(self) -> None:
        pass


class BlockingScanner:
    """A scan that takes as long as the test says (the first scan of a huge tree, a
    hung file server): each scan waits for `release`, then scans for real. Counts its
    scans and fails loudly if two ever run at once (the scanner is not thread-safe)."""

    release = threading.Event()
    scans = 0
    overlaps = 0
    _running = threading.Lock()

    def __init__(self, root: str, pattern: str) -> None:
        self.real = OutputScanner(root, pattern)

    def scan(self, now: float, *, final: bool = False) -> ScanResult:
        if not BlockingScanner._running.acquire(blocking=False):
            BlockingScanner.overlaps += 1
            raise AssertionError("two scans at once on one scanner")
        try:
            BlockingScanner.scans += 1
            BlockingScanner.release.wait(15)
            return self.real.scan(now)
        finally:
            BlockingScanner._running.release()

    def watched(self) -> bool:
        return False  # never asked (as above), and any scan may block

    def close(self) -> None:
        self.real.close()

    @classmethod
    def reset(cls) -> None:
        cls.release = threading.Event()
        cls.scans = cls.overlaps = 0


def scanners(special: dict[str, type]) -> Callable[[str, str], Any]:
    """A scanner factory: the class given for these output dirs, the real one (with the
    observer's directory watches) otherwise."""
    def make(root: str, pattern: str = "**/*", watcher: Any = None) -> Any:
        if root in special:
            return special[root](root, pattern)
        return OutputScanner(root, pattern, watcher=watcher)
    return make


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    with in_process_engine(tmp_path / "data") as pair:
        try:
            yield pair
        finally:
            BlockingScanner.release.set()


def submit(sessions: sessionmaker[Session], name: str, command: list[str],
           **spec: Any) -> str:
    with sessions() as session:
        job, _ = submit_job(session, JobSpec(name=name, command=command, **spec),
                            default_cwd=str(Path.cwd()), views={})
        session.commit()
        return job.id


def sample_count(sessions: sessionmaker[Session], job_id: str) -> int:
    with sessions() as session:
        return len(store.samples(session, job_id, since=0, limit=100_000))


def progress(eng: Engine, job_id: str) -> dict[str, Any]:
    return dataclasses.asdict(eng.observer.views[job_id].progress)


def timed_tick(eng: Engine) -> float:
    started = time.monotonic()
    eng.tick()
    return time.monotonic() - started


def test_a_failing_reading_costs_only_its_job(
        engine: tuple[Engine, sessionmaker[Session]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    eng, sessions = engine
    broken_dir = str(tmp_path / "broken")
    monkeypatch.setattr(readings_module, "OutputScanner", scanners({broken_dir: FailingScanner}))
    broken = submit(sessions, "broken", python_job("import time; time.sleep(60)"),
                    output_dir=broken_dir)
    honest = submit(sessions, "honest", job_module("empty_items", tmp_path / "out"),
                    output_dir=str(tmp_path / "out"), pattern="*.bin")
    eng.tick()  # starts both
    wait_for(progress_path(eng.settings.jobs_dir, honest).exists, 20, what="a report")
    seen: list[int] = []
    with caplog.at_level(logging.WARNING):
        for _ in range(6):
            time.sleep(0.3)
            eng.tick()
            seen.append(progress(eng, honest)["items_done"] or 0)
    assert not [r for r in caplog.records if "tick step failed" in r.getMessage()]
    assert seen == sorted(seen) and seen[-1] > seen[0] > 0, seen  # progress moves on
    fresh = progress(eng, honest)
    assert fresh["observation_error"] is None and fresh["observed_at"] is not None
    assert fresh["source"] == "progress_file"
    assert sample_count(sessions, honest) >= 5  # one per tick after the start

    failed = progress(eng, broken)
    assert failed["observation_error"] == (
        f"output scan failed: RuntimeError: cannot read {broken_dir}: disk on fire")
    assert failed["observed_at"] is None  # never read
    assert sample_count(sessions, broken) == 0
    assert eng.observer.views[broken].resources.num_procs >= 1  # its processes still read
    logged = [r for r in caplog.records if "disk on fire" in r.getMessage()]
    assert len(logged) == 1  # once while it lasts, not every tick
    with sessions() as session:  # what the API shows after a restart says so too
        job = store.get_job(session, broken)
        assert job is not None and "disk on fire" in (job.progress_json or "")


def test_a_slow_scan_holds_neither_the_tick_nor_the_other_jobs(
        engine: tuple[Engine, sessionmaker[Session]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, sessions = engine
    BlockingScanner.reset()
    huge = tmp_path / "huge"
    (huge / "rows_0").mkdir(parents=True)
    for i in range(5):
        (huge / "rows_0" / f"item{i}.bin").write_bytes(b"x" * 10)
    monkeypatch.setattr(readings_module, "OutputScanner", scanners({str(huge): BlockingScanner}))
    slow = submit(sessions, "slow", python_job("import time; time.sleep(60)"),
                  output_dir=str(huge), pattern="**/*.bin")
    honest = submit(sessions, "honest", job_module("empty_items", tmp_path / "out"),
                    output_dir=str(tmp_path / "out"), pattern="*.bin")
    eng.tick()  # starts both
    wait_for(progress_path(eng.settings.jobs_dir, honest).exists, 20, what="a report")
    durations, seen = [], []  # the first tick here starts the slow job's first scan
    for _ in range(4):
        time.sleep(0.3)
        durations.append(timed_tick(eng))
        seen.append(progress(eng, honest)["items_done"] or 0)
    # a tick waits at most the scan budget (1 s by default) for the readings it starts,
    # and not again for one still running; the slow scan blocks for 15 s
    assert max(durations) < 2.5, durations
    assert seen == sorted(seen) and seen[-1] > seen[0] > 0, seen
    assert progress(eng, honest)["observation_error"] is None
    assert sample_count(sessions, honest) >= 3

    waiting = progress(eng, slow)
    assert waiting["observation_error"].startswith("output scan still running (")
    assert waiting["observation_error"].endswith(" s so far)")
    assert waiting["items_done"] is None and sample_count(sessions, slow) == 0
    assert BlockingScanner.scans == 1  # no second scan started behind the first

    BlockingScanner.release.set()  # the scan ends: its result is picked up
    wait_for(lambda: eng.tick() or progress(eng, slow)["observation_error"] is None, 10,
             interval=0.1, what="the slow scan's result")
    done = progress(eng, slow)
    assert (done["files"], done["bytes_written"], done["source"]) == (5, 50, "files")
    assert sample_count(sessions, slow) >= 1
    assert BlockingScanner.overlaps == 0


def observed(job_id: str, spec: JobSpec) -> ObservedJob:
    """A job whose process tree is this test's process (any live tree will do)."""
    import os
    return ObservedJob(job_id=job_id, spec=spec, attempt=1, root_pid=os.getpid(),
                       root_create_time=None, worker_pid=os.getpid())


def write_progress(jobs_dir: Path, job_id: str, done: int) -> None:
    path = progress_path(jobs_dir, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"done": done, "total": 100}))


def test_an_ended_job_gets_its_final_scan_and_close_waits_for_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that ends while its scan runs: that scan's figures land in its view once
    done, and a scan started before its end is followed by one more. Closing the
    observer with a scan stuck does not wait for it."""
    BlockingScanner.reset()
    jobs_dir = tmp_path / "jobs"
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(readings_module, "OutputScanner", scanners({str(out): BlockingScanner}))
    observer = Observer(jobs_dir)
    job = observed("ending", JobSpec(name="x", command=["true"], output_dir=str(out),
                                     pattern="*.bin"))
    observer.observe([job], time.time())  # scan 1 starts, and blocks
    assert observer.views["ending"].progress.observation_error is not None
    (out / "a.bin").write_bytes(b"1")  # the job writes its last item and ends
    observer.observe([job], time.time())  # scan 1 still runs: no new one
    observer.forget("ending")
    assert observer.views["ending"].progress.observation_error == (
        "final output scan still running")
    BlockingScanner.release.set()
    wait_for(lambda: observer.observe([], time.time()) == [] and
             observer.views["ending"].progress.observation_error is None, 10,
             what="the final scan")
    final = observer.views["ending"].progress
    assert (final.files, final.items_done, final.observed_at is not None) == (1, 1, True)
    assert BlockingScanner.scans == 2 and BlockingScanner.overlaps == 0

    BlockingScanner.reset()  # a scan stuck for good, then the daemon stops
    stuck = observed("stuck", JobSpec(name="y", command=["true"], output_dir=str(out)))
    observer.observe([stuck], time.time())
    started = time.monotonic()
    observer.close()
    assert time.monotonic() - started < 0.5
    BlockingScanner.release.set()


def test_a_stuck_scan_does_not_keep_the_process_from_exiting(tmp_path: Path) -> None:
    """The workers are daemon threads: a scan stuck on a dead file server (here: one
    that never returns) does not hold the daemon's exit."""
    code = f"""
import os, threading, time
from pathlib import Path
from supervisor.observe import observer as observer_module
from supervisor.spec import JobSpec
class Stuck:
    def __init__(self, root, pattern, watcher=None): pass
    def scan(self, now, *, final=False): threading.Event().wait()
    def close(self): pass
from supervisor.observe import readings
readings.OutputScanner = Stuck
observer = observer_module.Observer(Path({str(tmp_path)!r}))
job = readings.ObservedJob(job_id="j", spec=JobSpec(name="j", command=["true"], output_dir="/x"),
                           attempt=1, root_pid=os.getpid(), root_create_time=None,
                           worker_pid=os.getpid())
observer.observe([job], time.time())
print(observer.views["j"].progress.observation_error, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()  # its last line: from here on it only has to exit
        started = time.monotonic()  # (its Python start and imports are not timed)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr
    assert said.startswith("output scan still running ("), (said, stderr)
    assert time.monotonic() - started < 5


def test_honest_readings_are_fresh_and_say_when(tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    observer = Observer(jobs_dir)
    job = observed("j", JobSpec(name="x", command=["true"]))
    for done in (3, 7):
        write_progress(jobs_dir, "j", done)
        now = time.time()
        (sample,) = observer.observe([job], now)
        shown = observer.views["j"].progress
        assert (shown.items_done, sample.items_done, shown.observation_error) == (
            done, done, None)
        assert shown.observed_at == now  # the tick's time, a float
    observer.close()


@pytest.mark.slow
@pytest.mark.parametrize(("pattern", "why"), [
    ("[z-a]", "reversed"),
    ("rows_*/[9-0]*.bin", "reversed"),
    ("", "empty"),
    ("/", "empty"),
    ("a\x00b", "NUL"),
    ("*" * 1025, "1025 characters"),
])
def test_an_invalid_pattern_is_refused_naming_the_field(
        daemon: Daemon, pattern: str, why: str) -> None:
    response = daemon.http.post("/api/v1/jobs", json={
        "name": "x", "command": ["true"], "output_dir": "/tmp", "pattern": pattern})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error.startswith("pattern: ") and why in error, error
    assert daemon.http.get("/api/v1/jobs").json() == []


@pytest.mark.slow
def test_a_pattern_that_backtracked_for_seconds_is_accepted_and_counts(
        daemon: Daemon, tmp_path: Path) -> None:
    """The pattern that froze the daemon (8 stars, a 46-character name): the job is
    observed and the API answers at once."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ("a" * 45 + "b")).write_bytes(b"x")
    (out / ("a" * 45 + "c")).write_bytes(b"x")
    job = daemon.submit(python_job("import time; time.sleep(30)"), output_dir=str(out),
                        pattern="*a" * 8 + "c")
    shown = wait_for(lambda: (p := daemon.job(job["id"])["progress"])["files"] == 1 and p,
                     10, what="the item counted")
    assert shown.get("observation_error") is None and shown.get("observed_at")
    started = time.monotonic()
    assert daemon.http.get("/api/v1/jobs").status_code == 200
    assert time.monotonic() - started < 2
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_readings_stuck_on_a_dead_server_do_not_starve_the_others() -> None:
    """Each stuck reading holds one thread; a new one is started while every thread is
    busy, so a healthy job's reading still runs at once (a fixed pool of 4 starved it
    behind 4 readings hung on a dead NFS mount)."""
    workers = FilePool(observer_module.FILE_WORKERS)
    hung = threading.Event()
    try:
        stuck = [workers.submit(hung.wait) for _ in range(6)]
        healthy = workers.submit(lambda: "read")
        assert healthy.result(timeout=2) == "read"
        assert not any(f.done() for f in stuck)
    finally:
        hung.set()
        workers.close()


def test_a_restarted_job_counting_from_zero_gets_its_first_item(tmp_path: Path) -> None:
    """The progress file is per job: a new attempt first shows the last one's count
    (1000), then its own from 0. The count going down resets the baseline, so its first
    new item is seen (else `first_item_at` stays unset and a startup timeout would fire
    on a job that is working)."""
    jobs_dir = tmp_path / "jobs"
    observer = Observer(jobs_dir)
    job = observed("j", JobSpec(name="x", command=["true"]))
    now = time.time()
    for step, done in enumerate((1000, 0, 5)):
        write_progress(jobs_dir, "j", done)
        observer.observe([job], now + step)
        if done < 5:
            assert observer.views["j"].first_item_at is None
    assert observer.views["j"].first_item_at == now + 2
    observer.close()



def require_local_watches(path: Path) -> None:
    """Readings go to the tick thread only under inotify watches on a local disk."""
    from supervisor.runtime.dirwatch import DirWatcher
    watcher = DirWatcher.open()
    if watcher is None:
        pytest.skip("no inotify here")
    try:
        if not watcher.is_local(os.stat(path).st_dev):
            pytest.skip(f"{path} is not on a local filesystem")
    finally:
        watcher.close()


UNHURRIED_S = 60.0
"""A scan budget and inline limits (s) that no reading on a loaded machine reaches."""


def _unhurried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer's wall-clock limits out of reach, for a test of where readings run or
    what a failing one costs, not of their timing: a first reading that a loaded machine
    stretched past INLINE_MAX_S (53 ms seen) sends the job's next one to the threads, and
    one not done within the scan budget leaves the next tick without it. The observer is
    built with `scan_budget_s=UNHURRIED_S`: its tick waits for its threads' readings until
    they are done, no longer."""
    monkeypatch.setattr(observer_module, "INLINE_MAX_S", UNHURRIED_S)
    monkeypatch.setattr(observer_module, "INLINE_TICK_MAX_S", UNHURRIED_S)


def _reading_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where each file reading runs from now on: "tick" (this, the observing thread) or
    "pool". A pass-through wrapper of the real `FileSide.read`."""
    where: list[str] = []
    real = readings_module.FileSide.read

    def read(self: Any, job: ObservedJob, now: float, *, final: bool = False) -> Any:
        where.append("tick" if threading.current_thread() is threading.main_thread()
                     else "pool")
        return real(self, job, now, final=final)

    monkeypatch.setattr(readings_module.FileSide, "read", read)
    return where


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "listed"])
def test_a_watched_local_job_is_read_in_the_tick_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: bool) -> None:
    """After its first reading (a walk: in a thread), a job whose output directory is
    watched whole on a local disk is read in the tick thread, with the same figures; with
    the watches off (`JOBSUP_OUTPUT_WATCH=list`) every reading is a thread's."""
    require_local_watches(tmp_path)
    _unhurried(monkeypatch)
    where = _reading_threads(monkeypatch)
    jobs_dir, out = tmp_path / "jobs", tmp_path / "out"
    (out / "shard").mkdir(parents=True)
    observer = Observer(jobs_dir, watch_outputs=watch, scan_budget_s=UNHURRIED_S)
    job = observed("w", JobSpec(name="w", command=["true"], output_dir=str(out),
                                pattern="**/*.bin"))
    try:
        for tick in range(4):
            (out / "shard" / f"{tick}.bin").write_bytes(b"x" * (tick + 1))
            write_progress(jobs_dir, "w", tick + 1)
            observer.observe([job], time.time())
            progress = observer.views["w"].progress
            assert progress.observation_error is None
            assert (progress.files, progress.bytes_written, progress.items_done) == (
                tick + 1, sum(range(1, tick + 2)), tick + 1)
    finally:
        observer.close()
    assert where == (["pool", "tick", "tick", "tick"] if watch else ["pool"] * 4)


def test_a_job_whose_last_reading_was_slow_is_read_in_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose last reading took longer than INLINE_MAX_S (here any) is read in the
    threads, however it is watched; once one takes less, in the tick thread again."""
    require_local_watches(tmp_path)
    monkeypatch.setattr(observer_module, "INLINE_MAX_S", 0.0)
    where = _reading_threads(monkeypatch)
    out, jobs_dir = tmp_path / "out", tmp_path / "jobs"
    out.mkdir()
    jobs_dir.mkdir()
    observer = Observer(jobs_dir)
    job = observed("s", JobSpec(name="s", command=["true"], output_dir=str(out)))
    try:
        for _ in range(3):
            observer.observe([job], time.time())
        monkeypatch.setattr(observer_module, "INLINE_MAX_S", 60.0)
        for _ in range(2):
            observer.observe([job], time.time())
    finally:
        observer.close()
    assert where == ["pool", "pool", "pool", "tick", "tick"]


def test_a_scanner_is_watched_whole_only_with_a_few_files_to_look_at(
        tmp_path: Path) -> None:
    """`OutputScanner.watched` (what lets a job be read in the tick thread): true after
    a scan of a tree it watches whole; false, once the watcher has read them, while a
    directory created or moved in (listed whole by the next scan), a directory changed
    itself or more names than it allows wait; true again after that scan."""
    from supervisor.runtime.dirwatch import DirWatcher
    require_local_watches(tmp_path)
    watcher = DirWatcher.open()
    assert watcher is not None
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    staging.mkdir()
    for index in range(50):
        (staging / f"{index}.bin").write_bytes(b"1")
    scanner = OutputScanner(str(out), "**/*", watcher=watcher)
    try:
        assert not scanner.watched()  # never scanned
        scanner.scan(time.time())
        assert scanner.watched()
        (out / "a.bin").write_bytes(b"1")  # one new file: still a few stats
        watcher.drain()
        assert scanner.watched()
        staging.rename(out / "staging")  # a tree moved in: one name, its whole subtree
        watcher.drain()
        assert not scanner.watched()
        assert scanner.scan(time.time()).files == 51
        assert scanner.watched()
        (out / "staging").chmod(0o700)  # a directory changed itself: listed again
        watcher.drain()
        assert not scanner.watched()
        scanner.scan(time.time())
        for index in range(5):
            (out / f"b{index}.bin").write_bytes(b"1")
        watcher.drain()
        assert scanner.watched(most_names=5) and not scanner.watched(most_names=4)
        assert scanner.scan(time.time()).files == 56
    finally:
        scanner.close()
        watcher.close()
    assert not scanner.watched()  # closed: its watches are gone


def test_a_reading_that_fails_in_the_tick_thread_costs_only_its_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reading taken in the tick thread that raises leaves its job its last figures
    and the error, as a thread's would, and the other job is read as usual."""
    require_local_watches(tmp_path)
    _unhurried(monkeypatch)  # b's second reading is the tick thread's, however slow its first
    where = _reading_threads(monkeypatch)
    real = readings_module.FileSide.read
    broken = {"b"}

    def read(self: Any, job: ObservedJob, now: float, *, final: bool = False) -> Any:
        if job.job_id in broken and threading.current_thread() is threading.main_thread():
            raise OSError("disk on fire")
        return real(self, job, now, final=final)

    monkeypatch.setattr(readings_module.FileSide, "read", read)
    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    jobs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        jobs.append(observed(name, JobSpec(name=name, command=["true"],
                                           output_dir=str(tmp_path / name))))
    observer = Observer(jobs_dir, scan_budget_s=UNHURRIED_S)
    try:
        observer.observe(jobs, time.time())  # first readings: the threads'
        for name in ("a", "b"):
            (tmp_path / name / "x.bin").write_bytes(b"12")
        observer.observe(jobs, time.time())  # in the tick thread: b's raises
        a, b = observer.views["a"].progress, observer.views["b"].progress
        assert (a.files, a.observation_error) == (1, None)
        assert b.files == 0 and b.observation_error is not None
        assert "disk on fire" in b.observation_error
        broken.clear()
        observer.observe(jobs, time.time())
        assert observer.views["b"].progress.files == 1
    finally:
        observer.close()
    assert where[:2] == ["pool", "pool"] and "tick" in where[2:]
