"""The ASGI middleware in front of every route: allowed Host, same Origin, the bearer
token (or the status page's session cookie), the body cap — what docs/security.md
promises, in one place."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from supervisor.config import Settings

LOOPBACK_NAMES = frozenset({"localhost"})
"""Loopback host names besides loopback addresses. Never resolved through DNS: a name
an attacker's DNS points at 127.0.0.1 is exactly what DNS rebinding looks like."""
CROSS_SITE = frozenset({"cross-site", "same-site"})
"""`Sec-Fetch-Site` values of a request some other site's page made."""
SESSION_COOKIE = "jobsup_session"
"""The status page's login cookie (HttpOnly, SameSite=Strict, Path=/): see
`session_value`."""
SESSION_MAX_AGE_S = 12 * 3600
"""How long a login lasts."""

BEARER_ONLY_PATHS = frozenset({"/redoc"})
"""Paths the session cookie does not open: FastAPI's ReDoc loads its script from a CDN
with no integrity hash; with the cookie, that script would act on the API with the
user's rights (submit = run commands). It still opens with the bearer token. (/docs is
served from the daemon's own files, page.DOCS_PATH: the cookie opens it.)"""


def session_value(token: str, expires_at: int) -> str:
    """The session cookie's value: its expiry (Unix seconds) and an HMAC-SHA256 of it keyed
    with the token. Never the token itself, so a leaked cookie expires; a changed token
    ends every session."""
    mac = hmac.new(token.encode(), f"jobsup-session-v1:{expires_at}".encode(),
                   hashlib.sha256).hexdigest()
    return f"{expires_at}.{mac}"


def session_valid(token: str, value: str, now: float) -> bool:
    """Whether a session cookie's value was made with `token` and has not expired."""
    expires_text, _, _ = value.partition(".")
    if not (expires_text.isascii() and expires_text.isdigit()) or len(expires_text) > 12:
        return False
    expires_at = int(expires_text)
    if expires_at <= now:
        return False
    return hmac.compare_digest(session_value(token, expires_at).encode(),
                               value.encode("utf-8", errors="replace"))


def split_host(value: str) -> tuple[str, int | None] | None:
    """`host[:port]` of a Host header (`[v6]:port` too) as (lowercased host, port), or
    None when it is not of that form."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[1:end], value[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    elif value.count(":") > 1:
        return None
    else:
        host, sep, port_text = value.partition(":")
        port_text = port_text if sep else None
    if not host:
        return None
    if port_text is None:
        return host, None
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        return None
    return host, int(port_text)


def is_loopback_host(host: str) -> bool:
    """A loopback name or address, judged without DNS (see LOOPBACK_NAMES)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind_host: str, extra: Iterable[str]) -> frozenset[str]:
    """Host names a request's Host header may name besides the loopback ones: the
    configured ones, the host the daemon binds when it is not loopback, and, when it
    binds every interface (0.0.0.0 or ::), this machine's name and the addresses that
    name has (from /etc/hosts, where containers and pods list their own address)."""
    hosts = {h.strip().lower().strip("[]") for h in extra if h.strip()}
    bind = bind_host.strip().lower().strip("[]")
    try:
        unspecified = ipaddress.ip_address(bind).is_unspecified
    except ValueError:
        unspecified = bind == ""
    if unspecified:
        name = socket.gethostname().lower()
        hosts.add(name)
        with contextlib.suppress(OSError):
            hosts.update(str(info[4][0]).lower() for info in socket.getaddrinfo(name, None))
    elif not is_loopback_host(bind):
        hosts.add(bind)
    return frozenset(hosts)


def _error(status: int, message: str, hint: str | None = None,
           headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "hint": hint}, status_code=status,
                        headers=dict(headers or {}))


