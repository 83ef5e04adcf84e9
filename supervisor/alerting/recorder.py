"""The engine's alert step: evaluate the pure rules (`rules.py`) over what the observer
knows of each job, record what opened, resolved or changed, and put the messages in the
outbox in the same transaction. With the database's disk full, new alerts are sent
straight away from memory and recorded (never sent twice) once space returns.

A message tells of its alert from the alert's row (`message_alert`) and of its job as the
API shows it, through the builder the daemon gives (`job_document`: the API's own)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.orm import Session

from supervisor.alerting import rules
from supervisor.alerting.messages import JobDocument, MessageAlert, MessageContext, compose
from supervisor.alerting.notify import Notifier
from supervisor.config import Settings
from supervisor.formatting import iso
from supervisor.observe.observer import Observer
from supervisor.observe.view import JobEnd, JobView, ProgressRecord
from supervisor.runtime.fileio import tail_lines
from supervisor.runtime.files import log_path
from supervisor.spec import AlertState, JobState, stored_spec
from supervisor.storage import outbox, store
from supervisor.storage.tables import Alert, Job

log = logging.getLogger(__name__)

RECENTLY_ENDED_S = 600.0
"""Ended jobs are evaluated for this long after their end (see `record`)."""

def message_alert(alert: Alert) -> MessageAlert:
    """An alert's row as its messages tell it."""
    return MessageAlert(id=alert.id, job_id=alert.job_id, rule=alert.rule,
                        severity=alert.severity, state=alert.state,
                        started_at=iso(alert.started_at) or "",
                        resolved_at=iso(alert.resolved_at), message=alert.message)


