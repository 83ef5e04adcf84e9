"""`jobsup serve`: lock the data dir (and a PostgreSQL database), upgrade the schema,
re-adopt jobs, serve the API."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager, contextmanager, suppress
from email.utils import formatdate
from pathlib import Path
from types import FrameType
from typing import Any

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
from supervisor.daemon.recovery import open_database
from supervisor.daemon.wiring import build_engine
from supervisor.errors import DatabaseTaken, UnsafeBind
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


def build_app(settings: Settings, guard: LockGuard | None = None) -> FastAPI:
    """The app with its engine started and stopped by the app's lifespan; `guard`: the
    database lock the engine's ticks need (None: none, for a caller that holds none)."""
    db_engine = open_database(settings)  # checked, upgraded, rebuilt if it was lost
    sessions = make_sessionmaker(db_engine, jobs_dir=settings.jobs_dir)
    engine = build_engine(settings, sessions)
    if guard is not None:
        engine.may_tick = guard

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()  # "ready" is logged once the port is bound (`_Server.main_loop`)
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


class _Server(uvicorn.Server):
    """uvicorn's server without its housekeeping wake-ups. uvicorn's loop wakes ten times
    a second to renew the Date header and to see whether it should exit; on the 2-core VM
    a thread woken from sleep costs ~0.1 ms of CPU, and an asyncio wake with a timeout
    ~0.3-0.4 ms: an idle daemon's largest cost, as much as ~10 running jobs' ticks (#15).
    Here the loop sleeps until it is asked to exit (`stop`, from any thread, or a
    signal: `handle_exit`), and the Date header is renewed as each response starts
    (`_DateRenewer`), at most once a second, as uvicorn's loop did. What else uvicorn's
    loop checked (`limit_max_requests`, `callback_notify`) is not used: `serve` sets
    neither."""

    _loop: asyncio.AbstractEventLoop | None = None
    _exit_requested: asyncio.Event | None = None

    ready_line = ""
    """Logged when the server is up: its lifespan has started and its port is bound."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._date_second = -1
        config.app = _DateRenewer(config.app, self)  # (before `config.load` wraps it)

    async def main_loop(self) -> None:
        if self.ready_line:
            log.info("%s", self.ready_line)
        self._loop, self._exit_requested = asyncio.get_running_loop(), asyncio.Event()
        quiet_accept_errors(self._loop)
        if await self.on_tick(0):  # the Date header; asked to exit before the loop was up
            return
        undo = _wake_on_signals(self._loop)
        try:
            while not self.should_exit:
                await self._exit_requested.wait()
                self._exit_requested.clear()
        finally:
            undo()

    def renew_date(self) -> None:
        """uvicorn's default headers with a Date of this second (as its `on_tick`)."""
        now = time.time()
        if int(now) == self._date_second:
            return
        self._date_second = int(now)
        date = ([(b"date", formatdate(now, usegmt=True).encode())]
                if self.config.date_header else [])
        # in place: the request's cycle took the list before it called the app
        self.server_state.default_headers[:] = date + self.config.encoded_headers

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._wake()

    def stop(self) -> None:
        """Stop serving, from any thread."""
        self.should_exit = True
        self._wake()

    def _wake(self) -> None:
        loop, event = self._loop, self._exit_requested
        if loop is not None and event is not None:
            with suppress(RuntimeError):  # the loop has closed: nothing waits
                loop.call_soon_threadsafe(event.set)


def _wake_on_signals(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Have a signal wake the loop, whichever thread the kernel delivers it to; the
    undoing. uvicorn's handlers (`signal.signal`) run in the main thread once it runs
    Python code again: a signal delivered to another thread (the main one had one
    pending, or blocks it) left it asleep in `epoll_wait`, with no timeout to end the
    sleep now (`_Server`). The interpreter writes the signal's number to a wakeup fd that
    the loop watches. Only in the main thread (elsewhere there are no handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)

    def drained() -> None:
        with suppress(OSError):
            while reader.recv(4096):
                pass

    loop.add_reader(reader.fileno(), drained)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def undo() -> None:
        signal.set_wakeup_fd(previous)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()

    return undo


class _DateRenewer:
    """ASGI wrapper of the daemon's app: each HTTP response renews the server's Date
    header as it starts (`_Server.renew_date`: a clock read, and the header once a
    second), so the Date is of the second the response began, as with uvicorn's loop.
    Responses uvicorn makes without the app (a malformed request's 400) are untouched."""

    def __init__(self, app: Any, server: _Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Any],
                       send: Callable[[Any], Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        renew = self.server.renew_date

        async def dated(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                renew()
            await send(message)

        await self.app(scope, receive, dated)


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
        app = build_app(settings, guard)
        # idle and half-sent connections cannot take the descriptors the tick needs
        bounds = ConnectionBounds(max_connections(open_files))
        server = _Server(uvicorn.Config(bounds.app(app), http=bounds.protocol(),
                                        backlog=listen_backlog(open_files),
                                        host=settings.host, port=settings.port,
                                        log_level="warning", access_log=False))
        server.ready_line = (f"jobsup daemon ready on http://{settings.host}:{settings.port} "
                             f"(data dir {settings.data_dir})")
        guard.exit = server.stop
        settle_heap()
        server.run()
        if guard.lost is not None:
            raise guard.lost
        if not server.started:  # as uvicorn.run: the port could not be bound
            sys.exit(STARTUP_FAILURE)
