"""The job lifecycle's decisions as small pure functions: what a job's next state is,
with which exit reason and which words, given what the loop observed. The loop
(`daemon/loop.py`) gathers the facts (the shim's exit record, the log tail, the stop
request, the restart policy), asks here, and writes the answer through
`store.transition`; nothing here reads a file, a clock or the database, so every rule
is checked against a table (`tests/test_lifecycle.py`), as supervisord's `transition()`.

    pending ──start──> running ──exit 0──────────────> succeeded
       ^                  │ ──exit != 0, signal, OOM──> failed   (or pending: restart)
       │<─────────────────│ ──stopped by the daemon's exit (runs again at its start)
       │                  │ ──stop requested──────────> stopped
       └──launch cut short┘ ──vanished, no record─────> lost
"""

from __future__ import annotations

import re
import signal as signals
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from supervisor.backends.base import SchedulerEnd, ShimState
from supervisor.formatting import terminal_text
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.spec import ExitReason, JobState, RestartPolicy

LOG_SIGNATURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED"
                r"|cudaErrorMemoryAllocation", re.I), "CUDA out of memory (seen in the log)"),
    (re.compile(r"No space left on device|ENOSPC|Errno 28", re.I),
     "disk full: ENOSPC (seen in the log)"),
    (re.compile(r"\bMemoryError\b|Cannot allocate memory|std::bad_alloc"),
     "host out of memory (seen in the log)"),
    (re.compile(r"NCCL (error|WARN.*[Tt]imeout)|Watchdog caught collective operation timeout"),
     "NCCL error or timeout (seen in the log)"),
)

RANK_FAILURES: tuple[re.Pattern[str], ...] = (
    # workers.eagle3.extraction.ranks (jobsup's data-parallel workers)
    re.compile(r"rank (?P<rank>\d+) \((?P<where>[^)]*)\) failed \((?P<how>[^)]*)\)"),
    # torchrun's failure summary: the first observed failure
    re.compile(r"Root Cause.*?rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<where>\d+)\)"
               r"\s*exitcode\s*:\s*(?P<how>-?\d+)", re.S),
    # srun (a multi-rank `slurm` job): its task number is the rank, then the node
    re.compile(r"srun: error: (?P<where>\S+): tasks? (?P<rank>\d+)[-\d,]*: "
               r"(?P<how>Exited with exit code [1-9]\d*)"),
    re.compile(r"srun: error: (?P<where>\S+): tasks? (?P<rank>\d+)[-\d,]*: "
               r"(?P<how>Killed|Segmentation fault|Aborted|Bus error)"),
)
"""How a multi-process job's parent names the rank that failed first."""


def signal_name(sig: int) -> str:
    try:
        return signals.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@dataclass(frozen=True)
class Decision:
    """The next state, the exit reason to record (None: leave the recorded one as it
    is, as for a launch tried again or a dependency that failed) and the transition's
    reason text."""

    state: JobState
    exit_reason: ExitReason | None
    reason: str
    restart_in_s: float | None = None
    """For a restart: seconds until the next attempt may start."""
    requeue: bool = False
    """Pending again after a stop no person asked for (the daemon's own exit): the stop
    request is cleared and no restart is counted."""


@dataclass(frozen=True)
class Exit:
    """What the shim recorded of an attempt's end, and what the loop knows about it."""

    exit_code: int | None
    signal: int | None
    spawn_error: str | None = None
    """The worker never started (its command could not be executed): why."""
    stop_requested: bool = False
    """By the user, or by the jobs it served ending (either side recorded it)."""
    stopped_by: str = "SIGTERM"
    """How a stopped job ended: SIGTERM, SIGKILL after the grace, or the backstop's."""
    stop_cause: str = "on request"
    by_daemon_exit: bool = False
    """The stop was the daemon's own, on its way out (`--stop-jobs-on-exit`), not a
    person's: the job runs again when the daemon starts (#32: its dependents failed)."""
    oom: bool = False
    """The kernel's OOM killer took it (cgroup count) or its log says CUDA OOM."""
    notes: str | None = None
    """What the log tail and the exit tell (NCCL, CUDA OOM, the failing rank)."""
    scheduler_end: SchedulerEnd | None = None
    """A cluster scheduler ended it (a time limit, a cancel from outside jobsup, a
    preemption, a failed node): that is the reason, whatever the exit code."""


