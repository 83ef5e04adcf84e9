"""One run per attempt when a running job's directory vanishes (#46): `DATA_DIR/jobs/ID`
deleted (`rm -rf`, a tmp cleaner), moved away (`mv`) or emptied (its files deleted, its
directories kept) while the job runs. A `restart_policy: never` job ran its command a
second time: once its shim ended, the daemon found no `worker.json` and no claim, took
the launch for one cut short and launched it again, although its row held the worker's
pid. Now the job is supervised through the pids the database holds, its shim records
the exit in a directory it makes again, and what cannot be known ends `lost`, never
launched again. A real daemon, real shims and workers; each job's command appends a
line to a file outside the data dir each time it starts (`tests/jobs/counted_run.py`)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.api.submission import submit_job
from supervisor.runtime import files
from supervisor.runtime.files import attempt_dir
from supervisor.runtime.procfs import is_same_process
from supervisor.runtime.shim import STATUS_FILE, reserve_status, write_status
from supervisor.spec import JobSpec
from tests.helpers import (
    Daemon,
    Recorded,
    identity,
    in_process_engine,
    job_module,
    job_row,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def remove(jdir: Path, away: Path) -> None:
    shutil.rmtree(jdir)


def move(jdir: Path, away: Path) -> None:
    away.mkdir(exist_ok=True)
    jdir.rename(away / jdir.name)


def empty(jdir: Path, away: Path) -> None:
    for path in sorted(jdir.rglob("*"), reverse=True):
        if not path.is_dir():
            path.unlink()
    assert (jdir / "attempt-1").is_dir() and not any(
        path.is_file() for path in jdir.rglob("*"))


VANISH: dict[str, Callable[[Path, Path], None]] = {
    "removed": remove, "moved": move, "emptied": empty}
"""How a running job's directory vanishes: `rm -rf`, `mv` elsewhere, its files deleted."""


@pytest.fixture
def workers() -> Iterator[list[Recorded]]:
    """Workers a test made: a worker whose shim is dead and whose directory is gone is
    found by no teardown (`kill_jobs_of` looks for shims and attempt files): its group is
    SIGKILLed here while it is still the recorded process."""
    made: list[Recorded] = []
    yield made
    for worker in made:
        if is_same_process(worker.pid, worker.create_time, worker.start_ticks):
            os.killpg(worker.pid, signal.SIGKILL)


def runs_of(runs: Path, job_id: str) -> int:
    """How many times the job's command has started."""
    try:
        return len((runs / job_id).read_text().splitlines())
    except FileNotFoundError:
        return 0


def start_jobs(daemon: Daemon, tmp_path: Path, workers: list[Recorded],
               *names: str) -> tuple[Path, dict[str, dict[str, object]]]:
    """Submit a counted job per name (`restart_policy: never`), each exiting 3 once
    `tmp_path/release-NAME` exists; wait until each worker's pid is in the database."""
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    jobs = {name: daemon.submit(job_module("counted_run", runs, tmp_path / f"release-{name}",
                                           3), name=name, restart_policy="never")
            for name in names}
    for name, job in jobs.items():
        job_id = str(job["id"])
        job["pid"] = wait_for(lambda j=job_id: daemon.job(j)["pid"], 20,
                              what=f"{name}'s worker recorded")
        assert runs_of(runs, job_id) == 1
        job["shim"] = identity(daemon.data_dir, job_id, "shim.json")
        worker = identity(daemon.data_dir, job_id, "worker.json")
        assert worker.pid == job["pid"]
        workers.append(worker)
    return runs, jobs


def assert_runs_once(daemon: Daemon, runs: Path, jobs: dict[str, dict[str, object]],
                     state: str = "running") -> None:
    """Each job still in `state`, attempt 1, with its first worker, run once; never
    `pending` on its way ("launching again")."""
    for name, job in jobs.items():
        job_id = str(job["id"])
        now = daemon.job(job_id)
        assert (name, now["state"], now["attempt"]) == (name, state, 1), now
        if state == "running":
            assert now["pid"] == job["pid"]
        assert runs_of(runs, job_id) == 1, f"{name} ran {runs_of(runs, job_id)} times"
        assert [event["to_state"] for event in daemon.events(job_id)] == [
            "pending", "running", *([] if state == "running" else [state])], \
            daemon.events(job_id)


