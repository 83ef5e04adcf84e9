"""The launch window: a launch recorded as `running` whose shim left no trace after
LAUNCH_CONFIRM_S is settled through the attempt's claim file, so a job never runs
twice. An in-process engine with a controlled clock, a real SQLite database, real
shims and workers."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.api.submission import submit_job
from supervisor.config import Settings
from supervisor.daemon.lifecycle import LAUNCH_CONFIRM_S
from supervisor.daemon.loop import Engine
from supervisor.runtime.fileio import create_json_exclusive
from supervisor.runtime.files import attempt_dir
from supervisor.runtime.procfs import create_time
from supervisor.runtime.shim import CLAIM_FILE
from supervisor.spec import JobSpec
from tests.helpers import in_process_engine, job_row, wait_for

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session], Clock, Settings]]:
    clock = Clock()
    with in_process_engine(tmp_path / "data", clock) as (engine, sessions):
        yield engine, sessions, clock, engine.settings


def submit(sessions: sessionmaker[Session], command: list[str]) -> str:
    with sessions() as session:
        job, _ = submit_job(session, JobSpec(name="once", command=command),
                            default_cwd=str(Path.cwd()), views={})
        session.commit()
        return job.id


def test_a_late_shim_does_not_run_a_relaunched_job(
        setup: tuple[Engine, sessionmaker[Session], Clock, Settings], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, sessions, clock, settings = setup
    runs = tmp_path / "runs.txt"
    job_id = submit(sessions, [sys.executable, "-c",
                               f"open({str(runs)!r}, 'a').write('ran\\n')"])
    real_start = eng.backend.start

    def died_before_the_shim_started(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the daemon dies here")

    monkeypatch.setattr(eng.backend, "start", died_before_the_shim_started)
    eng.tick()  # the launch is recorded, its shim never starts
    assert job_row(sessions, job_id).state == "running"
    monkeypatch.setattr(eng.backend, "start", real_start)
    clock.now += LAUNCH_CONFIRM_S / 2
    eng.tick()
    assert job_row(sessions, job_id).attempt == 1  # still waiting for a shim
    clock.now += LAUNCH_CONFIRM_S
    eng.tick()  # gives attempt 1 up (claims it) and launches attempt 2
    job = job_row(sessions, job_id)
    assert (job.state, job.attempt) == ("running", 2)
    first = attempt_dir(settings.jobs_dir, job_id, 1)
    assert json.loads((first / CLAIM_FILE).read_text())["by"] == "daemon"
    wait_for(lambda: runs.exists() and runs.read_text() == "ran\n", 20, what="attempt 2")

    # attempt 1's shim starts at last (a thrashing machine): it must not run the job
    launch = json.loads((attempt_dir(settings.jobs_dir, job_id, 2) / "launch.json").read_text())
    (first / "launch.json").write_text(json.dumps({**launch, "attempt": 1,
                                                   "log_path": str(first / "output.log")}))
    late = subprocess.run([sys.executable, "-m", "supervisor.runtime.shim", str(first)],
                          capture_output=True, text=True, timeout=30)
    assert late.returncode == 0 and "gave this launch up" in late.stderr
    assert not (first / "worker.json").exists() and not (first / "shim.json").exists()
    time.sleep(0.5)
    assert runs.read_text() == "ran\n"  # once


def test_a_starting_shim_is_waited_for_and_a_dead_one_is_lost(
        setup: tuple[Engine, sessionmaker[Session], Clock, Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, sessions, clock, settings = setup
    job_id = submit(sessions, [sys.executable, "-c", "pass"])
    slow_shim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def claimed_but_slow(job: str, number: int, *_args: object, **_kwargs: object) -> None:
            adir = attempt_dir(settings.jobs_dir, job, number)
            adir.mkdir(parents=True)
            (adir / CLAIM_FILE).write_text(json.dumps(
                {"by": "shim", "pid": slow_shim.pid, "create_time": create_time(slow_shim.pid)}))
            raise RuntimeError("the daemon dies before recording the shim")

        monkeypatch.setattr(eng.backend, "start", claimed_but_slow)
        eng.tick()
        clock.now += 3 * LAUNCH_CONFIRM_S
        eng.tick()
        job = job_row(sessions, job_id)
        assert (job.state, job.attempt) == ("running", 1)  # its shim owns it: wait
    finally:
        slow_shim.kill()
        slow_shim.wait()
    eng.tick()
    job = job_row(sessions, job_id)
    assert (job.state, job.attempt) == ("lost", 1)
    assert job.reason == "its shim died while starting the job"


def test_a_claim_is_created_once_and_never_half_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = tmp_path / CLAIM_FILE
    assert create_json_exclusive(claim, {"by": "shim", "pid": 1})
    assert not create_json_exclusive(claim, {"by": "daemon", "pid": 2})
    assert json.loads(claim.read_text()) == {"by": "shim", "pid": 1}

    def disk_full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        create_json_exclusive(tmp_path / "other.json", {"by": "daemon"})
    assert [p.name for p in tmp_path.iterdir()] == [CLAIM_FILE]  # no temp file left


def test_a_claim_left_by_an_earlier_daemon_still_relaunches(
        setup: tuple[Engine, sessionmaker[Session], Clock, Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """That daemon claimed the attempt and died before recording the relaunch."""
    eng, sessions, clock, settings = setup
    job_id = submit(sessions, [sys.executable, "-c", "pass"])
    real_start = eng.backend.start

    def claimed_by_a_daemon_then_died(job: str, number: int, *_a: object, **_k: object) -> None:
        adir = attempt_dir(settings.jobs_dir, job, number)
        adir.mkdir(parents=True)
        (adir / CLAIM_FILE).write_text(json.dumps({"by": "daemon", "pid": 1}))
        raise RuntimeError("the daemon dies here")

    monkeypatch.setattr(eng.backend, "start", claimed_by_a_daemon_then_died)
    eng.tick()
    monkeypatch.setattr(eng.backend, "start", real_start)
    clock.now += 2 * LAUNCH_CONFIRM_S
    eng.tick()
    job = job_row(sessions, job_id)
    assert (job.state, job.attempt) == ("running", 2)
