"""The lifecycle's decisions (supervisor/daemon/lifecycle.py) against a table: each row
is what the loop observed and what must follow. Pure functions: no processes here; the
real-process tests (test_core, test_faults, test_shim_held, ...) run the same decisions
through the loop."""

from __future__ import annotations

import pytest

from supervisor.backends.base import ShimState
from supervisor.daemon import lifecycle
from supervisor.daemon.lifecycle import (
    LAUNCH_CONFIRM_S,
    Decision,
    Dependency,
    Exit,
    Processes,
    Restarts,
    Step,
    Verdict,
    WorkerSeen,
    after_exit,
    before_start,
    dependencies_met,
    end_time,
    exit_of,
    files_vanished,
    judge,
    launch_cut_short,
    vanished,
    wait_over,
)
from supervisor.runtime.files import ExitStatus
from supervisor.spec import ExitReason, JobState, RestartPolicy

NEVER = Restarts(RestartPolicy.NEVER, done=0, limit=0, backoff_s=1.0, backoff_max_s=60.0)
RETRY = Restarts(RestartPolicy.ON_FAILURE, done=1, limit=3, backoff_s=1.0, backoff_max_s=60.0)
P, R, S, F, ST, L = (JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED,
                     JobState.STOPPED, JobState.LOST)


@pytest.mark.parametrize("ended,restarts,expected", [
    (Exit(0, None), NEVER, Decision(S, ExitReason.EXIT, "exited with code 0")),
    (Exit(0, None), RETRY, Decision(S, ExitReason.EXIT, "exited with code 0")),
    (Exit(3, None), NEVER, Decision(F, ExitReason.EXIT, "exited with code 3")),
    (Exit(None, 9), NEVER, Decision(F, ExitReason.SIGNAL, "killed by signal 9 (SIGKILL)")),
    (Exit(None, 77), NEVER, Decision(F, ExitReason.SIGNAL, "killed by signal 77 (signal 77)")),
    (Exit(None, 9, oom=True, notes="the kernel's OOM killer (1 kill)"), NEVER,
     Decision(F, ExitReason.OOM, "killed by signal 9 (SIGKILL) — the kernel's OOM killer "
                                 "(1 kill)")),
    (Exit(1, None, oom=True, notes="CUDA out of memory"), NEVER,
     Decision(F, ExitReason.OOM, "exited with code 1 — CUDA out of memory")),
    (Exit(127, None, spawn_error="cannot execute 'nope': No such file or directory"), NEVER,
     Decision(F, ExitReason.EXIT, "cannot execute 'nope': No such file or directory")),
    # a spawn error with exit code 0 is still a failure
    (Exit(0, None, spawn_error="cannot execute"), NEVER,
     Decision(F, ExitReason.EXIT, "cannot execute")),
    # a stop wins over whatever the exit looks like
    (Exit(0, None, stop_requested=True), RETRY,
     Decision(ST, ExitReason.STOPPED, "stopped on request (SIGTERM)")),
    (Exit(None, 9, stop_requested=True, stopped_by="SIGKILL after the grace",
          stop_cause="because the jobs it served have ended"), NEVER,
     Decision(ST, ExitReason.STOPPED, "stopped because the jobs it served have ended "
                                      "(SIGKILL after the grace)")),
    # the daemon's own stop on its exit is no person's: pending again, nothing counted
    # (#32 item 2), whatever the exit and the policy
    (Exit(0, None, stop_requested=True, by_daemon_exit=True,
          stop_cause="because the daemon is exiting (--stop-jobs-on-exit)"), NEVER,
     Decision(P, ExitReason.STOPPED, "stopped because the daemon is exiting "
              "(--stop-jobs-on-exit) (SIGTERM); runs again when the daemon starts",
              requeue=True)),
    (Exit(None, 9, stop_requested=True, by_daemon_exit=True, stopped_by="SIGKILL after the "
          "grace", stop_cause="because the daemon is exiting (--stop-jobs-on-exit)"), RETRY,
     Decision(P, ExitReason.STOPPED, "stopped because the daemon is exiting "
              "(--stop-jobs-on-exit) (SIGKILL after the grace); runs again when the daemon "
              "starts", requeue=True)),
    # restarts: backoff x2 per restart, capped
    (Exit(3, None), RETRY,
     Decision(P, ExitReason.EXIT, "exited with code 3; restart 2/3 in 2.0 s", 2.0)),
    (Exit(None, 15), Restarts(RestartPolicy.ON_FAILURE, 0, 1, 5.0, 60.0),
     Decision(P, ExitReason.SIGNAL, "killed by signal 15 (SIGTERM); restart 1/1 in 5.0 s",
              5.0)),
    (Exit(3, None), Restarts(RestartPolicy.ON_FAILURE, 10, 20, 1.0, 60.0),
     Decision(P, ExitReason.EXIT, "exited with code 3; restart 11/20 in 60.0 s", 60.0)),
    (Exit(3, None), Restarts(RestartPolicy.ON_FAILURE, 3, 3, 1.0, 60.0),
     Decision(F, ExitReason.EXIT, "exited with code 3")),  # restarts used up
])
def test_after_exit(ended: Exit, restarts: Restarts, expected: Decision) -> None:
    assert after_exit(ended, restarts) == expected
    assert R.can_become(expected.state)  # what `store.transition` lets a running job do