def gone(pid: object) -> bool:
    """No such process, or only its zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def end_both(daemon: Daemon, tmp_path: Path, runs: Path, jobs: dict[str, dict[str, object]],
             stopped_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job `ends` released to exit 3 and the job `stopped_name` stopped: their end
    states, each after the job ran once, and every worker gone."""
    (tmp_path / "release-ends").touch()
    ended = daemon.wait_state(str(jobs["ends"]["id"]), "failed", "lost", "pending")
    daemon.http.post(f"/api/v1/jobs/{jobs[stopped_name]['id']}/stop")
    stopped = daemon.wait_state(str(jobs[stopped_name]["id"]), "stopped", "lost", "pending")
    daemon.wait_ticks(4)
    assert_runs_once(daemon, runs, {"ends": jobs["ends"]}, "failed")
    assert_runs_once(daemon, runs, {stopped_name: jobs[stopped_name]}, "stopped")
    assert all(gone(job["pid"]) for job in jobs.values())
    return ended, stopped


@pytest.mark.parametrize("how", VANISH)
def test_a_job_whose_dir_vanished_runs_once_and_ends_as_it_ended(
        make_daemon: Callable[..., Daemon], tmp_path: Path, workers: list[Recorded],
        how: str) -> None:
    """Its shim lives on: the job keeps running under it, its exit is recorded in the
    directory the shim makes again (`failed`, exit 3, not `lost`), and a stop reaches it."""
    daemon = make_daemon()
    runs, jobs = start_jobs(daemon, tmp_path, workers, "ends", "stopped")
    for job in jobs.values():
        VANISH[how](daemon.data_dir / "jobs" / str(job["id"]), tmp_path / "away")
    daemon.wait_ticks(4)
    assert_runs_once(daemon, runs, jobs)

    ended, stopped = end_both(daemon, tmp_path, runs, jobs, "stopped")
    assert (ended["state"], ended["exit_code"], ended["reason"]) == (
        "failed", 3, "exited with code 3"), ended
    assert (stopped["state"], stopped["exit_reason"]) == ("stopped", "stopped"), stopped


@pytest.mark.parametrize("how", VANISH)
def test_a_job_whose_dir_vanished_and_whose_shim_died_is_watched_through_its_pid(
        make_daemon: Callable[..., Daemon], tmp_path: Path, workers: list[Recorded],
        how: str) -> None:
    """No shim and no files left, only the pids in the database: the worker is watched
    and stopped through them (its group SIGTERMed, its identity checked by start ticks);
    one that ends with no one to record its exit is `lost`, in words."""
    daemon = make_daemon()
    runs, jobs = start_jobs(daemon, tmp_path, workers, "ends", "stopped")
    for job in jobs.values():
        VANISH[how](daemon.data_dir / "jobs" / str(job["id"]), tmp_path / "away")
        shim = job["shim"]
        assert isinstance(shim, Recorded)
        os.kill(shim.pid, signal.SIGKILL)
    daemon.wait_ticks(4)
    assert_runs_once(daemon, runs, jobs)

    daemon.http.post(f"/api/v1/jobs/{jobs['stopped']['id']}/stop")
    stopped = daemon.wait_state(str(jobs["stopped"]["id"]), "stopped", "lost", "pending")
    assert (stopped["state"], stopped["exit_reason"]) == ("stopped", "stopped"), stopped
    assert "exit status unknown" in stopped["reason"]
    assert gone(jobs["stopped"]["pid"])
    (tmp_path / "release-ends").touch()
    lost = daemon.wait_state(str(jobs["ends"]["id"]), "lost", "failed", "pending")
    assert (lost["state"], lost["exit_reason"]) == ("lost", "lost"), lost
    assert "exit status unknown" in lost["reason"] and "directory" in lost["reason"], lost
    daemon.wait_ticks(4)
    assert_runs_once(daemon, runs, {"ends": jobs["ends"]}, "lost")
    assert_runs_once(daemon, runs, {"stopped": jobs["stopped"]}, "stopped")


