"""Alert rules: pure functions from what is known of a job at `now` to the alerts that
should be firing, and the reconciliation with the alerts already open. No I/O, no clock.

Rules (docs/api.md): `crashed` (the job failed or was lost), `stalled` (phase-aware, below),
`disk_will_fill` (the filesystem fills before the job's projected end), `disk_low` (its
output's filesystem, else its log's where that is another one),
`gpu_memory_high`, `incomplete` (exit 0 with fewer items than expected),
`low_acceptance` (below).

`stalled` is phase-aware (docs/architecture.md, "Decisions"). Before the first item a
model may load for 24 minutes without output, so the job is stalled only when it shows no
activity at all
(CPU time, read bytes and GPU memory all flat) for `stall_timeout_s`, or when it passes
`startup_timeout_s`; the first only for a job with an output contract (`output_dir` or
`expected_items`): a quiet job that never said what progress looks like may simply be
idle (a server, a notebook kernel, a `sleep`), and was 600 s of Slack noise (#32).
After the first item it is stalled when no new item arrives for `stall_timeout_s`.
Both clocks start when the job began running on a node: its launch, or for a job that
waited in a cluster scheduler's queue (a SLURM job PENDING, `queued`), when it left the
queue (`running_since`). A queued job is never stalled: hours in the queue are no stall,
and a job that has just left it gets the whole window.

`low_acceptance` is for jobs that measure an EAGLE-3 draft (`workers.evaluate`): the
job's reported metric `acceptance_length` (tokens per target pass, the bonus token
included) below the spec's `min_acceptance_length` (None: the rule is off), while it
runs (the mean so far) and after it succeeded (the final figure). Like `crashed` and
`incomplete` it then stays firing until the ended-alert TTL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from supervisor.formatting import format_bytes, format_duration
from supervisor.spec import JobState

CRASHED, STALLED, DISK_WILL_FILL = "crashed", "stalled", "disk_will_fill"
DISK_LOW, GPU_MEMORY_HIGH, INCOMPLETE = "disk_low", "gpu_memory_high", "incomplete"
LOW_ACCEPTANCE = "low_acceptance"
RULES = (CRASHED, STALLED, DISK_WILL_FILL, DISK_LOW, GPU_MEMORY_HIGH, INCOMPLETE,
         LOW_ACCEPTANCE)
SEVERITY = {CRASHED: "critical", STALLED: "warning", DISK_WILL_FILL: "critical",
            DISK_LOW: "warning", GPU_MEMORY_HIGH: "warning", INCOMPLETE: "warning",
            LOW_ACCEPTANCE: "warning"}
EVENT_RULES = frozenset({CRASHED, INCOMPLETE, LOW_ACCEPTANCE})
"""Rules about how a job ended: they stay firing for `AlertSettings.ended_alert_ttl_s`
after the end (nothing can resolve them), then resolve quietly."""

LOG_TAIL_LINES = 20
"""Lines read from the end of an attempt's log: searched for known crash causes
(`daemon.lifecycle.classify_exit`) and quoted in the alert's messages (`log_tail`,
docs/api.md)."""

ACCEPTANCE_METRIC = "acceptance_length"
ACCEPTANCE_RATE_PREFIX = "acceptance_rate_pos"
"""`acceptance_rate_pos<i>`: the share of passes accepting draft position i, given i-1."""
BASELINE_METRIC = "baseline_acceptance_length"


@dataclass(frozen=True)
class AlertSettings:
    disk_low_bytes: int = 5_000_000_000
    """`disk_low` below this many free bytes on a running job's output filesystem."""
    gpu_memory_high_fraction: float = 0.95
    """`gpu_memory_high` when a GPU the job uses is fuller than this."""
    ended_alert_ttl_s: float = 86_400.0


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class JobFacts:
    """What the rules know of one job at one moment (times in seconds since the epoch)."""

    job_id: str
    name: str
    state: JobState
    reason: str | None
    exit_code: int | None
    signal: int | None
    exit_reason: str | None
    attempt: int
    started_at: float | None
    ended_at: float | None
    stall_timeout_s: float
    startup_timeout_s: float | None
    items_done: int | None = None
    items_expected: int | None = None
    first_item_at: float | None = None
    """When this attempt produced its first item (None: still warming up)."""
    last_progress_at: float | None = None
    activity_at: float | None = None
    """Last time CPU time, read bytes or GPU memory moved."""
    eta_s: float | None = None
    disk_free_bytes: int | None = None
    log_disk_free_bytes: int | None = None
    """Free bytes on the filesystem of its log, where that is not its output's."""
    disk_full_in_s: float | None = None
    will_fit: bool | None = None
    gpu_memory_fraction: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The job's latest reported metrics (its progress file)."""
    min_acceptance_length: float | None = None
    queued: bool = False
    """Launched, waiting in a cluster scheduler's queue: not running on a node yet."""
    running_since: float | None = None
    """When it left that queue and began running; None while queued, and for a job that
    never waited in one (`started_at`, its launch, is its start)."""
    output_contract: bool = True
    """It said where its items appear (`output_dir` or `expected_items`), so silence
    before the first item is a stall; without one, only `startup_timeout_s` is."""