def test_backoff_never_overflows() -> None:
    huge = Restarts(RestartPolicy.ON_FAILURE, 10**9, 10**10, 1.0, 300.0)
    assert huge.delay_s() == 300.0


@pytest.mark.parametrize("recorded,offset_s,started_at,expected", [
    (995.0, 0.0, None, 995.0),  # the clocks agree: the shim's stamp
    (995.0 - 7200, -7200.0, 990.0, 995.0),  # the system clock 2 h behind
    (995.0 + 7200, 7200.0, 990.0, 995.0),  # 2 h ahead
    (1_500.0, 0.0, 990.0, 1_000.0),  # stamped after the reading: never later than now
    (995.0, 7200.0, 990.0, 990.0),  # a step between the end and the reading: never
    (995.0, 7200.0, None, 995.0 - 7200),  # before the start (where one is known)
    (995.0, 0.0, 1_200.0, 1_000.0),  # a start after now bounds nothing
])
def test_an_end_is_taken_on_the_daemon_clock(recorded: float, offset_s: float,
                                             started_at: float | None,
                                             expected: float) -> None:
    assert end_time(recorded, now=1_000.0, offset_s=offset_s,
                    started_at=started_at) == expected


@pytest.mark.parametrize("next_start_at,now,over", [
    (None, 100.0, True),  # no wait
    (120.0, 100.0, False),  # its backoff: 20 s to go
    (120.0, 120.0, True),
    (400.0, 100.0, False),  # the longest backoff (300 s) to go
    (400.1, 100.0, True),  # further than any backoff: set on another boot's clock
    (7320.0, 100.0, True),  # a restart's due time two hours ahead of this clock
])
def test_a_wait_is_never_longer_than_the_longest_backoff(next_start_at: float | None,
                                                         now: float, over: bool) -> None:
    assert wait_over(next_start_at, now, 300.0) is over


@pytest.mark.parametrize("shim_recorded,abandoned,expected", [
    (True, True, Decision(P, None, "its shim exited before starting the job (see shim.log); "
                                   "launching again")),
    (False, True, Decision(P, None, "the daemon died while launching; launching again")),
    (True, False, Decision(L, ExitReason.LOST, "its shim died while starting the job")),
])
def test_launch_cut_short(shim_recorded: bool, abandoned: bool, expected: Decision) -> None:
    assert launch_cut_short(shim_recorded=shim_recorded, abandoned=abandoned) == expected


@pytest.mark.parametrize("stop_requested,shim_recorded,expected", [
    (True, True, Decision(ST, ExitReason.STOPPED,
                          "stopped on request (exit status unknown: its shim had died)")),
    (False, True, Decision(L, ExitReason.LOST, "the job's process vanished after its shim "
                                               "died; exit status unknown")),
    (False, False, Decision(L, ExitReason.LOST, "the job's processes vanished without "
                                                "recording an exit status")),
])
def test_vanished(stop_requested: bool, shim_recorded: bool, expected: Decision) -> None:
    assert vanished(stop_requested=stop_requested, shim_recorded=shim_recorded) == expected


