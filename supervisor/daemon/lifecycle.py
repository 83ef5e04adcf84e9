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

import signal as signals
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.backends.base import SchedulerEnd
from supervisor.spec import ExitReason, JobState, RestartPolicy


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


def launch_cut_short(*, shim_recorded: bool, abandoned: bool) -> Decision:
    """No worker was ever started and the launch is settled: `abandoned` (the daemon
    owns the attempt now) starts it again; otherwise its shim died starting it."""
    if abandoned:
        why = ("its shim exited before starting the job (see shim.log)" if shim_recorded
               else "the daemon died while launching")
        return Decision(JobState.PENDING, None, f"{why}; launching again")
    return Decision(JobState.LOST, ExitReason.LOST, "its shim died while starting the job")


def vanished(*, stop_requested: bool, shim_recorded: bool) -> Decision:
    """A started job whose processes are all gone with no exit record."""
    if stop_requested:  # what the user asked for, exit unknown
        return Decision(JobState.STOPPED, ExitReason.STOPPED,
                        "stopped on request (exit status unknown: its shim had died)")
    why = ("the job's process vanished after its shim died; exit status unknown"
           if shim_recorded else
           "the job's processes vanished without recording an exit status")
    return Decision(JobState.LOST, ExitReason.LOST, why)


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
