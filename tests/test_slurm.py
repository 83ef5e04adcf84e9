"""The `slurm` backend against a real one-node SLURM cluster on loopback
(`tests/slurm_cluster.py`: munged, slurmctld, slurmd), driven through a real daemon:
sbatch, squeue, scontrol and scancel do what they do on a cluster, the shim runs inside
the allocation, and nothing is mocked. Without Debian's slurm-wlm and munge these tests
fail (`./dev.sh test` installs them); they never skip.

SLURM's smallest time limit is one minute, checked every 30 s by slurmctld, so the
TIMEOUT case takes 60-90 s: its job is submitted when the module's daemon starts and
is checked by the module's last test, while the others run."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from supervisor.backends.slurm import SlurmBackend
from supervisor.backends.slurm_jobs import SlurmJob, end_of, sbatch_argv
from supervisor.backends.slurm_query import SLURM_FILE
from supervisor.runtime import files
from supervisor.runtime.fileio import read_json
from supervisor.runtime.files import attempt_dir
from supervisor.runtime.rank import rank_environment
from supervisor.spec import ExitReason, JobSpec
from tests.helpers import PY, Daemon, python_job, wait_for
from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def daemon(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon whose default backend is `slurm`, shared by the module's tests."""
    d = Daemon(tmp_path_factory.mktemp("slurm") / "data", {"JOBSUP_BACKEND": "slurm"}).start()
    try:
        yield d
    finally:
        d.shut_down()


@pytest.fixture(scope="module")
def over_time(daemon: Daemon) -> dict[str, Any]:
    """A job past its one-minute time limit, submitted first (see the module docstring)."""
    return daemon.submit(python_job("import time; time.sleep(600)"), name="over-time",
                         slurm={"time": "1"})


def slurm_id(daemon: Daemon, job: dict[str, Any]) -> str:
    data = wait_for(lambda: read_json(attempt_dir(daemon.data_dir / "jobs", job["id"],
                                                  job["attempt"] or 1) / SLURM_FILE),
                    10, what="slurm.json")
    return str(data["job_id"])


def test_a_job_runs_in_the_allocation_and_succeeds(daemon: Daemon, over_time: dict[str, Any],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = daemon.submit(python_job(
        "import os; print('inside', os.environ['SLURM_JOB_ID'], flush=True);"
        f"open({str(out)!r}, 'w').write(os.environ['JOBSUP_JOB_ID'])"), name="ok")
    assert job["spec"]["backend"] == "slurm"  # the daemon's default (JOBSUP_BACKEND), stored
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=30)
    assert (done["state"], done["exit_code"], done["exit_reason"]) == ("succeeded", 0, "exit")
    assert out.read_text() == job["id"]
    assert f"inside {slurm_id(daemon, job)}" in daemon.logs(job["id"])


def test_a_local_job_beside_them_runs_on_the_daemons_machine(daemon: Daemon) -> None:
    job = daemon.submit(python_job("import os; print('in slurm' if 'SLURM_JOB_ID' in "
                                   "os.environ else 'on the daemon machine')"),
                        name="here", backend="local")
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=15)
    assert (done["state"], done["spec"]["backend"]) == ("succeeded", "local")
    assert "on the daemon machine" in daemon.logs(job["id"])
    adir = attempt_dir(daemon.data_dir / "jobs", job["id"], 1)
    assert not (adir / SLURM_FILE).exists()


def test_a_failing_job_fails_with_its_exit_code(daemon: Daemon) -> None:
    job = daemon.submit(python_job("import sys; print('bad input'); sys.exit(3)"), name="bad")
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=30)
    assert (done["state"], done["exit_code"], done["exit_reason"]) == ("failed", 3, "exit")
    assert done["reason"] == "exited with code 3"