@pytest.mark.parametrize("stop_requested,expected", [
    (False, Decision(L, ExitReason.LOST, "the job's process vanished after its shim died; "
                     "exit status unknown (its attempt directory was deleted, moved or "
                     "emptied)")),
    (True, Decision(ST, ExitReason.STOPPED, "stopped on request (exit status unknown: its "
                    "shim had died; its attempt directory was deleted, moved or emptied)")),
])
def test_vanished_with_its_files(stop_requested: bool, expected: Decision) -> None:
    assert vanished(stop_requested=stop_requested, shim_recorded=True,
                    files_gone=True) == expected


@pytest.mark.parametrize("stop_requested,expected", [
    (False, Decision(L, ExitReason.LOST, "its shim ended and its attempt directory was "
                     "deleted, moved or emptied: whether it started the job is unknown, so "
                     "it is not launched again")),
    (True, Decision(ST, ExitReason.STOPPED, "stopped on request (whether it ran is unknown: "
                    "its shim ended and its attempt directory was deleted, moved or "
                    "emptied)")),
])
def test_files_vanished_is_never_a_second_run(stop_requested: bool,
                                              expected: Decision) -> None:
    decision = files_vanished(stop_requested=stop_requested)
    assert decision == expected and decision.state is not P


# -- a running job's processes, as the checks diagnosed them -> what follows -------------

def status(exit_code: int | None = 1, signal: int | None = None, *,
           stop_requested: bool = False, killed_after_grace: bool = False,
           spawn_error: str | None = None, oom_kills: int | None = None) -> ExitStatus:
    return ExitStatus(exit_code=exit_code, signal=signal, ended_at=100.0,
                      stop_requested=stop_requested, killed_after_grace=killed_after_grace,
                      max_rss_bytes=0, spawn_error=spawn_error, oom_kills=oom_kills)


def seen(shim: ShimState, worker: WorkerSeen = WorkerSeen.UNREAD, *,
         exit: ExitStatus | None = None, shim_recorded: bool = True,
         stop_requested: bool = False, launch_age_s: float = 60.0,
         launch_on_disk: bool = True) -> Processes:
    return Processes(shim=shim, worker=worker, exit=exit, shim_recorded=shim_recorded,
                     stop_requested=stop_requested, launch_age_s=launch_age_s,
                     launch_on_disk=launch_on_disk)


RUN, SUS, GONE = ShimState.RUNNING, ShimState.SUSPENDED, ShimState.GONE
ALIVE, DEAD, NONE = WorkerSeen.ALIVE, WorkerSeen.GONE, WorkerSeen.NEVER_STARTED
LOST_UNKNOWN = Decision(L, ExitReason.LOST, "the job's process vanished after its shim died; "
                                            "exit status unknown")


@pytest.mark.parametrize("processes,expected", [
    # an exit record decides, whatever else is seen
    (seen(SUS, DEAD, exit=status()), Verdict(Step.FINISH)),
    (seen(GONE, DEAD, exit=status(0)), Verdict(Step.FINISH)),
    (seen(GONE, NONE, exit=status(0), shim_recorded=False), Verdict(Step.FINISH)),
    # the shim runs: it watches the worker
    (seen(RUN), Verdict(Step.RUNS)),
    (seen(RUN, stop_requested=True), Verdict(Step.RUNS)),
    # a suspended shim: nothing while its worker runs, continued once it has ended
    (seen(SUS, ALIVE), Verdict(Step.WAIT)),
    (seen(SUS, DEAD), Verdict(Step.RESUME_SHIM)),
    (seen(SUS, NONE), Verdict(Step.RESUME_SHIM)),
    # the shim is gone
    (seen(GONE, ALIVE), Verdict(Step.WATCH_WORKER)),
    (seen(GONE, DEAD), Verdict(Step.TRANSITION, LOST_UNKNOWN)),
    (seen(GONE, DEAD, shim_recorded=False), Verdict(Step.TRANSITION, Decision(
        L, ExitReason.LOST, "the job's processes vanished without recording an exit "
                            "status"))),
    (seen(GONE, DEAD, stop_requested=True), Verdict(Step.TRANSITION, Decision(
        ST, ExitReason.STOPPED, "stopped on request (exit status unknown: its shim had "
                                "died)"))),
    # no worker ever started: a recorded shim died starting it, or the launch is overdue
    (seen(GONE, NONE), Verdict(Step.SETTLE_LAUNCH)),
    (seen(GONE, NONE, shim_recorded=False, launch_age_s=LAUNCH_CONFIRM_S + 1),
     Verdict(Step.SETTLE_LAUNCH)),
    (seen(GONE, NONE, shim_recorded=False, launch_age_s=LAUNCH_CONFIRM_S / 2),
     Verdict(Step.WAIT)),
    # the attempt's files vanished (#46): a started shim had its launch.json, so the
    # launch is not settled (the daemon would claim the empty directory and run the job
    # again); without a shim on record the daemon may have died writing it: settled
    (seen(GONE, NONE, launch_on_disk=False),
     Verdict(Step.TRANSITION, files_vanished(stop_requested=False))),
    (seen(GONE, NONE, launch_on_disk=False, stop_requested=True),
     Verdict(Step.TRANSITION, files_vanished(stop_requested=True))),
    (seen(GONE, NONE, shim_recorded=False, launch_on_disk=False,
          launch_age_s=LAUNCH_CONFIRM_S + 1), Verdict(Step.SETTLE_LAUNCH)),
    (seen(SUS, NONE, launch_on_disk=False), Verdict(Step.RESUME_SHIM)),
    # a worker on record is judged by its processes, whatever became of the files
    (seen(GONE, ALIVE, launch_on_disk=False), Verdict(Step.WATCH_WORKER)),
    (seen(GONE, DEAD, launch_on_disk=False), Verdict(Step.TRANSITION, vanished(
        stop_requested=False, shim_recorded=True, files_gone=True))),
    (seen(GONE, DEAD, exit=status(0), launch_on_disk=False), Verdict(Step.FINISH)),
])
def test_judge(processes: Processes, expected: Verdict) -> None:
    assert judge(processes) == expected
    assert expected.decision is None or R.can_become(expected.decision.state)