@dataclass(frozen=True)
class Firing:
    job_id: str
    rule: str
    severity: str
    message: str


@dataclass(frozen=True)
class OpenAlert:
    """An alert recorded as firing."""

    id: int
    job_id: str
    rule: str


@dataclass(frozen=True)
class Changes:
    opened: tuple[Firing, ...]
    resolved: tuple[OpenAlert, ...]
    updated: tuple[tuple[OpenAlert, str], ...]
    """Still firing with a new message (e.g. stalled for longer): (alert, message)."""


def evaluate(job: JobFacts, *, now: float, settings: AlertSettings) -> list[Firing]:
    """The alerts that should be firing for this job now."""
    out: list[Firing] = []

    def fire(rule: str, message: str) -> None:
        out.append(Firing(job.job_id, rule, SEVERITY[rule], message))

    if (job.state in (JobState.FAILED, JobState.LOST) and job.attempt > 0
            and _recent(job, now, settings)):
        fire(CRASHED, f"{job.name} {job.state}: {job.reason or 'no reason recorded'}")
    if (job.state == JobState.SUCCEEDED and job.items_expected is not None
            and job.items_done is not None and job.items_done < job.items_expected
            and _recent(job, now, settings)):
        fire(INCOMPLETE, f"{job.name} exited 0 with {job.items_done} of "
                         f"{job.items_expected} expected items")
    low = low_acceptance_message(job)
    if low and job.state in (JobState.RUNNING, JobState.SUCCEEDED) and _recent(job, now, settings):
        fire(LOW_ACCEPTANCE, low)
    if job.state != JobState.RUNNING:
        return out

    stalled = stall_message(job, now)
    if stalled:
        fire(STALLED, stalled)
    if job.will_fit is False:
        fire(DISK_WILL_FILL, f"{job.name}: its remaining output does not fit in the "
                             f"{format_bytes(job.disk_free_bytes)} free")
    elif (job.disk_full_in_s is not None and job.eta_s is not None
          and job.disk_full_in_s < job.eta_s):
        fire(DISK_WILL_FILL, f"{job.name}: disk full in {format_duration(job.disk_full_in_s)}, "
                             f"before the job ends in {format_duration(job.eta_s)}")
    if job.disk_free_bytes is not None and job.disk_free_bytes < settings.disk_low_bytes:
        fire(DISK_LOW, f"{job.name}: only {format_bytes(job.disk_free_bytes)} free "
                       "on its output disk")
    elif (job.log_disk_free_bytes is not None
          and job.log_disk_free_bytes < settings.disk_low_bytes):
        fire(DISK_LOW, f"{job.name}: only {format_bytes(job.log_disk_free_bytes)} free "
                       "on the disk of its log (the data dir's)")
    if (job.gpu_memory_fraction is not None
            and job.gpu_memory_fraction >= settings.gpu_memory_high_fraction):
        fire(GPU_MEMORY_HIGH, f"{job.name}: GPU memory {job.gpu_memory_fraction:.0%} full")
    return out


