"""Fault injection with real processes: the daemon SIGKILLed again and again, pids reused
by strangers, job trees that setsid and double-fork away, a flood of unreaped children,
a shim SIGKILLed under a live job. What each test proves is listed in
docs/reliability.md."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.formatting import iso
from supervisor.runtime.procfs import (
    create_time,
    is_same_process,
    is_started_at,
    parse_stat,
    read_stat,
    start_ticks_of,
)
from tests.helpers import PY, Daemon, exit_recorded, identity, job_module, python_job, wait_for

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("JOBSUP_FAULTS_SEED", "20240607"))
"""Seed of the kill schedule; set JOBSUP_FAULTS_SEED to replay another schedule."""

READOPT_S = 5.0
"""Seconds after a restarted daemon answers within which every live job is re-adopted."""

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


# -- /proc helpers ----------------------------------------------------------------------

def exists(pid: int, expected_create_time: float, start_ticks: int | None = None) -> bool:
    """This very process still has a /proc entry, zombie included (pid reuse excluded)."""
    stat = read_stat(pid)
    return stat is not None and is_started_at(stat, start_ticks, expected_create_time)


def proc_table() -> dict[int, tuple[str, int]]:
    """pid -> (state, ppid) for every process, one pass over /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                parsed = parse_stat(f.read())
        except OSError:
            continue
        if parsed is not None:
            table[int(entry.name)] = (parsed[0], parsed[1])
    return table


def zombies_of(parents: Iterable[int]) -> list[int]:
    wanted = set(parents)
    return sorted(pid for pid, (state, ppid) in proc_table().items()
                  if state == "Z" and ppid in wanted)


def read_pid_lines(path: Path) -> list[tuple[str, int, float]]:
    """Lines `KIND PID` a job wrote, with each process's create time read now."""
    out = []
    for line in path.read_text().split("\n"):
        if line.strip():
            kind, pid = line.split()
            ct = create_time(int(pid))
            assert ct is not None, f"{kind} {pid} already gone"
            out.append((kind, int(pid), ct))
    return out


# -- pid reuse on demand ----------------------------------------------------------------

PID_CYCLER = """
import os, sys, time
target, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if pid == target - 1:
        sys.exit(0)
sys.exit(1)
"""


def spawn_with_pid(target: int, argv: list[str], timeout_s: float = 60.0
                   ) -> subprocess.Popen[bytes] | None:
    """Start `argv` (in a session of its own: its pid is also its group and session id)
    as exactly pid `target`, which must be free. As root, through `ns_last_pid` (the
    kernel hands out last+1 next); otherwise by burning pids with forks until the
    counter sits just below `target`. None when it did not work out in time."""
    use_ns_last_pid = os.geteuid() == 0 and os.access(NS_LAST_PID, os.W_OK)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(f"/proc/{target}").exists():
            return None  # taken by someone else: not ours to reuse
        cursor = None
        if use_ns_last_pid:
            cursor = int(NS_LAST_PID.read_text())
            NS_LAST_PID.write_text(str(target - 1))
        else:
            left = deadline - time.monotonic()
            if subprocess.run([PY, "-c", PID_CYCLER, str(target), str(left)]).returncode:
                return None
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        if cursor is not None and cursor > target:  # give the pid counter back
            NS_LAST_PID.write_text(str(max(cursor, int(NS_LAST_PID.read_text()))))
        if proc.pid == target:
            return proc
        proc.kill()
        proc.wait()
    return None


@dataclass
class Stranger:
    """An unrelated process that records every catchable signal it receives."""

    proc: subprocess.Popen[bytes]
    create_time: float
    signal_log: Path

    @classmethod
    def at(cls, pid: int, tmp_path: Path, name: str) -> Stranger:
        log, ready = tmp_path / f"{name}.signals", tmp_path / f"{name}.ready"
        gone_by = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < gone_by:
            time.sleep(0.05)  # the old process may still wait to be reaped by init
        if Path(f"/proc/{pid}").exists():
            pytest.skip(f"pid {pid} was not released (init did not reap it)")
        proc = spawn_with_pid(pid, job_module("signal_recorder", log, ready))
        if proc is None:
            pytest.skip(f"could not get pid {pid} for a stranger process in time")
        try:
            wait_for(ready.exists, 10, what=f"stranger {name} ready")
        except AssertionError:
            proc.kill()
            proc.wait()
            raise
        ct = create_time(proc.pid)
        assert ct is not None
        return cls(proc, ct, log)

    def assert_untouched(self) -> None:
        assert self.proc.poll() is None, f"stranger {self.proc.pid} died ({self.proc.returncode})"
        assert is_same_process(self.proc.pid, self.create_time)
        received = self.signal_log.read_text() if self.signal_log.exists() else ""
        assert received == "", f"stranger {self.proc.pid} received signals {received.split()}"

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