@pytest.mark.parametrize("recorded,stop_requested,killed_by_backstop,expected", [
    (status(0), False, False, Exit(0, None)),
    (status(None, 9, oom_kills=2), False, False, Exit(
        None, 9, oom=True, notes="OOM-killed: the cgroup's oom_kill count rose by 2")),
    # a stop's end is no failure: no notes, however it ended
    (status(None, 9, oom_kills=2), True, True, Exit(
        None, 9, stop_requested=True, stopped_by="SIGKILL by the daemon's backstop")),
    (status(None, 9, killed_after_grace=True), True, False, Exit(
        None, 9, stop_requested=True, stopped_by="SIGKILL after the grace")),
    (status(None, 15, stop_requested=True), True, False, Exit(None, 15, stop_requested=True)),
    (status(127, spawn_error="cannot execute 'x'"), False, False, Exit(
        127, None, spawn_error="cannot execute 'x'")),
])
def test_exit_of_a_status_record(recorded: ExitStatus, stop_requested: bool,
                                 killed_by_backstop: bool, expected: Exit) -> None:
    assert exit_of(recorded, stop_requested=stop_requested,
                   killed_by_backstop=killed_by_backstop) == expected


def test_exit_of_a_failure_reads_its_log_tail() -> None:
    ended = exit_of(status(1), stop_requested=False,
                    log_tail=["torch.OutOfMemoryError: CUDA out of memory."])
    assert ended.notes == "CUDA out of memory (seen in the log)" and not ended.oom
    assert exit_of(status(0), stop_requested=False,
                   log_tail=["torch.OutOfMemoryError: CUDA out of memory."]).notes is None


def dep(state: JobState, job_id: str = "a") -> Dependency:
    return Dependency(job_id, f"job-{job_id}", state)


@pytest.mark.parametrize("stop_requested,deps,expected,met", [
    (False, [], None, True),
    (False, [dep(S), dep(S, "b")], None, True),
    (False, [dep(R)], None, False),  # waits
    (False, [dep(P), dep(F, "b")], None, False),  # deps in order: the first still pending
    (False, [dep(S), dep(F, "b")], Decision(F, None, "dependency b (job-b) failed"), False),
    (False, [dep(L)], Decision(F, None, "dependency a (job-a) lost"), False),
    (False, [dep(ST)], Decision(F, None, "dependency a (job-a) stopped"), False),
    (True, [dep(F)], Decision(ST, ExitReason.STOPPED, "stopped on request before it started"),
     False),
])
def test_before_start(stop_requested: bool, deps: list[Dependency], expected: Decision | None,
                      met: bool) -> None:
    assert before_start(stop_requested=stop_requested, dependencies=deps) == expected
    assert dependencies_met(deps) is met


