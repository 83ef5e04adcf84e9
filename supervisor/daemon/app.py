"""`jobsup serve`: lock the data dir (and a PostgreSQL database), upgrade the schema,
re-adopt jobs, serve the API."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from supervisor.api.metrics import JobsCollector, build_registry
from supervisor.api.routes import TickTimes, create_app
from supervisor.config import Settings
from supervisor.daemon.connections import (
    ConnectionBounds,
    listen_backlog,
    max_connections,
    quiet_accept_errors,
    raise_open_file_limit,
)
from supervisor.daemon.loop import Engine
from supervisor.daemon.recovery import check_jobs_elsewhere, open_database
from supervisor.daemon.wiring import build_engine
from supervisor.errors import DatabaseTaken, JobsElsewhere, UnsafeBind
from supervisor.storage.database import DatabaseLock, database_lock, make_sessionmaker
from supervisor.storage.filelock import FileLock

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_bind(settings: Settings) -> None:
    if not is_loopback(settings.host) and not settings.token:
        raise UnsafeBind(
            f"refusing to listen on {settings.host} without a token",
            hint="set JOBSUP_TOKEN (clients send it as a bearer token), or bind 127.0.0.1",
        )


@contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[FileLock]:
    """Hold an exclusive lock on `<data_dir>/daemon.lock` while the daemon lives
    (`FileLock`: dropped by the kernel when the process dies, even by SIGKILL; the file
    records the pid; confirmed before each tick, so a deleted lock file is seen)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(data_dir / "daemon.lock", what=str(data_dir),
                    hint="use that daemon, stop it first, or pass another --data-dir")
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


class TickWatch:
    """The engine loop's pace, for /healthz and /metrics: when it last finished a tick
    (`Engine.last_tick_at`) and how long that tick took (through `Engine.on_tick`)."""

    def __init__(self, engine: Engine, observe: Callable[[float], None]):
        self.engine = engine
        self.observe = observe
        self.duration_s = 0.0

    def on_tick(self, seconds: float) -> None:
        self.duration_s = seconds
        self.observe(seconds)

    def times(self) -> TickTimes | None:
        """Seconds since the last finished tick and its duration; None before start."""
        at = self.engine.last_tick_at
        if at is None:
            return None
        return TickTimes(age_s=max(0.0, time.monotonic() - at), duration_s=self.duration_s)

    def last_tick_time(self) -> float | None:
        """Unix time of the last finished tick; None before the loop started."""
        times = self.times()
        return None if times is None else time.time() - times.age_s


class LockGuard:
    """The engine's `may_tick`: a tick runs only while the daemon's locks are confirmed:
    on its data dir (`FileLock.confirm`: its lock file still the one it holds, locked
    again if it was deleted) and on its database (`DatabaseLock.confirm`: taken again if
    its connection dropped). Lost to another daemon, this daemon stops acting at once (no
    tick runs again) and the server is asked to exit; `serve` then fails with the error
    (exit code 1). Its jobs keep running under the other daemon: they are not stopped,
    not even with `--stop-jobs-on-exit` (docs/reliability.md)."""

    def __init__(self, lock: DatabaseLock, data_dir: FileLock | None = None):
        self.lock = lock
        self.data_dir = data_dir
        self.lost: DatabaseTaken | None = None
        self.exit: Callable[[], None] = lambda: None
        """Asks the HTTP server to exit (`serve` sets it)."""

    def __call__(self) -> bool:
        if self.lost is not None:
            return False
        try:
            return (self.data_dir is None or self.data_dir.confirm()) and self.lock.confirm()
        except DatabaseTaken as exc:
            self.lost = exc
            log.error("%s; exiting", exc.message)
            self.exit()
            return False