# -- 1. the daemon SIGKILLed 20 times -----------------------------------------------------

@dataclass
class Submitter:
    """Submits a short job every ~0.5 s from its own thread and HTTP client, whether the
    daemon is up or not, recording what each submission got."""

    url: str
    pids_dir: Path
    rng: random.Random
    acked: dict[str, str] = field(default_factory=dict)  # name -> id (answered 201)
    unknown: list[str] = field(default_factory=list)  # names whose request failed midway
    refused: int = 0  # connection refused: the daemon was down
    answers: list[tuple[str, int, str]] = field(default_factory=list)  # non-201 answers
    errors: list[BaseException] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="submitter", daemon=True)

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=15) as client:
                n = 0
                while not self.stop.wait(self.rng.uniform(0.3, 0.7)):
                    n += 1
                    name = f"short-{n:03d}"
                    body = {"name": name, "command": job_module(
                        "pid_sleeper", self.pids_dir, f"{self.rng.uniform(0.2, 2.5):.2f}")}
                    try:
                        response = client.post("/api/v1/jobs", json=body)
                    except httpx.ConnectError:
                        self.refused += 1
                        continue
                    except httpx.TransportError:
                        self.unknown.append(name)
                        continue
                    if response.status_code == 201:
                        self.acked[name] = response.json()["id"]
                    else:
                        self.answers.append((name, response.status_code, response.text))
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)


def assert_readopted(daemon: Daemon, long_jobs: dict[str, tuple[int, int]],
                     seen_running: dict[str, tuple[int, float]], restarted_at: float) -> None:
    """Within READOPT_S: every long job `running` with its pid, the same process (create
    time), and sampled by this daemon (a sample since the restart, tree of shim + worker);
    every other job seen running before the kill is running with the same pid if its
    worker lives, else settled as succeeded from its exit file."""
    since = iso(restarted_at)

    def check() -> bool:
        jobs = {j["id"]: j for j in daemon.http.get("/api/v1/jobs").json()}
        for job_id, (pid, ticks) in long_jobs.items():
            job = jobs[job_id]
            assert job["state"] == "running", (job_id, job["state"], job["reason"])
            assert job["pid"] == pid and job["attempt"] == 1
            assert start_ticks_of(pid) == ticks, f"job {job_id}: pid {pid} is another process now"
            samples = daemon.http.get(f"/api/v1/jobs/{job_id}/samples",
                                      params={"since": since}).json()
            if not any(s["num_procs"] >= 2 for s in samples):
                return False
        for job_id, (pid, ct) in seen_running.items():
            job = jobs[job_id]
            assert job["pid"] == pid, (job_id, job["pid"], pid)
            if is_same_process(pid, ct):
                assert job["state"] in ("running", "succeeded"), (job_id, job["state"])
                if job["state"] != "running":
                    return False  # ended just now: look again
            elif job["state"] != "succeeded":
                assert job["state"] == "running", (job_id, job["state"], job["reason"])
                return False  # not settled yet
        return True

    wait_for(check, READOPT_S, interval=0.1,
             what=f"re-adoption after restart {daemon.starts}; log:\n{daemon.log()}")


def running_workers(daemon: Daemon, exclude: Iterable[str]) -> dict[str, tuple[int, float]]:
    """id -> (pid, create_time) of the jobs the daemon reports running with a live worker."""
    out = {}
    skip = set(exclude)
    for job in daemon.http.get("/api/v1/jobs", params={"state": "running"}).json():
        if job["id"] in skip or not job["pid"]:
            continue
        ct = create_time(job["pid"])
        if ct is not None:
            out[job["id"]] = (job["pid"], ct)
    return out


def db_check(db_path: Path) -> None:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
    db.close()