@dataclass(frozen=True)
class Restarts:
    policy: RestartPolicy
    done: int
    """Restarts so far."""
    limit: int
    backoff_s: float
    backoff_max_s: float

    def delay_s(self) -> float:
        """Exponential backoff: backoff_s x 2^done, at most backoff_max_s."""
        return min(self.backoff_s * 2.0 ** min(self.done, 64), self.backoff_max_s)


def wait_over(next_start_at: float | None, now: float, longest_s: float) -> bool:
    """A pending job's wait before its next attempt (a restart's backoff, a launch's
    retry) is over: at its due time, or at once where that lies further ahead than
    `longest_s`, the longest wait the daemon sets. Such a due time was set on another
    clock: another boot's, whose readings this boot's clock does not continue
    (`clock.SteadyClock.of_boot`), or the system clock's (a database rebuilt from the
    data dir); the job is not held for however far the two clocks were apart."""
    return next_start_at is None or now >= next_start_at or next_start_at - now > longest_s


def end_time(recorded_s: float, *, now: float, offset_s: float,
             started_at: float | None = None) -> float:
    """When an attempt ended, on the daemon's clock (`now`): its shim's stamp, taken on
    the system clock, less `offset_s`, how far the system clock is from the daemon's
    now (`clock.SteadyClock.offset_s`: stamped as it was, a job that ended after a step
    back ended hours before it began); never later than `now` nor before the attempt
    began (`started_at`): a step between the end and this reading must not push the
    end, and the alerts' windows, ahead, nor put it before the start."""
    ended = min(recorded_s - offset_s, now)
    return ended if started_at is None else max(ended, min(started_at, now))


def after_exit(ended: Exit, restarts: Restarts) -> Decision:
    """An attempt's recorded end: stopped, succeeded, failed, or pending for a restart."""
    if ended.stop_requested and ended.by_daemon_exit:
        return Decision(JobState.PENDING, ExitReason.STOPPED,
                        f"stopped {ended.stop_cause} ({ended.stopped_by}); runs again "
                        "when the daemon starts", requeue=True)
    if ended.stop_requested:
        return Decision(JobState.STOPPED, ExitReason.STOPPED,
                        f"stopped {ended.stop_cause} ({ended.stopped_by})")
    end = ended.scheduler_end
    if end is not None and not end.restartable:  # a person ended it: no restart
        return Decision(JobState.STOPPED, end.exit_reason, end.reason)
    if end is None and ended.exit_code == 0 and not ended.spawn_error:
        return Decision(JobState.SUCCEEDED, ExitReason.EXIT, "exited with code 0")
    if end is not None:
        exit_reason, reason = end.exit_reason, end.reason
    elif ended.spawn_error:
        exit_reason, reason = ExitReason.EXIT, ended.spawn_error
    elif ended.signal is not None:
        exit_reason = ExitReason.SIGNAL
        reason = f"killed by signal {ended.signal} ({signal_name(ended.signal)})"
    else:
        exit_reason, reason = ExitReason.EXIT, f"exited with code {ended.exit_code}"
    if ended.oom and end is None:
        exit_reason = ExitReason.OOM
    if ended.notes:
        reason = f"{reason} — {ended.notes}"
    if restarts.policy is RestartPolicy.ON_FAILURE and restarts.done < restarts.limit:
        delay = restarts.delay_s()
        return Decision(JobState.PENDING, exit_reason,
                        f"{reason}; restart {restarts.done + 1}/{restarts.limit} in "
                        f"{delay:.1f} s", restart_in_s=delay)
    return Decision(JobState.FAILED, exit_reason, reason)