# -- classify_exit --------------------------------------------------------------------------

def test_sigkill_with_oom_kills_is_oom() -> None:
    notes, reason = lifecycle.classify_exit(exit_code=None, signal=9, oom_kills=1, log_tail=[])
    assert reason == "oom"
    assert notes is not None and "OOM-killed" in notes and "rose by 1" in notes


def test_sigkill_without_oom_kills_is_a_labelled_guess() -> None:
    notes, reason = lifecycle.classify_exit(exit_code=None, signal=9, oom_kills=0, log_tail=[])
    assert reason is None
    assert notes is not None
    assert "possibly" in notes and "a guess" in notes and "OOM" in notes


@pytest.mark.parametrize(("line", "meaning"), [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
     "CUDA out of memory"),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate",
     "CUDA out of memory"),
    ("OSError: [Errno 28] No space left on device: '/data/hidden/0001.pt'", "ENOSPC"),
    ("safetensors_rust.SafetensorError: ENOSPC while writing", "ENOSPC"),
    ("MemoryError", "host out of memory"),
    ("terminate called after throwing an instance of 'std::bad_alloc'", "host out of memory"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
     "OpType=ALLREDUCE) ran for 1800000 milliseconds before timing out.", "NCCL"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970",
     "NCCL"),
])
def test_log_signatures_are_recognised(line: str, meaning: str) -> None:
    tail = ["loading model", line, "Traceback follows"]
    notes, reason = lifecycle.classify_exit(exit_code=1, signal=None, oom_kills=0, log_tail=tail)
    assert notes is not None and meaning in notes and "seen in the log" in notes
    assert reason is None  # a log line explains, but only the cgroup counter proves an OOM kill


def test_cuda_oom_is_not_mistaken_for_host_memory_error() -> None:
    notes, _ = lifecycle.classify_exit(
        exit_code=1, signal=None, oom_kills=0,
        log_tail=["torch.cuda.OutOfMemoryError: CUDA out of memory."])
    assert notes == "CUDA out of memory (seen in the log)"


def test_the_failed_rank_of_a_data_parallel_worker_is_named() -> None:
    tail = ["rank 1 12:00:01 CUDA out of memory. Tried to allocate 8.00 GiB",
            "12:00:02 rank 1 (cuda:1) failed (exit code 1); stopping the other ranks"]
    notes, _ = lifecycle.classify_exit(exit_code=1, signal=None, oom_kills=0, log_tail=tail)
    assert notes == ("rank 1 (cuda:1) failed first: exit code 1; "
                     "CUDA out of memory (seen in the log)")


def test_the_failed_rank_of_a_torchrun_job_is_named() -> None:
    tail = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_12:00:03
  host      : node1
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 4242)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_12:00:01
  host      : node1
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 4241)
  error_file: <N/A>
============================================================""".splitlines()
    notes, _ = lifecycle.classify_exit(exit_code=1, signal=None, oom_kills=0, log_tail=tail)
    assert notes == "rank 2 (local rank 2) failed first: exitcode -9"


def test_oom_kill_and_a_log_signature_both_reported() -> None:
    notes, reason = lifecycle.classify_exit(exit_code=None, signal=9, oom_kills=2,
                                         log_tail=["MemoryError"])
    assert reason == "oom"
    assert notes == ("OOM-killed: the cgroup's oom_kill count rose by 2; "
                     "host out of memory (seen in the log)")


def test_plain_exit_without_a_signature_has_no_explanation() -> None:
    tail = ["step 10/100", "ValueError: bad shape"]
    assert lifecycle.classify_exit(exit_code=3, signal=None, oom_kills=0, log_tail=tail) == (
        None, None)
    assert lifecycle.classify_exit(exit_code=3, signal=None, oom_kills=0, log_tail=[]) == (
        None, None)


def test_other_signals_are_not_guessed_at() -> None:
    assert lifecycle.classify_exit(exit_code=None, signal=15, oom_kills=0, log_tail=[]) == (
        None, None)
    # an oom_kill count without SIGKILL is not an OOM kill of this job
    assert lifecycle.classify_exit(exit_code=1, signal=None, oom_kills=3, log_tail=[]) == (
        None, None)