@pytest.mark.timeout(420)
def test_daemon_sigkilled_20_times_loses_nothing(make_daemon, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    daemon: Daemon = make_daemon()
    pids_dir, stop_file = tmp_path / "pids", tmp_path / "stop"
    pids_dir.mkdir()
    long_ids = []
    for n in range(5):
        out = tmp_path / f"out{n}"
        out.mkdir()
        job = daemon.submit(job_module("item_counter", out, pids_dir, stop_file),
                            name=f"long-{n}", output_dir=str(out), pattern="*.txt")
        long_ids.append(job["id"])
    wait_for(lambda: all(daemon.job(i)["pid"] for i in long_ids), 20, what="5 long jobs")
    long_jobs = {}
    for job_id in long_ids:
        pid, _, ticks = identity(daemon.data_dir, job_id, "worker.json")
        assert daemon.job(job_id)["pid"] == pid and start_ticks_of(pid) == ticks
        long_jobs[job_id] = (pid, ticks)

    submitter = Submitter(daemon.url, pids_dir, random.Random(SEED + 1))
    submitter.thread.start()
    startup_s, readopt_s = [], []
    try:
        for _ in range(20):
            time.sleep(rng.uniform(0.1, 1.5))
            seen_running = running_workers(daemon, exclude=long_jobs)
            daemon.kill()
            db_check(daemon.data_dir / "jobsup.db")
            time.sleep(rng.uniform(0.0, 0.5))  # short jobs end while no daemon runs
            restarted_at = time.time()
            t0 = time.monotonic()
            daemon.start()
            t1 = time.monotonic()
            assert_readopted(daemon, long_jobs, seen_running, restarted_at)
            startup_s.append(t1 - t0)
            readopt_s.append(time.monotonic() - t1)
    finally:
        submitter.stop.set()
        submitter.thread.join(20)
    print(f"seed {SEED}: daemon start {min(startup_s):.1f}-{max(startup_s):.1f} s, "
          f"re-adoption after it answered: max {max(readopt_s):.2f} s; submissions: "
          f"{len(submitter.acked)} acknowledged, {len(submitter.unknown)} cut off, "
          f"{submitter.refused} refused")
    assert not submitter.errors, submitter.errors
    assert submitter.answers == []  # every answer the daemon gave was a 201
    assert len(submitter.acked) >= 10

    # the short jobs all end (one killed between recording and starting its launch is
    # launched again after LAUNCH_CONFIRM_S); then the long ones are told to finish
    def all_short_ended() -> bool:
        jobs = daemon.http.get("/api/v1/jobs").json()
        return all(j["state"] in ("succeeded", "failed", "stopped", "lost")
                   for j in jobs if j["id"] not in long_jobs)

    wait_for(all_short_ended, 40, interval=0.2, what="every short job ended")
    stop_file.touch()
    for job_id in long_jobs:
        daemon.wait_state(job_id, "succeeded", timeout=20)
    jobs = {j["id"]: j for j in daemon.http.get("/api/v1/jobs").json()}
    daemon.stop()

    names = [j["name"] for j in jobs.values()]
    for name, job_id in submitter.acked.items():  # acknowledged means stored
        assert job_id in jobs and jobs[job_id]["name"] == name
    for name in submitter.unknown:  # a cut-off request created at most one job
        assert names.count(name) <= 1
    assert len(names) == len(set(names))
    relaunched = []
    for job_id, job in jobs.items():
        assert job["state"] == "succeeded", (job_id, job["state"], job["reason"])
        lines = (pids_dir / job_id).read_text().split()
        assert lines == [str(job["pid"])], f"job {job_id} started {len(lines)} times"
        job_dir = daemon.data_dir / "jobs" / job_id
        assert (job_dir / f"attempt-{job['attempt']}" / "worker.json").exists()
        for number in range(1, job["attempt"]):  # relaunched only if no shim had started
            assert not (job_dir / f"attempt-{number}" / "shim.json").exists()
            assert not (job_dir / f"attempt-{number}" / "worker.json").exists()
            relaunched.append(job_id)
    for job_id in long_jobs:
        job = jobs[job_id]
        assert job["attempt"] == 1 and job["restarts"] == 0
        files = len(list((tmp_path / f"out{long_ids.index(job_id)}").glob("*.txt")))
        assert job["progress"]["source"] == "progress_file"
        assert job["progress"]["items_done"] == files
    print(f"{len(relaunched)} job(s) relaunched after a kill mid-launch: {relaunched}")
    db_check(daemon.data_dir / "jobsup.db")
    with sqlite3.connect(f"file:{daemon.data_dir / 'jobsup.db'}?mode=ro", uri=True) as db:
        for job_id in long_jobs:
            (count,) = db.execute("SELECT count(*) FROM samples WHERE job_id = ?",
                                  (job_id,)).fetchone()
            assert count >= 20, f"job {job_id}: only {count} samples"
    db.close()


# -- 2. pid reuse while the daemon is down -------------------------------------------------

def _start_and_kill_daemon_under_job(make_daemon, code: str) -> tuple[Daemon, dict[str, Any],
                                                                      tuple[int, float],
                                                                      tuple[int, float]]:
    daemon: Daemon = make_daemon()
    job = daemon.submit(python_job(code), name="reused")
    wait_for(lambda: daemon.job(job["id"])["pid"], 15, what="worker pid")
    shim = identity(daemon.data_dir, job["id"], "shim.json")
    worker = identity(daemon.data_dir, job["id"], "worker.json")
    assert daemon.job(job["id"])["pid"] == worker[0]
    daemon.kill()
    return daemon, job, shim, worker


def _assert_strangers_survive_stops(daemon: Daemon, job_id: str,
                                    strangers: list[Stranger]) -> None:
    for _ in range(3):  # several ticks, each time asking for a stop
        answer = daemon.http.post(f"/api/v1/jobs/{job_id}/stop")
        assert answer.status_code == 409, answer.text
        daemon.wait_ticks(1)
    for stranger in strangers:
        stranger.assert_untouched()


@pytest.mark.timeout(180)
def test_job_ended_while_down_and_pids_reused_is_settled_from_its_exit_file(
        make_daemon, tmp_path: Path) -> None:
    flag = tmp_path / "go"
    daemon, job, shim, worker = _start_and_kill_daemon_under_job(
        make_daemon, f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): "
                     "time.sleep(0.05)\nsys.exit(3)")
    flag.touch()  # the job exits 3 while no daemon runs; its shim records it and exits
    status = daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "status.json"
    wait_for(lambda: exit_recorded(status), 10, what="the shim's exit file")
    strangers: list[Stranger] = []
    try:
        strangers.append(Stranger.at(worker[0], tmp_path, "worker-pid"))
        strangers.append(Stranger.at(shim[0], tmp_path, "shim-pid"))
        assert os.getpgid(worker[0]) == worker[0]  # the old job's group id is live again
        daemon.start()
        done = daemon.wait_state(job["id"], "failed", timeout=5)
        assert (done["exit_code"], done["exit_reason"]) == (3, "exit")
        assert done["pid"] == worker[0]
        _assert_strangers_survive_stops(daemon, job["id"], strangers)
    finally:
        for stranger in strangers:
            stranger.end()