def is_failure(status: ExitStatus, *, stop_requested: bool) -> bool:
    """The recorded end is a failure (its log tail may tell why: `classify_exit`)."""
    return not stop_requested and (status.exit_code != 0 or bool(status.spawn_error))


def exit_of(status: ExitStatus, *, stop_requested: bool, log_tail: Sequence[str] = (),
            killed_by_backstop: bool = False, stop_cause: str = "on request",
            by_daemon_exit: bool = False, scheduler_end: SchedulerEnd | None = None) -> Exit:
    """The `Exit` of an attempt's `status.json`, as both the live engine
    (`checks.JobChecks.finish`) and a rebuild from the data dir (`rebuild.py`) give it to
    `after_exit`: a failure's OOM and notes from its log tail (`classify_exit`; read by
    the caller only for a failure, `is_failure`), and how a stop ended it.
    `stop_requested`: by the user or the jobs it served, as the daemon or the shim
    recorded it; `killed_by_backstop`: the daemon's own SIGKILL (`STOP_BACKSTOP_S`)."""
    notes = oom = None
    if is_failure(status, stop_requested=stop_requested):
        notes, oom = classify_exit(exit_code=status.exit_code, signal=status.signal,
                                   oom_kills=status.oom_kills or 0, log_tail=log_tail)
    stopped_by = ("SIGKILL after the grace" if status.killed_after_grace else
                  "SIGKILL by the daemon's backstop" if killed_by_backstop else "SIGTERM")
    return Exit(status.exit_code, status.signal, spawn_error=status.spawn_error,
                stop_requested=stop_requested, stopped_by=stopped_by, stop_cause=stop_cause,
                by_daemon_exit=by_daemon_exit, oom=oom is not None, notes=notes or None,
                scheduler_end=scheduler_end)


def classify_exit(*, exit_code: int | None, signal: int | None, oom_kills: int,
                  log_tail: Sequence[str]) -> tuple[str | None, ExitReason | None]:
    """(extra explanation, `ExitReason.OOM` when the exit was an out-of-memory kill) of a
    failed exit. The cgroup's `oom_kill` counter rising during the run with a SIGKILL is
    an OOM kill; a SIGKILL alone is only a guess, and says so."""
    notes = []
    exit_reason = None
    if signal == 9 and oom_kills > 0:
        notes.append(f"OOM-killed: the cgroup's oom_kill count rose by {oom_kills}")
        exit_reason = ExitReason.OOM
    elif signal == 9:
        notes.append("SIGKILL from outside the job: possibly the kernel OOM killer (a guess; "
                     "no OOM kill recorded in a readable cgroup)")
    text = terminal_text("\n".join(log_tail))  # a cause quotes the log: no colour codes
    rank = failed_rank(text)
    if rank:
        notes.insert(0, rank)
    for pattern, meaning in LOG_SIGNATURES:
        if pattern.search(text):
            notes.append(meaning)
            break
    return ("; ".join(notes) or None), exit_reason


def failed_rank(text: str) -> str | None:
    """"rank 1 (cuda:1) failed first: exit code 3" from a multi-process job's log, so
    the alert says which of its processes took the job down; None if none is named."""
    for pattern in RANK_FAILURES:
        match = pattern.search(text)
        if match:
            where, how = match["where"], match["how"]
            if where.isdigit():  # torchrun's numbers
                where, how = f"local rank {where}", f"exitcode {how}"
            return f"rank {match['rank']} ({where}) failed first: {how}"
    return None


def launch_cut_short(*, shim_recorded: bool, abandoned: bool) -> Decision:
    """No worker was ever started and the launch is settled: `abandoned` (the daemon
    owns the attempt now) starts it again; otherwise its shim died starting it.

    The one path on which a running job is launched again without its restart policy
    asking, so `judge` sends here only a launch that provably never started a worker:
    none on record, neither in the job's row nor in `worker.json` (`WorkerSeen`), and
    the attempt's files as the daemon left them (`Processes.launch_on_disk`; else
    `files_vanished` decides, never a second run)."""
    if abandoned:
        why = ("its shim exited before starting the job (see shim.log)" if shim_recorded
               else "the daemon died while launching")
        return Decision(JobState.PENDING, None, f"{why}; launching again")
    return Decision(JobState.LOST, ExitReason.LOST, "its shim died while starting the job")