class Guard:
    """ASGI middleware in front of every route, in this order:
    1. `Host` must be a loopback name/address or an allowed host (DNS rebinding) -> 403;
    2. an `Origin` must be same-origin with that Host, and a request another site's page
       made (`Sec-Fetch-Site`) is refused unless it is a plain navigation -> 403;
    3. with a token, every path but the public ones needs `Authorization: Bearer` or a
       valid session cookie (`SESSION_COOKIE`, set by the status page's login) -> 401, or
       the login form for a status page path (`login_page`);
    4. a body over `max_body_bytes` -> 413, read at most that plus one byte (chunked
       bodies too) and handed to the route from memory.
    No CORS headers are ever sent: no page of another origin may read an answer."""

    def __init__(self, app: ASGIApp, *, settings: Settings, public_paths: frozenset[str],
                 login_page: Callable[[Scope], Response | None] | None = None):
        self.app = app
        self.token = hashlib.sha256(settings.token.encode()).digest() if settings.token \
            else None
        self.secret = settings.token
        self.login_page = login_page
        """What an unauthenticated request gets instead of the 401 JSON (the status
        page's login form for its pages), or None for the 401."""
        self.public_paths = public_paths
        self.hosts = allowed_hosts(settings.host, settings.allowed_hosts)
        self.max_body_bytes = settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope, Headers(scope=scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        body = await self.read_body(receive)
        if body is None:  # the client went away before its body ended: nothing to do
            return
        if isinstance(body, Response):
            await body(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def refusal(self, scope: Scope, headers: Headers) -> Response | None:
        host = split_host(headers.get("host", ""))
        if host is None or not (is_loopback_host(host[0]) or host[0] in self.hosts):
            return _error(403, f"host {headers.get('host', '')!r} is not allowed",
                          "use http://127.0.0.1:PORT, or add the name to "
                          "JOBSUP_ALLOWED_HOSTS on the daemon")
        origin = headers.get("origin")
        if origin is not None and not same_origin(origin, host):
            return _error(403, f"requests from origin {origin!r} are not allowed",
                          "jobsup answers only its own origin; use the CLI or the API "
                          "from a script")
        if headers.get("sec-fetch-site") in CROSS_SITE and not (
                scope["method"] in ("GET", "HEAD")
                and headers.get("sec-fetch-mode") == "navigate"):
            return _error(403, "requests made by another site's page are not allowed")
        if self.token is not None and scope["path"] not in self.public_paths:
            header = headers.get("authorization", "")
            given = header[7:] if header[:7].lower() == "bearer " else ""
            # digests: equal lengths, so the comparison's time says nothing, not even
            # the token's length
            if not hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                       self.token) and not (
                    scope["path"] not in BEARER_ONLY_PATHS and self.has_session(headers)):
                page = self.login_page(scope) if self.login_page else None
                if page is not None:
                    return page
                return _error(401, "missing or wrong bearer token",
                              "send `Authorization: Bearer $JOBSUP_TOKEN`",
                              {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                return _error(400, f"invalid Content-Length {length!r}")
            if int(length) > self.max_body_bytes:
                return self.too_large()
        return None

    def has_session(self, headers: Headers) -> bool:
        """A valid status-page session cookie (with a token configured)."""
        if not self.secret:
            return False
        value = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE)
        return value is not None and session_valid(self.secret, value, time.time())

    async def read_body(self, receive: Receive) -> bytes | Response | None:
        """The whole body, a 413 answer as soon as more than the limit arrived, or None
        when the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return self.too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def too_large(self) -> Response:
        return _error(413, f"request body larger than {self.max_body_bytes} bytes",
                      "raise JOBSUP_MAX_BODY_BYTES on the daemon if this is intended",
                      {"Connection": "close"})


def same_origin(origin: str, host: tuple[str, int | None]) -> bool:
    """Whether `origin` (scheme://host[:port]) is the origin the request's Host names.
    A missing port is the scheme's default on either side; `null` is never same-origin."""
    try:
        parts = urlsplit(origin)
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or parts.hostname is None or (
            parts.username is not None or parts.path or parts.query or parts.fragment):
        return False
    default = 443 if parts.scheme == "https" else 80
    return (parts.hostname, origin_port or default) == (host[0], host[1] or default)
