"""Bounds on the HTTP server's connections, so that idle or half-sent ones cannot starve
the daemon of file descriptors (issue #30: ~22,000 connections that sent half a request
and waited held every descriptor the process could open; the API hung, the tick could
not open the files it reads, and asyncio logged a traceback for each failed `accept`,
535 MB of log).

uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but
not one that never finishes its request's head, and it accepts as many connections as
the process can open. Here (`ConnectionBounds`):

- the process's soft limit on open files is raised to its hard limit at start
  (`raise_open_file_limit`; the jobs inherit it, as they would in a Docker container,
  whose soft limit is its hard one);
- at most `max_connections(limit)` connections stay open, an eighth of the open-file
  limit up to 1,024 (the rest is for the jobs' /proc and output files, SQLite, inotify): a
  connection past that closes the oldest one that has no request being answered (and
  has sent something, or is at least EVICT_AFTER_S old), else the oldest upload (below)
  begun at least EVICT_AFTER_S ago, else itself;
- the listening socket's backlog is a sixteenth of the limit, up to uvicorn's 2,048
  (`listen_backlog`): asyncio accepts up to a backlog's worth of connections in one go,
  and again at each turn of its loop, before the first of them is seen (uvicorn's 2,048
  took every descriptor of a daemon limited to 1,024 at once), so the few goes in
  flight stay within the limit and leave the tick its descriptors;
- a connection must send a request's head within `HEAD_TIMEOUT_S` of opening, or of its
  previous response, else it is closed;
- a request's body must arrive whole within `body_timeout_s` of its head (the setting
  `JOBSUP_BODY_TIMEOUT_S`, 10 s), else the request answers 408 and its connection is
  closed; and at most `max_uploads(limit)` requests, three connections in four, are
  uploading a body at once: one more closes the oldest upload (408), so a quarter of the
  connections stays for requests that are not uploading (issue #46: ~1,100 bodies sent a
  byte at a time held all 1,024 connections, each a request being answered, which
  nothing closed; every other client was refused for as long as they lasted, with or
  without a token, since `POST /login` reads its body without one);
- a failed `accept` (the open-file limit reached all the same) is logged once a minute
  with a count, not once per attempt with a traceback (`quiet_accept_errors`).

uvicorn's h11 protocol does the HTTP; the protocol here wraps it (uvicorn takes a
protocol class in `Config(http=...)`) and sees only the connection's open, bytes and
close, and through the ASGI app, when a request on it is being answered: uvicorn starts
a request's task as it reads the bytes that complete its head, and the task keeps the
context it was made in (`contextvars`), where the connection has put itself. The body's
bounds are kept in that ASGI app too (`_Upload`), around the `receive` it hands on: an
upload begins when the app first asks for a body its headers announce (a request refused
from its headers, a 401 or 413, never uploads) and ends when the last of it arrives.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from supervisor.config import BODY_TIMEOUT_S

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0
"""Seconds a connection has to send a request's head (from its opening, or from the end
of its previous response) before it is closed."""

EVICT_AFTER_S = 1.0
"""A connection that has sent nothing yet is not closed to make room until it is this old:
its request may be waiting in the loop, not yet read (a client that connected during a
flood was closed unanswered when the flood's later connections pushed it to the front of
the line). Past the limit with no other connection to close, the new one is refused."""

UPLOADS_KEEP_SHARE = 4
"""One connection in this many is kept for requests that are not uploading a body (a GET,
the page, a POST whose body came with its head): `max_uploads`."""

CONNECTIONS_SHARE = 8
"""At most one open file in this many is an HTTP connection."""

CONNECTIONS_MIN = 16

CONNECTIONS_MAX = 1024
"""Connections kept open at most, whatever the open-file limit (each costs memory: the
status page's viewers, Prometheus and the CLIs need far fewer)."""

BACKLOG_SHARE = 16
"""The listening backlog is at most one open file in this many."""

BACKLOG_MAX = 2048
"""uvicorn's default backlog."""

OPEN_FILES_MAX = 1 << 20
"""The soft limit is raised at most this far (a hard limit of `RLIM_INFINITY` cannot be
a soft limit on open files)."""

ACCEPT_FAILED = "socket.accept() out of system resource"
"""asyncio's message for a failed `accept` (EMFILE, ENFILE, ENOBUFS, ENOMEM)."""

ACCEPT_LOG_EVERY_S = 60.0

_CONNECTION: contextvars.ContextVar[_Connection | None] = contextvars.ContextVar(
    "jobsup_http_connection", default=None)
"""The connection whose bytes are being read; a request's task, made then, keeps it."""


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (capped at OPEN_FILES_MAX);
    (the soft limit before, the soft limit now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_MAX if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_MAX)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:  # a container that forbids it
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, wanted,
                        exc)
            return soft, soft
    return soft, max(soft, wanted)