@pytest.mark.timeout(180)
def test_job_vanished_while_down_and_pids_reused_is_lost(make_daemon, tmp_path: Path) -> None:
    daemon, job, shim, worker = _start_and_kill_daemon_under_job(
        make_daemon, "import time; time.sleep(600)")
    os.kill(shim[0], signal.SIGKILL)  # shim first, so no exit status gets written
    wait_for(lambda: not is_same_process(*shim), 5, what="shim gone")
    os.killpg(worker[0], signal.SIGKILL)
    strangers: list[Stranger] = []
    try:
        strangers.append(Stranger.at(shim[0], tmp_path, "shim-pid"))
        strangers.append(Stranger.at(worker[0], tmp_path, "worker-pid"))
        assert not exit_recorded(daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "status.json")
        daemon.start()
        done = daemon.wait_state(job["id"], "lost", timeout=5)
        assert done["exit_reason"] == "lost" and done["exit_code"] is None
        _assert_strangers_survive_stops(daemon, job["id"], strangers)
    finally:
        for stranger in strangers:
            stranger.end()


# -- 3. a whole tree is stopped ------------------------------------------------------------

TREE_JOB = """
import os, signal, subprocess, sys, time
record = sys.argv[1]
def note(kind):
    with open(record, "a") as f:
        f.write(f"{kind} {os.getpid()}\\n")
note("worker")
if os.fork() == 0:  # a child in the job's group, parent of a setsid grandchild
    note("child")
    subprocess.Popen([sys.executable, "-c", sys.argv[2], record], start_new_session=True)
    while True:
        time.sleep(1)
pid = os.fork()
if pid == 0:  # the classic double-forked daemon: new session, middle one exits
    os.setsid()
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        note("daemon")
        while True:
            time.sleep(1)
    os._exit(0)
os.waitpid(pid, 0)
while True:
    time.sleep(1)
"""