class AlertRecorder:
    def __init__(self, settings: Settings, observer: Observer, notifier: Notifier, *,
                 job_document: Callable[[Job, JobView | None], JobDocument]):
        self.settings = settings
        self.observer = observer
        self.notifier = notifier
        self.job_document = job_document
        """A job's row and view as the API shows the job (`api.views.job_document`):
        what a message says of its job."""
        self.rules = rules.AlertSettings(
            disk_low_bytes=settings.disk_low_bytes,
            gpu_memory_high_fraction=settings.gpu_memory_high_fraction,
            ended_alert_ttl_s=settings.ended_alert_ttl_s)
        self.context = MessageContext(host=settings.resolved_hostname,
                                      public_url=settings.resolved_public_url,
                                      grafana_url=settings.grafana_url)
        self._sent_unrecorded: dict[tuple[str, str], float] = {}
        """(job, rule) of alerts sent while the database was full -> when they fired."""
        self._ended_evaluated_until = 0.0
        """Every job that ended before this time has been evaluated after its end by a
        pass whose writes committed (`ended_evaluated`): later passes need not read it
        again. 0 in a new daemon: it evaluates the last RECENTLY_ENDED_S (#30: 10,000
        jobs failed by one dependency were read and evaluated every tick for 10 min)."""

    def forget_sent(self, recorded: Iterable[tuple[str, str]]) -> None:
        """These alerts sent unrecorded are now in the database (its commit succeeded)."""
        for key in recorded:
            self._sent_unrecorded.pop(key, None)

    def send_unrecorded(self, session: Session, running: Sequence[Job], now: float,
                        ends: Mapping[str, JobEnd] | None = None) -> None:
        """The database cannot take alerts (or the ends they follow from: `ends`, by job
        id): send the new ones straight away, from memory, once each; they are recorded
        (and not sent again) when the database takes writes again."""
        open_keys = {(a.job_id, a.rule) for a in store.alerts(session, state=AlertState.FIRING)}
        ends = ends or {}
        for job in running:
            end = ends.get(job.id)
            for f in rules.evaluate(self.facts(job, now, end), now=now,
                                     settings=self.rules):
                key = (f.job_id, f.rule)
                if key in open_keys or key in self._sent_unrecorded:
                    continue
                self._sent_unrecorded[key] = now
                log.warning("job %s: alert %s firing (not recorded: the database cannot be "
                            "written): %s", f.job_id, f.rule, f.message)
                alert = MessageAlert(id=0, job_id=f.job_id, rule=f.rule,
                                     severity=f.severity, state=AlertState.FIRING.value,
                                     started_at="", resolved_at=None, message=f.message)
                self.notifier.send_unrecorded(self._message("firing", job, alert, now, end))

    def record(self, session: Session, running: Sequence[Job], now: float,
               recorded: list[tuple[str, str]], *,
               ended_lately: Sequence[Job] | None = None) -> None:
        """Evaluate the rules for the jobs that ran this tick, ended lately or have firing
        alerts; record what opened, resolved or changed, with its outbox messages, and
        queue the messages of recent successes. `recorded` receives the alerts sent
        unrecorded earlier that this records. `ended_lately`: the jobs that ended since
        `ended_since(now)`, where the caller read them already (else they are read)."""
        # read every pass, whoever opened them (~0.26 ms of CPU with none firing, #31)
        open_rows = store.alerts(session, state=AlertState.FIRING)
        if ended_lately is None:
            ended_lately = store.jobs_ended_since(session, self.ended_since(now))
        jobs = self._jobs_to_evaluate(session, running, ended_lately, open_rows)
        firing = [f for job in jobs.values()
                  for f in rules.evaluate(self.facts(job, now), now=now,
                                           settings=self.rules)]
        changes = rules.reconcile(
            firing, [rules.OpenAlert(a.id, a.job_id, a.rule) for a in open_rows],
            {a.id: a.message for a in open_rows}, settled_job_ids=jobs)
        self._write(session, changes, {a.id: a for a in open_rows}, jobs, now, recorded)
        self._record_sent_unrecorded(session, {(f.job_id, f.rule) for f in firing}, jobs,
                                     now, recorded)
        self._announce_successes(session, jobs.values(), now)

    def ended_since(self, now: float) -> float:
        """Jobs that ended since then are evaluated: those of the last
        `RECENTLY_ENDED_S` that no committed pass has evaluated yet (a job ended by this
        engine has `ended_at` <= the `now` of the tick that recorded it, and is among
        that tick's running jobs, or, ended in the tick's later steps, at its `now`)."""
        return max(now - RECENTLY_ENDED_S, self._ended_evaluated_until)

    def ended_evaluated(self, now: float) -> None:
        """The pass of the tick at `now` committed: the jobs that ended before `now`
        were all evaluated (the running ones, and `ended_since`'s)."""
        self._ended_evaluated_until = now

    @staticmethod
    def _jobs_to_evaluate(session: Session, running: Sequence[Job], ended_lately: Sequence[Job],
                          open_rows: Sequence[Alert]) -> dict[str, Job]:
        """This tick's running jobs, the jobs that ended lately (if the daemon died
        between recording a job's end and this step, their `crashed`/`incomplete` alert
        is opened now; once: an open alert is never opened again) and the jobs of open
        alerts (those not among the others read in one query: an ended job's `crashed`
        stays open for a day, and a query per such job per tick added up)."""
        jobs = {job.id: job for job in running}
        for job in ended_lately:
            jobs.setdefault(job.id, job)
        others = store.jobs_with_ids(session, {row.job_id for row in open_rows} - jobs.keys())
        for row in open_rows:
            if row.job_id not in jobs:
                jobs[row.job_id] = others.get(row.job_id) or store.get_job(session, row.job_id)
        return jobs

    def _write(self, session: Session, changes: rules.Changes, rows: dict[int, Alert],
               jobs: dict[str, Job], now: float, recorded: list[tuple[str, str]]) -> None:
        """Opened, resolved and reworded alerts, with their messages."""
        for f in changes.opened:
            told_at = self._sent_unrecorded.get((f.job_id, f.rule))  # while the disk was full
            alert = store.open_alert(session, job_id=f.job_id, rule=f.rule, severity=f.severity,
                                     message=f.message, started_at=told_at or now)
            log.warning("job %s: alert %s firing: %s", f.job_id, f.rule, f.message)
            if told_at is not None:
                recorded.append((f.job_id, f.rule))
                continue
            self._enqueue(session, "firing", jobs[f.job_id], alert, now)
        for opened in changes.resolved:
            alert = rows[opened.id]
            store.resolve_alert(alert, now=now)
            log.info("job %s: alert %s resolved", alert.job_id, alert.rule)
            if alert.rule not in rules.EVENT_RULES:  # those only age out
                self._enqueue(session, "resolved", jobs[alert.job_id], alert, now)
        for opened, message in changes.updated:
            store.reword_alert(rows[opened.id], message)

    def _record_sent_unrecorded(self, session: Session, firing: set[tuple[str, str]],
                                jobs: dict[str, Job], now: float,
                                recorded: list[tuple[str, str]]) -> None:
        """Alerts that fired and ended while nothing could be written: recorded as
        resolved, with their resolved message."""
        for key, started_at in list(self._sent_unrecorded.items()):
            if key in firing or key[0] not in jobs:
                continue  # still firing (recorded by `_write`) or its job not evaluated
            recorded.append(key)
            rule = key[1]
            alert = store.open_alert(
                session, job_id=key[0], rule=rule, severity=rules.SEVERITY[rule],
                message="(sent while the database could not be written)", started_at=started_at,
                resolved_at=now)
            self._enqueue(session, "resolved", jobs[key[0]], alert, now)

    def _announce_successes(self, session: Session, jobs: Iterable[Job], now: float) -> None:
        """A message per job that succeeded lately and has none in the outbox yet (this
        tick's, and those of a daemon that died between recording the end and this
        step). Not an alert: no alert row, a `succeeded` message only."""
        if not (self.settings.notify_on_success and self.notifier.destinations):
            return
        succeeded = [job for job in jobs if job.state == JobState.SUCCEEDED.value
                     and (job.ended_at or now) >= now - RECENTLY_ENDED_S]
        told = outbox.jobs_notified(session, "succeeded",
                                    {job.id: job.started_at or 0.0 for job in succeeded})
        for job in succeeded:
            if job.id not in told:
                self._enqueue(session, "succeeded", job, None, now)

    def facts(self, job: Job, now: float, end: JobEnd | None = None) -> rules.JobFacts:
        """The rules' facts of a job: its row, or the end `end` its row could not take
        yet, and what the observer knows of it."""
        return job_facts(job, self.observer.views.get(job.id), end=end,
                         last_progress_at=self.observer.last_progress_at(job.id))

    def _enqueue(self, session: Session, kind: str, job: Job, alert: Alert | None,
                 now: float) -> None:
        if not self.notifier.destinations:
            return
        message = self._message(kind, job, message_alert(alert) if alert else None, now)
        self.notifier.enqueue(session, kind, message, job_id=job.id,
                              alert_id=alert.id if alert else None, now=now)

    def _message(self, kind: str, job: Job, alert: MessageAlert | None,
                 now: float, end: JobEnd | None = None) -> dict[str, Any]:
        view = self.observer.views.get(job.id)
        if end is not None:
            view = replace(view or JobView(progress=ProgressRecord()), unrecorded_end=end)
        snapshot = self.job_document(job, view)
        lines, _ = (tail_lines(log_path(self.settings.jobs_dir, job.id, job.attempt),
                               rules.LOG_TAIL_LINES) if job.attempt else ([], 0))
        return compose(kind, snapshot, log_tail=lines, alert=alert, context=self.context,
                       now=now)


