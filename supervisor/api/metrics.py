"""Prometheus metrics, rendered at scrape time from the current state by a custom
collector: a restarted daemon never exports stale series, and the series of an ended
job disappear after `metrics_ended_retention_s`."""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from supervisor import __version__
from supervisor.alerting import rules
from supervisor.alerting.notify import Notifier
from supervisor.observe.view import JobView
from supervisor.spec import AlertState, JobState, stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Alert, Job, JobEvent

JOB_LABELS = ["job_id", "job_name"]
TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def mountpoint(path: str) -> str | None:
    """The mount point of the filesystem holding `path` (or its nearest existing parent)."""
    current = Path(path).resolve()
    while not current.exists():
        if current.parent == current:
            return None
        current = current.parent
    try:
        device = os.stat(current).st_dev
        while current.parent != current and os.stat(current.parent).st_dev == device:
            current = current.parent
    except OSError:
        return None
    return str(current)


def _gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=JOB_LABELS + (extra or []))


class JobsCollector(Collector):
    def __init__(self, sessions: sessionmaker[Session], views: Callable[[], Mapping[str, JobView]],
                 notifier: Notifier | None, ended_retention_s: float,
                 gpu_available: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.time,
                 last_tick: Callable[[], float | None] = lambda: None,
                 hostname: str | None = None, ended_max: int = 500, pending_max: int = 500):
        self.sessions = sessions
        self.ended_max = ended_max
        """Ended jobs with series: the most recently ended (`Settings.metrics_ended_max`)."""
        self.pending_max = pending_max
        """Pending jobs with series: the first in line (`Settings.metrics_pending_max`)."""
        self.views = views
        self.notifier = notifier
        self.ended_retention_s = ended_retention_s
        self.gpu_available = gpu_available
        self.clock = clock
        self.last_tick = last_tick
        """Unix time of the engine loop's last finished tick; None before the first."""
        self.hostname = hostname or socket.gethostname()
        """The machine's name in `jobsup_host_info`: what alerts and the dashboard show
        instead of the scrape address (127.0.0.1:8765 on every host)."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        now = self.clock()
        with self.sessions() as session:
            jobs = [*session.scalars(select(Job).where(Job.ended_at.is_(None),
                                                       Job.state != JobState.PENDING.value)),
                    *session.scalars(select(Job).where(Job.state == JobState.PENDING.value)
                                     .order_by(Job.created_at, Job.id).limit(self.pending_max)),
                    *session.scalars(
                        select(Job).where(Job.ended_at >= now - self.ended_retention_s)
                        .order_by(Job.ended_at.desc(), Job.id).limit(self.ended_max))]
            jobs = list({job.id: job for job in jobs}.values())
            counts = store.count_by_state(session)
            firing = session.scalars(
                select(Alert).where(Alert.state == AlertState.FIRING.value)).all()
            first_started = _first_starts(session, [job.id for job in jobs])
        outputs: set[str] = set()
        yield from _job_series(jobs, self.views(), firing, outputs)
        yield from _job_times(jobs, first_started)
        yield from _identity(self.hostname)

        yield _filesystems_free(outputs)
        yield _jobs_by_state(counts)
        yield _alerts_firing(firing)
        gpu = GaugeMetricFamily("jobsup_gpu_available",
                                "1 when NVML answers; 0 means GPU memory series are absent")
        gpu.add_metric([], 1.0 if self.gpu_available() else 0.0)
        yield gpu

        last_tick = GaugeMetricFamily(
            "jobsup_last_tick_timestamp_seconds",
            "When the engine loop last finished a tick (Unix time); alert on time() - it")
        at = self.last_tick()
        if at is not None:
            last_tick.add_metric([], at)
        yield last_tick

        if self.notifier is not None:
            for kind, counter, doc in (
                ("sent", self.notifier.sent, "Notifications delivered"),
                ("failed", self.notifier.failed, "Notifications given up (4xx but 429)"),
                ("retries", self.notifier.retried, "Delivery attempts to be retried"),
            ):
                family = CounterMetricFamily(f"jobsup_notifications_{kind}", doc,
                                             labels=["destination"])
                for destination in self.notifier.destinations:
                    family.add_metric([destination], counter[destination])
                yield family


def _job_series(jobs: Sequence[Job], views: Mapping[str, JobView], firing: Sequence[Alert],
                outputs: set[str]) -> Iterator[GaugeMetricFamily]:
    """Each job's state, progress, forecast and resources; `outputs` receives the output
    directories of running jobs (their filesystems' free bytes are a series too)."""
    state = _gauge("jobsup_job_state", "1 for the job's current state", ["state"])
    g = {name: _gauge(f"jobsup_job_{name}", doc) for name, doc in (
        ("items_done", "Items done (progress)"),
        ("items_expected", "Items expected in all (a gauge: not a counter's _total)"),
        ("files", "Output files matching the job's pattern"),
        ("bytes_written", "Bytes of the job's output files"),
        ("rate_items_per_second", "Items per second, ignoring warm-up"),
        ("eta_seconds", "Seconds until the job is projected to finish"),
        ("last_progress_timestamp_seconds", "When the item count last changed"),
        ("cpu_percent", "CPU % of the job's process tree (100 = one core)"),
        ("rss_bytes", "Resident memory of the job's process tree"),
        ("gpu_memory_bytes", "GPU memory of the job's process tree"),
        ("disk_full_in_seconds", "Seconds until the output filesystem is full"),
        ("projected_total_bytes", "Bytes the job's output will have in the end"),
        ("will_fit", "1 if the job's remaining output fits on its filesystem"),
        ("stalled", "1 while the job's stalled alert fires"),
        ("exit_code", "Exit code of the job's last attempt"),
        ("restarts", "Restarts so far"),
    )}
    metric = _gauge("jobsup_job_metric", "Worker-reported metric (loss, acc, ...)", ["name"])
    gpu_device_memory = _gauge("jobsup_job_gpu_device_memory_bytes",
                               "GPU memory of the job's process tree on one device "
                               "(gpu: the NVML index)", ["gpu"])
    stalled_jobs = {a.job_id for a in firing if a.rule == rules.STALLED}
    for job in jobs:
        labels = [job.id, job.name]
        view = views.get(job.id)
        # an end the database could not take yet is shown as the API shows it (#30)
        end = view.unrecorded_end if view is not None else None
        job_state = end.state if end is not None else job.state
        exit_code = end.exit_code if end is not None else job.exit_code
        for s in JobState:
            state.add_metric([*labels, s.value], 1.0 if job_state == s.value else 0.0)
        g["restarts"].add_metric(labels, job.restarts)
        g["stalled"].add_metric(labels, 1.0 if job.id in stalled_jobs else 0.0)
        if exit_code is not None:
            g["exit_code"].add_metric(labels, exit_code)
        spec = stored_spec(job.spec_json)
        if job_state == JobState.RUNNING.value and spec.output_dir:
            outputs.add(spec.output_dir)
        if view is None:
            if spec.expected_items is not None:
                g["items_expected"].add_metric(labels, spec.expected_items)
            continue
        p, f, r = view.progress, view.forecast, view.resources
        values = {
            "items_done": p.items_done, "items_expected": p.items_total, "files": p.files,
            "bytes_written": p.bytes_written, "rate_items_per_second": f.rate_items_per_s,
            "eta_seconds": f.eta_s, "disk_full_in_seconds": f.disk_full_in_s,
            "projected_total_bytes": f.projected_total_bytes,
            "will_fit": None if f.will_fit is None else float(f.will_fit),
            "gpu_memory_bytes": r.gpu_memory_bytes,
            "last_progress_timestamp_seconds": p.last_progress_at,
        }
        if job_state == JobState.RUNNING.value:
            values.update(cpu_percent=r.cpu_percent, rss_bytes=r.rss_bytes)
        for name, value in values.items():
            if value is not None:
                g[name].add_metric(labels, float(value))
        for name, value in p.metrics.items():
            metric.add_metric([*labels, name], value)
        for device in r.gpu_devices or ():
            gpu_device_memory.add_metric([*labels, str(device.index)], device.memory_bytes)
    yield state
    yield from g.values()
    yield metric
    yield gpu_device_memory


def _filesystems_free(outputs: set[str]) -> GaugeMetricFamily:
    free = GaugeMetricFamily("jobsup_filesystem_free_bytes",
                             "Free bytes of a filesystem running jobs write to",
                             labels=["mountpoint"])
    for mount in sorted({m for m in map(mountpoint, outputs) if m}):
        try:
            st = os.statvfs(mount)
        except OSError:
            continue
        free.add_metric([mount], st.f_bavail * st.f_frsize)
    return free


def _jobs_by_state(counts: Mapping[str, int]) -> GaugeMetricFamily:
    """Every job the daemon knows, by state: also those without series of their own (ended
    longer ago than the retention, beyond the most recent `metrics_ended_max`, or pending
    behind the first `metrics_pending_max`)."""
    family = GaugeMetricFamily("jobsup_jobs", "Jobs in each state (all of them)",
                               labels=["state"])
    for state in JobState:
        family.add_metric([state.value], float(counts.get(state.value, 0)))
    return family


def _alerts_firing(firing: Sequence[Alert]) -> GaugeMetricFamily:
    counts = {rule: 0 for rule in rules.RULES}
    for alert in firing:
        counts[alert.rule] = counts.get(alert.rule, 0) + 1
    alerts_firing = GaugeMetricFamily("jobsup_alerts_firing", "Firing alerts per rule",
                                      labels=["rule"])
    for rule, count in counts.items():
        alerts_firing.add_metric([rule], count)
    return alerts_firing


def _first_starts(session: Session, job_ids: list[str]) -> dict[str, float]:
    """When each job's first attempt started (its first transition to running)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(JobEvent.job_id, func.min(JobEvent.t))
        .where(JobEvent.job_id.in_(job_ids), JobEvent.to_state == JobState.RUNNING.value)
        .group_by(JobEvent.job_id)).all()
    return {job_id: t for job_id, t in rows}


def _job_times(jobs: Sequence[Job],
               first_started: Mapping[str, float]) -> Iterator[GaugeMetricFamily]:
    """Times, not counts, so that alert rules can see what happened before Prometheus's
    first sample: `time() - jobsup_job_ended_timestamp_seconds < 900` holds from the first
    scrape after a crash, where `increase()` or `offset` of a new series has nothing to
    compare with."""
    ended = _gauge("jobsup_job_ended_timestamp_seconds",
                   "When the job ended (Unix time); absent while it has not")
    first = _gauge("jobsup_job_first_started_timestamp_seconds",
                   "When the job's first attempt started (Unix time); with "
                   "jobsup_job_restarts, how fast it restarts")
    for job in jobs:
        labels = [job.id, job.name]
        if job.ended_at is not None:
            ended.add_metric(labels, job.ended_at)
        if job.id in first_started:
            first.add_metric(labels, first_started[job.id])
    yield ended
    yield first


def _identity(hostname: str) -> Iterator[GaugeMetricFamily]:
    """Info metrics (value 1): which build runs, and on which machine. Rules and the
    dashboard join them on `instance` (`* on (instance, job) group_left (hostname)
    jobsup_host_info`)."""
    build = GaugeMetricFamily("jobsup_build_info", "The jobsup daemon's version and Python",
                              labels=["version", "python"])
    build.add_metric([__version__, platform.python_version()], 1.0)
    yield build
    host = GaugeMetricFamily("jobsup_host_info", "The machine the jobsup daemon runs on",
                             labels=["hostname"])
    host.add_metric([hostname], 1.0)
    yield host


def build_registry(collector: JobsCollector) -> tuple[CollectorRegistry, Histogram]:
    """The daemon's own registry (never the global one) and its tick histogram."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    tick = Histogram("jobsup_tick_duration_seconds", "Duration of one engine tick",
                     buckets=TICK_BUCKETS, registry=registry)
    return registry, tick