def test_jobsup_submit_takes_the_slurm_section(daemon: Daemon, cluster: SlurmCluster) -> None:
    done = subprocess.run(
        [PY, "-m", "supervisor", "submit", "--url", daemon.url, "--name", "from-cli",
         "--backend", "slurm", "--slurm", "cpus_per_task=2", "--slurm", "time=5",
         "--slurm", "extra=--comment=from-the-cli", "--wait", "--json", "--", PY, "-c",
         "print('hello')"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = daemon.job(json.loads(done.stdout)["id"])
    assert job["spec"]["slurm"]["cpus_per_task"] == 2
    state = cluster.state_of(slurm_id(daemon, job))
    assert (state["NumCPUs"], state["TimeLimit"], state["Comment"]) == \
        ("2", "00:05:00", "from-the-cli")


def test_a_job_sbatch_refuses_fails_saying_why(daemon: Daemon) -> None:
    job = daemon.submit(python_job("print('never')"), name="nowhere",
                        slurm={"partition": "nope"})
    done = daemon.wait_state(job["id"], "failed", "succeeded", "lost", timeout=15)
    assert (done["state"], done["exit_reason"]) == ("failed", "exit")
    assert done["reason"].startswith("could not start the job's shim: sbatch refused the job:")
    assert "invalid partition" in done["reason"].lower()


def test_a_pending_job_shows_the_schedulers_reason_and_stops(daemon: Daemon,
                                                             cluster: SlurmCluster) -> None:
    job = daemon.submit(python_job("print('never')"), name="later",
                        slurm={"extra": ["--begin=now+1hour"]})
    queued = wait_for(lambda: (j := daemon.job(job["id"]))["reason"] and
                      "queued in SLURM" in j["reason"] and j, 15, what="the queue's reason")
    sid = slurm_id(daemon, job)
    assert queued["state"] == "running"
    assert queued["reason"] == (f"queued in SLURM (job {sid}): BeginTime, its start time has "
                                "not come")
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    done = daemon.wait_state(job["id"], "stopped", "failed", "lost", timeout=15)
    assert (done["state"], done["exit_reason"]) == ("stopped", "stopped")
    assert cluster.state_of(sid)["JobState"] == "CANCELLED"


STALL_S = 8
"""The held job's stall window: wide enough for a loaded machine (the shim publishes its
readings every tick; the job's first item must reach the daemon within the window)."""


def test_time_in_the_queue_is_no_stall_and_the_run_gets_the_whole_window(
        daemon: Daemon, cluster: SlurmCluster) -> None:
    """Held in SLURM's queue (`--hold`) for twice its 8 s stall window: no alert. Once
    released, its stall clock starts at its start: a quiet second before its first item
    and its items are no stall (counted from the submission, they would be), its rate is
    its run's alone, and the hang after its last item fires `stalled`."""
    job = daemon.submit(python_job(
        "import json, os, time\n"
        "print('up', flush=True); time.sleep(1)\n"
        "path = os.environ['JOBSUP_PROGRESS_FILE']\n"
        "for i in range(1, 11):\n"
        "    open(path + '.tmp', 'w').write(json.dumps({'done': i, 'total': 1000}))\n"
        "    os.replace(path + '.tmp', path); time.sleep(0.2)\n"
        "time.sleep(600)"), name="held", stall_timeout_s=STALL_S,
        slurm={"extra": ["--hold"]})
    sid = slurm_id(daemon, job)
    wait_for(lambda: "JobHeldUser" in (daemon.job(job["id"])["reason"] or ""), 15,
             what="the job held in the queue")
    queued_until = time.monotonic() + 2 * STALL_S
    while time.monotonic() < queued_until:
        held = daemon.job(job["id"])
        assert held["alerts"] == [], held
        time.sleep(0.2)
    assert "queued in SLURM" in held["reason"] and held["forecast"]["eta_s"] is None
    cluster.run("scontrol", "release", sid)

    def ten_items() -> dict[str, Any] | None:
        running = daemon.job(job["id"])
        assert running["alerts"] == [], running  # within its window since its start
        return running if running["progress"]["items_done"] == 10 else None

    running = wait_for(ten_items, 40, what="its ten items")
    rate = running["forecast"]["rate_items_per_s"]
    assert rate is not None and rate > 2.0, running["forecast"]  # ~5/s; the queue not in it
    stalled = wait_for(lambda: daemon.job(job["id"])["alerts"], STALL_S + 20, what="the stall")
    assert [a["rule"] for a in stalled] == ["stalled"]
    assert "no new item" in stalled[0]["message"] and "at 10 items" in stalled[0]["message"]
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    daemon.wait_state(job["id"], "stopped", "failed", "lost", timeout=20)


def test_the_backend_says_when_a_queued_job_began_running(cluster: SlurmCluster,
                                                          tmp_path: Path) -> None:
    """`SlurmBackend.queued` and `running_since`, against the cluster: held, the job is
    queued and has no start; released, its start is its worker's (`worker.json`, on the
    daemon's clock: here 100 s ahead of the system's), also for a backend that never saw
    it queued (a daemon restarted meanwhile)."""
    backend = SlurmBackend(tmp_path / "jobs")
    spec = JobSpec.model_validate({"name": "held", "command": [PY, "-c", "import time; "
                                                               "time.sleep(600)"],
                                   "slurm": {"extra": ["--hold"]}})
    attempt = backend.start("queued1", 1, spec, cwd=str(tmp_path), stop_grace_s=5)
    sid = backend.slurm_id(attempt)
    assert sid is not None
    try:
        assert wait_for(lambda: backend.reap() or backend.queued(attempt), 15,
                        what="the job queued")
        assert backend.running_since(attempt, time.time()) is None
        cluster.run("scontrol", "release", sid)
        worker = wait_for(lambda: files.read_worker(attempt.dir), 30, what="its worker")
        backend.reap()
        restarted = SlurmBackend(tmp_path / "jobs")
        for seen_by in (backend, restarted):
            assert not seen_by.queued(attempt)
            since = seen_by.running_since(attempt, time.time() + 100)
            assert since is not None and abs(since - (worker.started_at + 100)) < 1.0
    finally:
        cluster.run("scancel", sid, check=False)


def test_a_stop_runs_the_jobs_grace_inside_the_allocation(daemon: Daemon, cluster: SlurmCluster,
                                                          tmp_path: Path) -> None:
    marker = tmp_path / "term.txt"
    job = daemon.submit(python_job(
        "import signal, sys, time\n"
        "def term(*_):\n"
        f"    open({str(marker)!r}, 'w').write('SIGTERM'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "print('up', flush=True)\n"
        "time.sleep(600)"), name="stoppable", stop_grace_s=20)
    wait_for(lambda: "up" in daemon.logs(job["id"]), 30, what="the job's first line")
    # its processes, read by its shim in the allocation and published (observed.jsonl)
    seen = wait_for(lambda: (r := daemon.job(job["id"])["resources"])["num_procs"] >= 1
                    and r, 15, what="the shim's readings")
    assert seen["node"] == cluster.host and seen["rss_bytes"] > 0
    assert seen["scheduler_job_id"] == slurm_id(daemon, job)
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    done = daemon.wait_state(job["id"], "stopped", "failed", "lost", timeout=15)
    assert (done["state"], done["exit_reason"]) == ("stopped", "stopped")
    assert done["reason"] == "stopped on request (SIGTERM)"
    assert marker.read_text() == "SIGTERM"  # the worker got its SIGTERM, not a SIGKILL


def test_an_outside_scancel_is_recorded_as_such(daemon: Daemon, cluster: SlurmCluster) -> None:
    job = daemon.submit(python_job("import time; print('up', flush=True); time.sleep(600)"),
                        name="cancelled", restart_policy="on-failure", max_restarts=3)
    wait_for(lambda: "up" in daemon.logs(job["id"]), 30, what="the job's first line")
    cluster.run("scancel", slurm_id(daemon, job))
    done = daemon.wait_state(job["id"], "stopped", "failed", "lost", "pending", timeout=20)
    sid = slurm_id(daemon, job)
    assert (done["state"], done["exit_reason"]) == ("stopped", "cancelled")  # no restart
    assert done["reason"] == (f"SLURM job {sid} cancelled by someone outside jobsup (who is "
                              "recorded only with SLURM accounting, sacct)")


def test_a_two_rank_job_with_one_failing_rank_names_it(daemon: Daemon,
                                                        cluster: SlurmCluster) -> None:
    job = daemon.submit(python_job(
        "import os, sys, time\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', "
        "'JOBSUP_JOB_ID')\n"
        "print(' '.join(f'{k}={os.environ[k]}' for k in keys), flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(1); sys.exit(3)\n"
        "time.sleep(600)"), name="two-ranks", slurm={"tasks_per_node": 2})
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=40)
    log = daemon.logs(job["id"])
    # the job's exit code is srun's: the highest of its tasks', here rank 0's SIGTERM
    # (128 + 15) after --kill-on-bad-exit ended it; the reason names the rank that failed
    assert (done["state"], done["exit_code"], done["exit_reason"]) == ("failed", 143, "exit"), log
    assert done["reason"] == (f"exited with code 143 — rank 1 ({cluster.host}) failed first: "
                              "Exited with exit code 3")
    port = 20000 + int(slurm_id(daemon, job)) % 20000
    for rank in (0, 1):
        assert (f"RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank} MASTER_ADDR={cluster.host} "
                f"MASTER_PORT={port} JOBSUP_JOB_ID={job['id']}") in log  # the job's env too


@pytest.mark.parametrize("database_lost", [False, True], ids=["restart", "database-lost"])
def test_a_restarted_daemon_readopts_a_running_job(cluster: SlurmCluster,
                                                   make_daemon: Callable[..., Daemon],
                                                   tmp_path: Path, database_lost: bool) -> None:
    """The daemon SIGKILLed mid-job (and, in the second case, its database deleted:
    rebuilt from the data dir) comes back to the same SLURM job and records its end."""
    go = tmp_path / "go"
    first = make_daemon({"JOBSUP_BACKEND": "slurm"})
    job = first.submit(python_job(
        "import os, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.1)\n"
        "print('done', flush=True)"), name="survivor")
    sid = slurm_id(first, job)
    wait_for(lambda: "running in SLURM" in (first.job(job["id"])["reason"] or ""), 30,
             what="the job running in SLURM")
    first.kill()
    if database_lost:
        (first.data_dir / "jobsup.db").unlink()
    again = make_daemon({"JOBSUP_BACKEND": "slurm"}, data_dir=first.data_dir)
    readopted = again.job(job["id"])
    assert readopted["state"] == "running"
    if database_lost:  # rebuilt as a SLURM attempt, not judged by this machine's /proc
        assert any("in SLURM; re-adopted after the database was rebuilt" in (e["reason"] or "")
                   for e in again.events(job["id"])), again.events(job["id"])
    assert cluster.state_of(sid)["JobState"] == "RUNNING"
    go.touch()
    done = again.wait_state(job["id"], "succeeded", "failed", "lost", timeout=30)
    assert (done["state"], done["exit_code"], done["attempt"]) == ("succeeded", 0, 1)
    jobs = cluster.run("squeue", "--noheader", "--states=all", "--format=%j").stdout.split()
    assert jobs.count(f"jobsup-{job['id']}-1") == 1  # submitted once, never again


def test_a_job_past_its_time_limit_ends_timeout(daemon: Daemon,
                                                over_time: dict[str, Any]) -> None:
    """Last of the shared daemon's tests: its job was submitted with the daemon."""
    done = daemon.wait_state(over_time["id"], "succeeded", "failed", "stopped", "lost",
                             timeout=120)
    sid = slurm_id(daemon, over_time)
    assert (done["state"], done["exit_reason"]) == ("failed", "timeout"), done
    assert done["reason"] == (f"SLURM job {sid} reached its time limit and was ended by "
                              "SLURM (TIMEOUT)")


def test_a_controller_down_keeps_jobs_running_and_defers_launches(
        daemon: Daemon, cluster: SlurmCluster, tmp_path: Path) -> None:
    """After the TIMEOUT case: slurmctld stopped for a while must not end anything."""
    go = tmp_path / "go"
    running = daemon.submit(python_job(
        "import os, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.1)"), name="through-outage")
    wait_for(lambda: "running in SLURM" in (daemon.job(running["id"])["reason"] or ""), 30,
             what="the job running in SLURM")
    cluster.stop_controller()
    try:
        later = daemon.submit(python_job("print('late')"), name="submitted-in-outage")
        deferred = wait_for(lambda: (j := daemon.job(later["id"]))["state"] == "pending"
                            and "SLURM did not take the job" in (j["reason"] or "") and j,
                            40, what="the launch deferred")
        assert "Unable to contact slurm controller" in deferred["reason"]
        assert deferred["reason"].endswith("next try in 10 s")
        kept = daemon.job(running["id"])
        assert kept["state"] == "running"
        assert "SLURM does not answer" in kept["reason"]
    finally:
        cluster.start_controller()
    go.touch()
    assert daemon.wait_state(running["id"], "succeeded", "failed", "lost",
                             timeout=40)["state"] == "succeeded"
    done = daemon.wait_state(later["id"], "succeeded", "failed", "lost", timeout=40)
    # Each launch SLURM did not take used up an attempt number (recorded before the
    # launch): one at least, more where a retry (every 10 s) came before slurmctld answered
    # again on a loaded machine. Only the last attempt went to SLURM, once.
    deferrals = [e for e in daemon.events(later["id"])
                 if "SLURM did not take the job" in (e["reason"] or "")]
    assert deferrals and (done["state"], done["attempt"]) == ("succeeded", len(deferrals) + 1)
    names = cluster.run("squeue", "--noheader", "--states=all", "--format=%j").stdout.split()
    assert [n for n in names if n.startswith(f"jobsup-{later['id']}-")] == [
        f"jobsup-{later['id']}-{done['attempt']}"]


# -- the parts that need no cluster ----------------------------------------------------

def test_slurm_sections_are_validated() -> None:
    base = {"name": "x", "command": [PY]}
    with pytest.raises(ValidationError, match="a `local` job takes no slurm section"):
        JobSpec.model_validate({**base, "backend": "local", "slurm": {}})
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        JobSpec.model_validate({**base, "slurm": {"nodes": 0}})
    for bad in ("1h", "90 minutes", "1-", "::", "1:2:3:4"):
        with pytest.raises(ValidationError, match="is not a SLURM time limit"):
            JobSpec.model_validate({**base, "slurm": {"time": bad}})
    for good in ("30", "0:30", "1:00:00", "2-00", "2-1:30", "1-02:03:04", "UNLIMITED"):
        assert JobSpec.model_validate({**base, "slurm": {"time": good}}).slurm is not None
    with pytest.raises(ValidationError, match="--output is set by jobsup"):
        JobSpec.model_validate({**base, "slurm": {"extra": ["--output=/tmp/x"]}})
    with pytest.raises(ValidationError, match="not a SLURM memory size"):
        JobSpec.model_validate({**base, "slurm": {"mem": "lots"}})
    spec = JobSpec.model_validate({**base, "slurm": {"partition": "gpu"}})
    assert (spec.backend_or("local"), JobSpec.model_validate(base).backend_or("local")) == \
        ("slurm", "local")


def test_sbatch_gets_the_specs_resources(tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"name": "x", "command": [PY], "slurm": {
        "partition": "gpu", "nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4,
        "cpus_per_task": 8, "mem": "64G", "time": "1-00:00:00", "account": "ml",
        "qos": "high", "extra": ["--exclusive", "--constraint=a100"]}})
    argv = sbatch_argv(spec, tmp_path, "jobsup-j-1")
    assert argv[argv.index("--no-requeue") + 1:] == [
        "--export=NONE", "--partition=gpu", "--nodes=2", "--ntasks-per-node=4",
        "--gpus-per-node=4", "--cpus-per-task=8", "--mem=64G", "--time=1-00:00:00",
        "--account=ml", "--qos=high", "--exclusive", "--constraint=a100",
        str(tmp_path / "slurm-batch.sh")]