def job_facts(job: Job, view: JobView | None, *, end: JobEnd | None = None,
              last_progress_at: float | None = None) -> rules.JobFacts:
    """The rules' facts of a job (the one place they are built): its row, or the end
    `end` its row could not take yet, and what the observer knows of it (`view`, and
    when its last item came); a job rebuilt from the data dir has only the progress its
    progress file tells (`rebuild.py`)."""
    spec = stored_spec(job.spec_json)
    progress = view.progress if view else None
    forecast = view.forecast if view else None
    ended = end or JobEnd(state=job.state, reason=job.reason, exit_code=job.exit_code,
                          signal=job.signal, exit_reason=job.exit_reason,
                          ended_at=job.ended_at)
    return rules.JobFacts(
        job_id=job.id, name=job.name, state=JobState(ended.state), reason=ended.reason,
        exit_code=ended.exit_code, signal=ended.signal, exit_reason=ended.exit_reason,
        attempt=job.attempt, started_at=job.started_at, ended_at=ended.ended_at,
        stall_timeout_s=spec.stall_timeout_s, startup_timeout_s=spec.startup_timeout_s,
        items_done=progress.items_done if progress else None,
        items_expected=spec.expected_items,
        first_item_at=view.first_item_at if view else None,
        last_progress_at=last_progress_at,
        activity_at=view.activity_at if view else None,
        eta_s=forecast.eta_s if forecast else None,
        disk_free_bytes=forecast.disk_free_bytes if forecast else None,
        log_disk_free_bytes=view.log_disk_free_bytes if view else None,
        disk_full_in_s=forecast.disk_full_in_s if forecast else None,
        will_fit=forecast.will_fit if forecast else None,
        gpu_memory_fraction=view.gpu_memory_fraction if view else None,
        metrics=progress.metrics if progress else {},
        min_acceptance_length=spec.min_acceptance_length,
        queued=view.queued if view else False,
        running_since=view.running_since if view else None,
        output_contract=spec.output_dir is not None or spec.expected_items is not None,
    )