def max_connections(open_files: int) -> int:
    return max(CONNECTIONS_MIN, min(CONNECTIONS_MAX, open_files // CONNECTIONS_SHARE))


def listen_backlog(open_files: int) -> int:
    return max(CONNECTIONS_MIN, min(BACKLOG_MAX, open_files // BACKLOG_SHARE))


def max_uploads(limit: int) -> int:
    """Connections that may be uploading a request body at once, of `limit`."""
    return max(1, limit - limit // UPLOADS_KEEP_SHARE)


def announces_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's (lowercased) headers announce a body: a Content-Length other
    than 0, or a Transfer-Encoding (chunked)."""
    for name, value in headers:
        if name == b"content-length":
            return value.strip().strip(b"0") != b""
        if name == b"transfer-encoding":
            return True
    return False


class ConnectionBounds:
    """The daemon's open HTTP connections, oldest first, and which of them have a
    request being answered; `protocol()` is uvicorn's `http` and `app(...)` wraps the
    ASGI app."""

    def __init__(self, limit: int, head_timeout_s: float = HEAD_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S, uploads_limit: int | None = None):
        self.limit = limit
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.uploads_limit = max_uploads(limit) if uploads_limit is None else uploads_limit
        self._open: OrderedDict[_Connection, None] = OrderedDict()
        self._uploads: OrderedDict[_Upload, None] = OrderedDict()
        """Requests uploading their body now, oldest first."""
        self.closed_over_limit = 0
        """Connections closed to keep within `limit` (for tests and logs)."""
        self.closed_idle = 0
        """Connections closed for not sending a request's head in time."""
        self.closed_slow_body = 0
        """Requests answered 408 for a body not whole within `body_timeout_s`."""
        self.closed_over_uploads = 0
        """Uploads answered 408 to keep within `uploads_limit`."""
        self._logged_at = 0.0
        self._bodies_logged_at = 0.0

    @property
    def open_count(self) -> int:
        """Connections counted open now."""
        return len(self._open)

    def protocol(self) -> type[asyncio.Protocol]:
        bounds = self

        class Protocol(_Connection):
            def __init__(self, config: Any, server_state: Any, app_state: Any,
                         _loop: asyncio.AbstractEventLoop | None = None) -> None:
                super().__init__(bounds, H11Protocol(config=config, server_state=server_state,
                                                     app_state=app_state, _loop=_loop))

        return Protocol

    def app(self, app: Any) -> Callable[..., Any]:
        """`app` with each HTTP request marking its connection busy until answered, and
        its body, if it has one, bound in time and among the uploads (`_Upload`)."""
        bounds = self

        async def marked(scope: MutableMapping[str, Any], receive: Callable[[], Any],
                         send: Callable[[Any], Any]) -> None:
            connection = _CONNECTION.get() if scope["type"] == "http" else None
            if connection is None:
                await app(scope, receive, send)
                return
            connection.requests += 1
            try:
                if announces_body(scope["headers"]):
                    await _Upload(bounds, connection).answer(app, scope, receive, send)
                else:
                    await app(scope, receive, send)
            finally:
                connection.requests -= 1
                if not connection.requests:
                    connection.await_head()

        return marked

    def opened(self, connection: _Connection) -> bool:
        """Take in a new connection, closing the oldest idle one past the limit, else
        the oldest upload whose head came EVICT_AFTER_S ago or more (408; counted out at
        once, its descriptor closed a turn or two of the loop later); False when none can
        be closed (the new one is then closed)."""
        if len(self._open) >= self.limit:
            idle = next((c for c in self._open if not c.requests and not c.reading and (
                c.received or connection.opened_at - c.opened_at >= EVICT_AFTER_S)), None)
            self.closed_over_limit += 1
            self._note_closing()
            if idle is not None:
                idle.close()
            else:
                upload = next(iter(self._uploads), None)
                if upload is None or connection.opened_at - upload.head_at < EVICT_AFTER_S:
                    return False
                upload.cut_off(CONNECTIONS_FULL)
                self.closed(upload.connection)
        self._open[connection] = None
        return True

    def closed(self, connection: _Connection) -> None:
        self._open.pop(connection, None)

    def upload_began(self, upload: _Upload) -> None:
        """Count `upload` in, cutting the oldest one off past `uploads_limit`."""
        if len(self._uploads) >= self.uploads_limit:
            oldest = next(iter(self._uploads))
            self.closed_over_uploads += 1
            oldest.cut_off(UPLOADS_FULL)
        self._uploads[upload] = None

    def upload_ended(self, upload: _Upload) -> None:
        self._uploads.pop(upload, None)

    def note_cut_off(self) -> None:
        now = time.monotonic()
        if now - self._bodies_logged_at >= ACCEPT_LOG_EVERY_S:
            self._bodies_logged_at = now
            log.warning("request bodies cut off with a 408: %d not whole within %g s, %d "
                        "uploading past %d at once (so far; logged at most once a minute)",
                        self.closed_slow_body, self.body_timeout_s, self.closed_over_uploads,
                        self.uploads_limit)

    def _note_closing(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= ACCEPT_LOG_EVERY_S:
            self._logged_at = now
            log.warning("more than %d HTTP connections open: closing the oldest idle ones "
                        "(%d so far; logged at most once a minute)", self.limit,
                        self.closed_over_limit)


class _Connection(asyncio.Protocol):
    """One HTTP connection: uvicorn's protocol inside, its head timer and its place in
    `ConnectionBounds` outside."""

    def __init__(self, bounds: ConnectionBounds, inner: asyncio.Protocol):
        self.bounds = bounds
        self.inner = inner
        self.transport: asyncio.BaseTransport | None = None
        self.requests = 0
        """Requests of this connection being answered now."""
        self.opened_at = time.monotonic()
        self.received = False
        """Whether it has sent anything (a request, or part of one)."""
        self.reading = False
        """Bytes of it were read in this turn of the loop: a request they complete has its
        task made but not yet run, so it does not count in `requests` until the next turn
        (a connection in that state was closed as idle to make room, its request
        unanswered, when slow uploads kept the connections full: #46)."""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        if not self.bounds.opened(self):
            self.close()
            return
        self.await_head()

    def await_head(self) -> None:
        """(Re)start the clock for the next request's head."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.bounds.head_timeout_s,
                                                            self._head_late)

    def _head_late(self) -> None:
        self._timer = None
        if not self.requests:
            self.bounds.closed_idle += 1
            self.close()

    def close(self) -> None:
        """Close the connection, and count it out at once (its transport's close, and
        `connection_lost`, come at the loop's next turn)."""
        self.bounds.closed(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.received = True
        token = _CONNECTION.set(self)
        try:
            self.inner.data_received(data)
        finally:
            _CONNECTION.reset(token)
        if not self.reading:
            self.reading = True
            # after the first step of a task made above (the loop runs them in order)
            asyncio.get_running_loop().call_soon(self._read)

    def _read(self) -> None:
        self.reading = False

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.bounds.closed(self)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


TOO_LATE = "late"
"""Why an upload is cut off: its body not whole within `body_timeout_s` of its head."""
UPLOADS_FULL = "uploads full"
"""Why: it was the oldest of `uploads_limit` uploads when another began."""
CONNECTIONS_FULL = "connections full"
"""Why: it was the oldest upload when a connection came past the limit, none idle."""


class _Upload:
    """One request whose headers announce a body: from the app's first ask for it until
    its last byte, it must arrive by `body_timeout_s` after the head and it counts among
    the uploads (`ConnectionBounds.upload_began`). Cut off, the app's `receive` answers
    `http.disconnect` (the Guard then returns, as for a client gone), the request answers
    408 and its connection is closed."""

    def __init__(self, bounds: ConnectionBounds, connection: _Connection):
        self.bounds = bounds
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        self.head_at = time.monotonic()
        self.cut: asyncio.Future[str] | None = None
        """Set to the reason when it is cut off; None before the upload begins."""
        self.ended = False
        """The body arrived whole, the client went away, or the request was answered."""
        self.cut_short: str | None = None
        """Why the app was told the client went away (it was cut off)."""
        self._timer: asyncio.TimerHandle | None = None

    async def answer(self, app: Callable[..., Any], scope: MutableMapping[str, Any],
                     receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        started = False

        async def send_marked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            self.end()  # answered: what the body still sends is no upload of ours
            await send(message)

        async def receive_bounded() -> Any:
            if self.ended:
                return await receive()
            if self.cut is None:
                self.begin()
            return await self.receive(receive)

        try:
            await app(scope, receive_bounded, send_marked)
        finally:
            self.end()
        if self.cut_short is None:
            return
        if not started:
            await self.refusal()(scope, receive, send)
        self.connection.close()

    def begin(self) -> None:
        self.cut = self.loop.create_future()
        remaining_s = self.head_at + self.bounds.body_timeout_s - time.monotonic()
        self._timer = self.loop.call_later(max(0.0, remaining_s), self.cut_off, TOO_LATE)
        self.bounds.upload_began(self)

    async def receive(self, receive: Callable[[], Any]) -> Any:
        """uvicorn's next message of the body, or `http.disconnect` once cut off."""
        assert self.cut is not None
        if not self.cut.done():
            getter = asyncio.ensure_future(receive())
            try:
                await asyncio.wait((getter, self.cut), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                getter.cancel()
                raise
            if getter.done():
                message = getter.result()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    self.end()
                return message
            getter.cancel()
        self.cut_short = self.cut.result()
        self.end()
        return {"type": "http.disconnect"}

    def cut_off(self, reason: str) -> None:
        if self.ended or self.cut is None or self.cut.done():
            return
        self.cut.set_result(reason)
        if reason == TOO_LATE:
            self.bounds.closed_slow_body += 1
        self.bounds.upload_ended(self)
        self.bounds.note_cut_off()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._timer is not None:
            self._timer.cancel()
        self.bounds.upload_ended(self)

    def refusal(self) -> JSONResponse:
        waited_s = time.monotonic() - self.head_at
        if self.cut_short == TOO_LATE:
            error = (f"request body not received whole within "
                     f"{self.bounds.body_timeout_s:g} s of its head")
        elif self.cut_short == UPLOADS_FULL:
            error = (f"request body still arriving after {waited_s:.1f} s, the oldest of "
                     f"the {self.bounds.uploads_limit} uploads the daemon takes at once: "
                     "closed to make room for a newer one")
        else:
            error = (f"request body still arriving after {waited_s:.1f} s, the oldest "
                     f"upload, while all {self.bounds.limit} connections the daemon keeps "
                     "were taken: closed to make room for a new one")
        return JSONResponse(
            {"error": error, "hint": "send the body as soon as its headers; the daemon's "
                                     "JOBSUP_BODY_TIMEOUT_S sets how long it may take"},
            status_code=408, headers={"Connection": "close"})


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's failed `accept`s once a minute, with their count and no traceback
    (each failure logged one; the loop retries every second while descriptors are short,
    and more often as they come and go); every other error as asyncio does."""
    state = {"count": 0, "logged_at": float("-inf")}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["logged_at"] >= ACCEPT_LOG_EVERY_S:
            state["logged_at"] = now
            log.error("cannot accept HTTP connections: %s (%d times since the last such "
                      "line; logged at most once a minute)", context.get("exception"),
                      state["count"])
            state["count"] = 0

    loop.set_exception_handler(handler)