SETSID_GRANDCHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as f:
    f.write(f"setsid-grandchild {os.getpid()}\\n")
# and one more level, in a session of its own too: re-parented only when we die
subprocess.Popen([sys.executable, "-c",
                  "import os, signal, sys, time\\n"
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                  "open(sys.argv[1], 'a').write(f'great-grandchild {os.getpid()}\\\\n')\\n"
                  "time.sleep(600)", sys.argv[1]], start_new_session=True)
while True:
    time.sleep(1)
"""


@pytest.mark.timeout(120)
def test_stop_leaves_no_process_of_a_tree_that_escaped_its_group(
        make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    record = tmp_path / "tree"
    job = daemon.submit([PY, "-c", TREE_JOB, str(record), SETSID_GRANDCHILD], name="tree",
                        stop_grace_s=1)
    kinds = {"worker", "child", "daemon", "setsid-grandchild", "great-grandchild"}
    wait_for(lambda: record.exists() and {line.split()[0] for line in
                                          record.read_text().split("\n") if line} == kinds,
             15, what="the whole tree started")
    tree = read_pid_lines(record)
    try:
        shim = identity(daemon.data_dir, job["id"], "shim.json")
        worker_pid = dict((k, p) for k, p, _ in tree)["worker"]
        sessions = {os.getsid(pid) for _, pid, _ in tree}
        assert len(sessions) == 4  # the group's, the daemon's, and two setsid ones
        wait_for(lambda: daemon.job(job["id"])["resources"]["num_procs"] >= 6, 15,
                 what="the sampler sees shim + 5 processes: the tree hangs off the shim")

        answer = daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
        assert answer.status_code == 202
        done = daemon.wait_state(job["id"], "stopped", timeout=20)
        assert done["pid"] == worker_pid and done["signal"] == signal.SIGTERM
        # nothing left, not even a zombie; the shim is gone too (reaped by the daemon)
        wait_for(lambda: not any(exists(pid, ct) for _, pid, ct in tree), 5,
                 what=f"no process of {tree}")
        wait_for(lambda: not exists(*shim), 5, what="the shim reaped")
    finally:  # if it failed: what escaped must not outlive the test
        for _, pid, ct in tree:
            if is_same_process(pid, ct):
                os.kill(pid, signal.SIGKILL)


# -- 4. no zombies ---------------------------------------------------------------------------

ZOMBIE_JOB = """
import os, subprocess, sys, time
record, flag = sys.argv[1:3]
kept = [subprocess.Popen(["true"]) for _ in range(100)]  # never waited on
orphans = []
for i in range(20):  # double-forked: the middle one exits, the last is orphaned
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(0.02 * i)
            while i % 4 == 0 and not os.path.exists(flag):  # 5 of them live on
                time.sleep(0.05)
            os._exit(0)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    orphans.append(int(os.read(r, 32)))
    os.close(r)
    os.waitpid(pid, 0)
with open(record, "w") as f:
    f.write(" ".join(str(p.pid) for p in kept) + "\\n" + " ".join(map(str, orphans)) + "\\n")