def stall_message(job: JobFacts, now: float) -> str | None:
    """Why a running job counts as stalled, or None (see the module docstring): its
    clocks count from when it began running on a node, never its time in a queue."""
    if job.started_at is None or job.queued:
        return None
    begun = max(job.running_since or job.started_at, job.started_at)
    if job.first_item_at is None:
        if job.startup_timeout_s is not None and now - begun > job.startup_timeout_s:
            return (f"{job.name}: no first item {format_duration(now - begun)} "
                    "after start "
                    f"(startup timeout {format_duration(job.startup_timeout_s)})")
        quiet_since = max(job.activity_at or begun, begun)
        if job.output_contract and now - quiet_since > job.stall_timeout_s:
            return (f"{job.name}: no activity (CPU, reads, GPU memory flat) for "
                    f"{format_duration(now - quiet_since)} before its first item")
        return None
    last = job.last_progress_at or job.first_item_at
    if now - last > job.stall_timeout_s:
        done = f" at {job.items_done} items" if job.items_done is not None else ""
        return f"{job.name}: no new item for {format_duration(now - last)}{done}"
    return None


def low_acceptance_message(job: JobFacts) -> str | None:
    """Why the job's measured acceptance length is too low, with the per-position
    acceptance rates (where the chain breaks) and the untrained baseline; None when the
    rule is off, nothing is reported yet, or it is high enough."""
    threshold, metrics = job.min_acceptance_length, job.metrics
    value = metrics.get(ACCEPTANCE_METRIC)
    if threshold is None or value is None or not value < threshold:
        return None
    message = (f"{job.name}: acceptance length {value:.2f} tokens per target pass, below "
               f"{threshold:g}")
    rates = sorted((int(name.removeprefix(ACCEPTANCE_RATE_PREFIX)), rate)
                   for name, rate in metrics.items()
                   if name.startswith(ACCEPTANCE_RATE_PREFIX)
                   and name.removeprefix(ACCEPTANCE_RATE_PREFIX).isdigit())
    if rates:
        message += "; accepted per draft position: " + ", ".join(
            f"pos{i} {rate:.0%}" for i, rate in rates)
    baseline = metrics.get(BASELINE_METRIC)
    if baseline is not None:
        message += f"; an untrained draft gets {baseline:.2f}"
    if job.state == JobState.RUNNING:
        message += " (so far: still measuring)"
    return message


def reconcile(firing: Iterable[Firing], open_alerts: Iterable[OpenAlert],
              messages: Mapping[int, str], *, settled_job_ids: Iterable[str] = ()) -> Changes:
    """What to record: alerts to open (one per job and rule, never a duplicate), alerts
    to resolve (no longer firing), and open alerts whose message changed. Open alerts of
    jobs not evaluated this time are left alone unless their job is in `settled_job_ids`
    (jobs evaluated, or known gone)."""
    wanted = {(f.job_id, f.rule): f for f in firing}
    settled = set(settled_job_ids) | {f.job_id for f in wanted.values()}
    opened, resolved, updated = [], [], []
    open_keys = set()
    for alert in open_alerts:
        key = (alert.job_id, alert.rule)
        open_keys.add(key)
        if key in wanted:
            if messages.get(alert.id) != wanted[key].message:
                updated.append((alert, wanted[key].message))
        elif alert.job_id in settled:
            resolved.append(alert)
    for key, f in wanted.items():
        if key not in open_keys:
            opened.append(f)
    return Changes(tuple(opened), tuple(resolved), tuple(updated))


def _recent(job: JobFacts, now: float, settings: AlertSettings) -> bool:
    return job.ended_at is None or now - job.ended_at < settings.ended_alert_ttl_s