DIR_VANISHED = "its attempt directory was deleted, moved or emptied"
"""Why an attempt's files are gone while it ran (`Processes.launch_on_disk` False): an
operator's cleanup, a tmp cleaner, a `mv` of the job's directory."""


def vanished(*, stop_requested: bool, shim_recorded: bool,
             files_gone: bool = False) -> Decision:
    """A started job whose processes are all gone with no exit record; `files_gone`: its
    attempt's files had vanished too (then its shim could not record the exit)."""
    if stop_requested:  # what the user asked for, exit unknown
        why = "stopped on request (exit status unknown: its shim had died"
        return Decision(JobState.STOPPED, ExitReason.STOPPED,
                        f"{why}; {DIR_VANISHED})" if files_gone else f"{why})")
    why = ("the job's process vanished after its shim died; exit status unknown"
           if shim_recorded else
           "the job's processes vanished without recording an exit status")
    return Decision(JobState.LOST, ExitReason.LOST,
                    f"{why} ({DIR_VANISHED})" if files_gone else why)


def files_vanished(*, stop_requested: bool) -> Decision:
    """A launch whose shim is gone with no worker on record and whose attempt no longer
    holds the `launch.json` the daemon wrote before it started that shim: the attempt's
    directory was deleted, moved or emptied, its `worker.json` and claim with it. Whether
    the shim had started the worker cannot be known, so the job is not launched again
    (one run per attempt: docs/reliability.md); it ends `lost`, or `stopped` if asked."""
    if stop_requested:
        return Decision(JobState.STOPPED, ExitReason.STOPPED,
                        f"stopped on request (whether it ran is unknown: its shim ended "
                        f"and {DIR_VANISHED})")
    return Decision(JobState.LOST, ExitReason.LOST,
                    f"its shim ended and {DIR_VANISHED}: whether it started the job is "
                    "unknown, so it is not launched again")


LAUNCH_CONFIRM_S = 10.0
"""A launch recorded in the DB whose shim left no trace after this many seconds is
settled through the attempt's claim file (`Backend.settle_launch`): launched again if
the daemon can claim it, else waited for (its shim is starting) or lost."""


class WorkerSeen(StrEnum):
    """A running job's worker, as the tick's checks found it."""

    UNREAD = "unread"
    """Not looked at: an exit is recorded, or the shim runs and watches the worker."""
    NEVER_STARTED = "never started"
    """No worker was recorded, neither in the job's row nor in `worker.json`: the launch
    was cut short, or its shim is still starting it. A worker the row holds is ALIVE or
    GONE, never this, whatever became of the attempt's files (#46)."""
    ALIVE = "alive"
    """It runs: beside a suspended shim, the worker process itself; beside a gone
    shim, the worker or what it left in its process group."""
    GONE = "gone"


# made per running job per tick, never changed once made: not frozen (a frozen one
# costs several times as much to build, as `rules.JobFacts`)
@dataclass(slots=True)
class Processes:
    """The diagnosis of a running job's processes in one tick, made by the checks
    (`checks.JobChecks.diagnose`: the files and /proc it reads) for `judge`."""

    shim: ShimState
    worker: WorkerSeen
    exit: ExitStatus | None
    """The shim's end record (`status.json`): read only once the shim no longer runs."""
    shim_recorded: bool
    """The shim's identity is known (its `shim.json`, or the launch's own record)."""
    stop_requested: bool
    launch_age_s: float
    """Seconds since the attempt's launch was recorded."""
    launch_on_disk: bool = True
    """The attempt's `launch.json`, which the daemon writes before it starts the shim, is
    still there (looked at only once the shim no longer runs and no exit is recorded).
    False once a shim was started: its directory was deleted, moved or emptied."""
    worker_record: WorkerInfo | None = field(default=None, compare=False)
    """The worker's `worker.json` where the checks read it (to watch it, `WATCH_WORKER`)."""