def build_app(settings: Settings, guard: LockGuard | None = None, *,
              on_started: Callable[[], None] = lambda: None) -> FastAPI:
    """The app with its engine started and stopped by the app's lifespan; `guard`: the
    database lock the engine's ticks need (None: none, for a caller that holds none);
    `on_started`: called in the server's event loop once the engine has started."""
    db_engine = open_database(settings)  # checked, upgraded, rebuilt if it was lost
    try:
        check_jobs_elsewhere(db_engine, settings, time.time())
    except JobsElsewhere:
        db_engine.dispose()
        raise
    sessions = make_sessionmaker(db_engine, jobs_dir=settings.jobs_dir)
    engine = build_engine(settings, sessions)
    if guard is not None:
        engine.may_tick = guard

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        on_started()
        try:
            yield
        finally:
            try:
                # the HTTP server is closed by now; a lost database's jobs are another's
                if settings.stop_jobs_on_exit and (guard is None or guard.lost is None):
                    await asyncio.to_thread(engine.stop_jobs)
            finally:
                engine.stop()
                db_engine.dispose()

    collector = JobsCollector(sessions, engine.views, engine.notifier,
                              settings.metrics_ended_retention_s,
                              ended_max=settings.metrics_ended_max,
                              pending_max=settings.metrics_pending_max,
                              gpu_available=lambda: engine.observer.sampler.gpu.available,
                              clock=engine.clock,
                              hostname=settings.resolved_hostname,
                              last_tick=lambda: ticks.last_tick_time())
    registry, tick_histogram = build_registry(collector)
    ticks = TickWatch(engine, tick_histogram.observe)
    engine.on_tick = ticks.on_tick
    app = create_app(settings, sessions, wake=engine.wake, views=engine.views,
                     registry=registry, clock=engine.clock,
                     last_tick=ticks.times, writability=engine.writability)
    app.router.lifespan_context = lifespan
    app.state.engine = engine
    return app


GC_YOUNG_THRESHOLD = 10_000
"""Container objects allocated (net) before the collector looks at the youngest
generation (process-wide: the API's threads too). CPython 3.11-3.13's default is 700,
which a tick of 40 jobs passes about once, each time walking what the tick still holds;
at 10,000 a collection comes every dozen ticks or so. What waits longer is garbage in
reference cycles (anything else is freed at once), and the older generations, collected
every 10 and 100 young collections as before. The daemon's code makes few cycles (an
exception kept with its traceback would be one), so what that holds back is what
~30 s of them hold (#15)."""


def settle_heap() -> None:
    """Before serving: what the daemon built to start (FastAPI, pydantic, SQLAlchemy,
    the modules: over 100,000 objects) lives as long as it does, so it is put out of
    the collector's reach (a collection of the eldest generation no longer walks it
    all: 40 jobs, 0.92/0.95 -> 0.70/0.84 ms of CPU per job per tick in one A/B session),
    and the youngest generation is collected every `GC_YOUNG_THRESHOLD` objects (#15)."""
    gc.collect()  # startup's garbage is not kept for good
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def serve(settings: Settings) -> None:
    check_bind(settings)
    settings.jobs_dir.mkdir(parents=True, exist_ok=True)
    _, open_files = raise_open_file_limit()
    with data_dir_lock(settings.data_dir) as data_dir, \
            database_lock(settings.resolved_database_url) as lock:
        guard = LockGuard(lock, data_dir)
        ready_line = (f"jobsup daemon ready on http://{settings.host}:{settings.port} "
                      f"(data dir {settings.data_dir})")

        announcing: list[asyncio.Task[None]] = []

        async def announce_when_serving() -> None:
            """The ready line once the port is bound (uvicorn binds it after the
            lifespan's start: a startup-only wait)."""
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.02)
            if server.started:
                log.info("%s", ready_line)

        def started() -> None:  # in the server's loop, the engine started
            loop = asyncio.get_running_loop()
            quiet_accept_errors(loop)
            announcing.append(loop.create_task(announce_when_serving()))

        app = build_app(settings, guard, on_started=started)
        # idle and half-sent connections cannot take the descriptors the tick needs, nor
        # slow bodies every connection
        bounds = ConnectionBounds(max_connections(open_files),
                                  body_timeout_s=settings.body_timeout_s)
        server = uvicorn.Server(uvicorn.Config(
            bounds.app(app), http=bounds.protocol(), backlog=listen_backlog(open_files),
            host=settings.host, port=settings.port, log_level="warning", access_log=False))
        guard.exit = lambda: setattr(server, "should_exit", True)  # seen within 0.1 s
        settle_heap()
        server.run()
        if guard.lost is not None:
            raise guard.lost
        if not server.started:  # as uvicorn.run: it could not start
            sys.exit(STARTUP_FAILURE)