while not os.path.exists(flag):
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_children_never_waited_for_leave_no_zombie(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    record, flag = tmp_path / "children", tmp_path / "go"
    job = daemon.submit([PY, "-c", ZOMBIE_JOB, str(record), str(flag)], name="spawner")
    wait_for(lambda: record.exists() and record.read_text().count("\n") == 2, 30,
             what="120 children spawned")
    try:
        _check_no_zombies(daemon, job["id"], record, flag)
    finally:
        flag.touch()  # if it failed: the long-lived orphans end


def _check_no_zombies(daemon: Daemon, job_id: str, record: Path, flag: Path) -> None:
    shim = identity(daemon.data_dir, job_id, "shim.json")
    worker = identity(daemon.data_dir, job_id, "worker.json")
    kept, orphans = (list(map(int, line.split())) for line in record.read_text().split("\n")[:2])
    assert len(kept) == 100 and len(orphans) == 20

    living = {pid for i, pid in enumerate(orphans) if i % 4 == 0}
    left: list[int] = []

    def short_lived_gone() -> bool:  # exited (after 0.4 s at most) and reaped
        left[:] = [pid for pid in orphans if pid in proc_table()]
        return set(left) == living

    wait_for(short_lived_gone, 15,
             what=lambda: f"only the 5 long-lived orphans left; left: {sorted(left)}, "
                          f"long-lived: {sorted(living)}")
    table = proc_table()
    assert all(table[pid][1] == shim[0] for pid in living)  # the shim is their subreaper
    for _ in range(5):  # while the job runs: the shim reaps every orphan at once
        assert zombies_of([shim[0]]) == []
        time.sleep(0.1)
    assert is_same_process(*worker)
    # children the worker itself never waits for are its own zombies: only it (or its
    # exit) can clear them. They are here, which shows the scan sees zombies at all.
    wait_for(lambda: set(zombies_of([worker[0]])) == set(kept), 10,
             what="the worker's 100 unreaped children seen as zombies")

    flag.touch()  # the worker exits without waiting: its 100 zombies pass to the shim
    daemon.wait_state(job_id, "succeeded", timeout=15)
    wait_for(lambda: not exists(*shim), 5, what="the shim reaped by the daemon")
    table = proc_table()
    assert not exists(*worker)
    assert [pid for pid, (_, ppid) in table.items() if ppid in (shim[0], worker[0])] == []
    assert zombies_of([daemon.proc.pid]) == []


# -- 5. the shim SIGKILLed under a live job -----------------------------------------------

SHIMLESS_JOB = """
import os, signal, subprocess, sys, time
if sys.argv[2] == "worker-ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time\\n"
if sys.argv[2] == "child-ignores":
    code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(600)"])
with open(sys.argv[1], "w") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
while True:
    time.sleep(0.2)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_sigterm", ["exit", "worker-ignores", "child-ignores"])
def test_job_whose_shim_was_sigkilled_runs_on_and_stops(make_daemon, tmp_path: Path,
                                                         on_sigterm: str) -> None:
    daemon: Daemon = make_daemon()
    record = tmp_path / "pids"
    job = daemon.submit([PY, "-c", SHIMLESS_JOB, str(record), on_sigterm], name="shimless",
                        stop_grace_s=1)
    wait_for(lambda: record.exists() and record.read_text().endswith("\n"), 15,
             what="worker and child started")
    worker_pid, child_pid = map(int, record.read_text().split())
    worker = (worker_pid, create_time(worker_pid))
    child = (child_pid, create_time(child_pid))
    shim = identity(daemon.data_dir, job["id"], "shim.json")
    recorded = identity(daemon.data_dir, job["id"], "worker.json")
    assert (recorded.pid, recorded.start_ticks) == (worker_pid, start_ticks_of(worker_pid))

    os.kill(shim[0], signal.SIGKILL)
    wait_for(lambda: not is_same_process(*shim), 5, what="shim gone")
    daemon.wait_ticks(3)  # the job is still running, still supervised
    current = daemon.job(job["id"])
    assert current["state"] == "running" and current["pid"] == worker_pid, current
    assert is_same_process(*worker) and is_same_process(*child)
    resources: list[dict] = []

    def sampled_from_the_worker() -> bool:  # its 2 processes, the dead shim not among them
        resources.append(daemon.job(job["id"])["resources"])
        return bool(resources[-1]["num_procs"] == 2)

    wait_for(sampled_from_the_worker, 15,
             what=lambda: f"a sample of the worker's 2 processes; last: {resources[-1]}")

    t0 = time.monotonic()
    assert daemon.http.post(f"/api/v1/jobs/{job['id']}/stop").status_code == 202
    # the daemon signals the worker's group itself: SIGTERM, and when anything of the
    # group ignores it (the worker, or a child that outlives it) SIGKILL once
    # stop_grace_s + STOP_BACKSTOP_S (1 + 5 s) have passed
    try:
        wait_for(lambda: not is_same_process(*worker) and not is_same_process(*child), 15,
                 what="worker group gone")
    finally:
        if is_same_process(*child):
            os.kill(child[0], signal.SIGKILL)  # no leak into other tests if it failed
    took = time.monotonic() - t0
    assert took < 4 if on_sigterm == "exit" else 5.5 < took < 10
    done = daemon.wait_state(job["id"], "stopped", "lost", timeout=5)
    assert done["pid"] == worker_pid
    assert done["state"] == "stopped", done["reason"]  # asked for, even if unrecorded
    assert done["exit_reason"] == "stopped" and "exit status unknown" in done["reason"]

