"""The one place the daemon's engine is made: each part built with the settings it
reads and handed the collaborators it uses, explicitly (no part reaches another through
a base class or a global). `app.build_app` calls it; so do the tests and benchmarks
that run an engine in-process.

    Engine ── Backends (the local one, others made as jobs need them)
           ── Waker (a tick now, or at a time)
           ── JobChecks (backends, waker, steps, the observer's /proc stat reads)
           ── Observer (its clock, the output scan's budget)
           ── Notifier (the destinations, its backoff)
           ── AlertRecorder (the observer's views, the notifier)
           ── TickSteps ── Writability
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.notify import Notifier
from supervisor.alerting.recorder import AlertRecorder
from supervisor.alerting.wire import Destination
from supervisor.api import views
from supervisor.backends.base import Backend
from supervisor.clock import SteadyClock
from supervisor.config import Settings
from supervisor.daemon.checks import JobChecks
from supervisor.daemon.loop import Engine
from supervisor.daemon.shared import Backends, Waker
from supervisor.observe.observer import SCAN_BUDGET_S, Observer
from supervisor.storage.transactions import TickSteps, watch_writes
from supervisor.storage.writability import Writability


def build_engine(settings: Settings, sessions: sessionmaker[Session], *,
                 backend: Backend | None = None,
                 clock: Callable[[], float] | None = None) -> Engine:
    """The engine over `sessions`, its parts made from `settings`; `backend`: the local
    one (a test's own), `clock`: the steady clock of this boot on the data dir
    (`SteadyClock.of_boot`) unless a test gives one."""
    clock = clock or SteadyClock.of_boot(settings.data_dir)
    waker = Waker(clock, settings.sample_interval)
    backends = Backends(settings, on_exit=waker.wake, local=backend)
    # a tick waits for the jobs' file readings at most 1 s, less with short ticks
    observer = Observer(settings.jobs_dir,
                        scan_budget_s=min(SCAN_BUDGET_S, settings.sample_interval / 2),
                        watch_outputs=settings.output_watch == "inotify", clock=clock)
    writability = Writability()
    steps = TickSteps(writability)
    watch_writes(sessions)  # the tick's steps see what its sessions wrote
    destinations = [Destination(name, url) for name, url in (
        ("slack", settings.slack_webhook_url), ("webhook", settings.webhook_url)) if url]
    secret = settings.webhook_secret
    notifier = Notifier(destinations, sessions, clock=clock,
                        backoff_max_s=settings.notify_backoff_max_s,
                        webhook_secret=secret.get_secret_value() if secret else None,
                        wall=time.time)
    checks = JobChecks(settings, backends, waker, steps,
                       stat_of=lambda pid: observer.sampler.processes.current_stat(pid),
                       clock=clock)
    return Engine(settings, sessions, clock=clock, backends=backends, waker=waker,
                  checks=checks, observer=observer, notifier=notifier,
                  alerting=AlertRecorder(settings, observer, notifier,
                                          job_document=views.job_document), steps=steps,
                  writability=writability)