class Step(StrEnum):
    """What the checks do next for a running job (`judge`)."""

    FINISH = "finish"
    """Its exit is recorded: `after_exit` decides what follows it."""
    RUNS = "runs"
    """Its shim runs and watches the worker: nothing to decide."""
    WAIT = "wait"
    """Nothing to do this tick: a suspended shim's worker still runs, or a launch not yet
    `LAUNCH_CONFIRM_S` old may still start."""
    RESUME_SHIM = "resume shim"
    """A suspended shim (SIGSTOP) cannot reap the ended worker nor record its exit:
    continue it (it then ends what the worker left in its group, as at any exit)."""
    WATCH_WORKER = "watch worker"
    """The shim died but the job runs on: watch the worker itself."""
    SETTLE_LAUNCH = "settle launch"
    """No worker was ever started: the claim file settles the launch (then
    `launch_cut_short` decides, unless the fate is to wait)."""
    TRANSITION = "transition"
    """`Verdict.decision` is the job's next state."""


@dataclass(frozen=True)
class Verdict:
    step: Step
    decision: Decision | None = None
    """For `Step.TRANSITION`."""


_VERDICTS = {step: Verdict(step) for step in Step if step is not Step.TRANSITION}
"""The verdicts without a decision, made once (most jobs get `RUNS` every tick)."""


def judge(seen: Processes) -> Verdict:
    """What follows from a running job's processes as the tick found them."""
    if seen.exit is not None:
        return _VERDICTS[Step.FINISH]
    if seen.shim is ShimState.RUNNING:
        return _VERDICTS[Step.RUNS]
    if seen.shim is ShimState.SUSPENDED:
        return _VERDICTS[Step.WAIT if seen.worker is WorkerSeen.ALIVE else Step.RESUME_SHIM]
    if seen.worker is WorkerSeen.ALIVE:
        return _VERDICTS[Step.WATCH_WORKER]
    if seen.worker is WorkerSeen.NEVER_STARTED:
        if seen.shim_recorded and not seen.launch_on_disk:
            # a shim was started, so its launch.json was written: the attempt's files
            # were taken from under it, its claim and worker.json with them; settling
            # would claim an empty directory and run the job a second time (#46)
            return Verdict(Step.TRANSITION,
                           files_vanished(stop_requested=seen.stop_requested))
        # a launch cut short (the daemon died before it recorded the shim, or the shim
        # exited before claiming, e.g. on a full disk where it could not reserve its
        # status file); a shim known to be dead needs no waiting
        if seen.shim_recorded or seen.launch_age_s > LAUNCH_CONFIRM_S:
            return _VERDICTS[Step.SETTLE_LAUNCH]
        return _VERDICTS[Step.WAIT]
    return Verdict(Step.TRANSITION, vanished(stop_requested=seen.stop_requested,
                                             shim_recorded=seen.shim_recorded,
                                             files_gone=not seen.launch_on_disk))


@dataclass(frozen=True)
class Dependency:
    job_id: str
    name: str
    state: JobState
    """LOST for a dependency that no longer exists."""


def before_start(*, stop_requested: bool, dependencies: Sequence[Dependency]) -> Decision | None:
    """A pending job that cannot start any more (stopped, or a dependency ended
    without success); None while it may still start (the loop checks that every
    dependency succeeded and the restart backoff has passed)."""
    if stop_requested:
        return Decision(JobState.STOPPED, ExitReason.STOPPED,
                        "stopped on request before it started")
    for dep in dependencies:
        if dep.state in (JobState.FAILED, JobState.STOPPED, JobState.LOST):
            return Decision(JobState.FAILED, None,
                            f"dependency {dep.job_id} ({dep.name}) {dep.state.value}")
        if dep.state is not JobState.SUCCEEDED:
            return None
    return None


def dependencies_met(dependencies: Sequence[Dependency]) -> bool:
    return all(dep.state is JobState.SUCCEEDED for dep in dependencies)