def test_a_daemon_started_while_a_running_jobs_dir_is_missing_adopts_it_by_its_pids(
        make_daemon: Callable[..., Daemon], tmp_path: Path, workers: list[Recorded]) -> None:
    """The directories removed while no daemon ran, one job's shim killed too: the new
    daemon re-adopts both through the database's pids and runs neither again."""
    daemon = make_daemon()
    runs, jobs = start_jobs(daemon, tmp_path, workers, "ends", "orphan")
    daemon.kill()
    for job in jobs.values():
        shutil.rmtree(daemon.data_dir / "jobs" / str(job["id"]))
    orphan_shim = jobs["orphan"]["shim"]
    assert isinstance(orphan_shim, Recorded)
    os.kill(orphan_shim.pid, signal.SIGKILL)
    time.sleep(0.2)
    daemon.start()
    daemon.wait_ticks(4)
    assert_runs_once(daemon, runs, jobs)

    ended, stopped = end_both(daemon, tmp_path, runs, jobs, "orphan")
    assert (ended["state"], ended["exit_code"]) == ("failed", 3), ended
    assert (stopped["state"], stopped["exit_reason"]) == ("stopped", "stopped"), stopped


def test_a_shim_dead_before_its_worker_was_recorded_is_lost_never_run_again(
        tmp_path: Path, workers: list[Recorded]) -> None:
    """The narrowest case: the shim started the worker and wrote `worker.json`, the
    daemon has not read it yet (it records the worker at its next tick), then the job's
    directory is emptied and the shim dies. Nothing the daemon can read says a worker
    ran, but a started shim had its `launch.json`, now gone with the rest: `lost`, not
    settled as a launch cut short (which claimed the empty directory and ran the job a
    second time). The unknown worker is left alone: nothing recorded ties it to the job."""
    with in_process_engine(tmp_path / "data") as (eng, sessions):
        runs = tmp_path / "runs"
        runs.mkdir()
        with sessions() as session:
            job, _ = submit_job(session, JobSpec(name="once", command=job_module(
                "counted_run", runs, tmp_path / "release")), default_cwd=str(Path.cwd()),
                views={})
            session.commit()
            job_id = job.id
        eng.tick()  # launched: the shim's pid recorded, its worker's not yet
        adir = attempt_dir(eng.settings.jobs_dir, job_id, 1)
        wait_for(lambda: runs_of(runs, job_id) == 1 and (adir / files.WORKER).exists(), 20,
                 what="the worker started and recorded by its shim")
        shim = identity(eng.settings.data_dir, job_id, "shim.json")
        workers.append(identity(eng.settings.data_dir, job_id, "worker.json"))
        assert job_row(sessions, job_id).pid is None
        empty(eng.settings.jobs_dir / job_id, tmp_path / "away")
        os.kill(shim.pid, signal.SIGKILL)
        wait_for(lambda: gone(shim.pid), 10, what="the shim's death")
        eng.tick()
        eng.tick()
        row = job_row(sessions, job_id)
        assert (row.state, row.attempt, row.exit_reason) == ("lost", 1, "lost")
        assert row.reason == ("its shim ended and its attempt directory was deleted, moved "
                              "or emptied: whether it started the job is unknown, so it is "
                              "not launched again")
        assert runs_of(runs, job_id) == 1


def test_the_shim_records_the_exit_where_its_directory_was_removed(tmp_path: Path) -> None:
    """`status.json` reserved, then the whole job directory removed: the exit is written
    into the directory made again, where the daemon reads it."""
    adir = tmp_path / "jobs" / "j" / "attempt-1"
    adir.mkdir(parents=True)
    reserve_status(adir / STATUS_FILE)
    shutil.rmtree(tmp_path / "jobs" / "j")
    write_status(adir / STATUS_FILE, files.Status(
        pid=1, exit_code=3, signal=None, ended_at=time.time(), stop_requested=False,
        killed_after_grace=False, max_rss_bytes=0, spawn_error=None, oom_kills=None))
    recorded = files.read_exit(adir)
    assert recorded is not None and recorded.exit_code == 3