@pytest.mark.parametrize(("state", "cancelled_by_jobsup", "expected"), [
    ("COMPLETED", False, None),
    ("FAILED", False, None),
    ("TIMEOUT", False, ExitReason.TIMEOUT),
    ("DEADLINE", False, ExitReason.TIMEOUT),
    ("CANCELLED", False, ExitReason.CANCELLED),
    ("CANCELLED", True, None),
    ("OUT_OF_MEMORY", False, ExitReason.OOM),
    ("PREEMPTED", False, ExitReason.PREEMPTED),
    ("NODE_FAIL", False, ExitReason.NODE_FAIL),
    ("BOOT_FAIL", False, ExitReason.NODE_FAIL),
])
def test_every_final_slurm_state_has_an_exit_reason(state: str, cancelled_by_jobsup: bool,
                                                    expected: ExitReason | None) -> None:
    end = end_of(SlurmJob("7", "jobsup-j-1", state, "", "gpu01"),
                 jobsup_cancelled=cancelled_by_jobsup, shim_recorded=True)
    assert (end.exit_reason if end else None) is expected
    if end is not None:
        assert "SLURM job 7" in end.reason
        assert end.restartable is (state != "CANCELLED")


def test_ranks_get_the_torchrun_variables_from_sruns() -> None:
    env = rank_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
                            "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x3)",
                            "SLURM_JOB_ID": "20123", "SLURM_JOB_NODELIST": "gpu07,gpu09"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "2", "MASTER_ADDR": "gpu07", "MASTER_PORT": "20123"}
    assert rank_environment({"MASTER_PORT": "29500", "SLURM_JOB_NODELIST": "n1"})[
        "MASTER_PORT"] == "29500"  # the job's own setting wins


def test_an_accounted_cancel_names_who() -> None:
    end = end_of(SlurmJob("7", "jobsup-j-1", "CANCELLED", "", "", cancelled_by="1001"),
                 jobsup_cancelled=False, shim_recorded=False)
    assert end is not None and end.reason == "SLURM job 7 cancelled by uid 1001"
