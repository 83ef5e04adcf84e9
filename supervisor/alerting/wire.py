"""One message as an HTTP request, and what its answer means: the destination's body
and headers (event id, redelivery mark, signature), redaction of secrets from the
message and of webhook URLs from errors, the backoff and `Retry-After` of a failed
attempt. The thread that delivers the outbox with them is `notify.py`'s (`Notifier`);
their names are importable from there too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import uuid
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 120.0
MAX_RETRY_AFTER_S = 3600.0
"""A `Retry-After` longer than this is taken as this: one bad header must not block a
destination's queue forever."""

EVENT_ID_HEADER = "X-Jobsup-Event-Id"
ATTEMPT_HEADER = "X-Jobsup-Attempt"
"""1 for the first attempt at a message, then 2, 3, ... (retries, re-sends)."""
REDELIVERY_HEADER = "X-Jobsup-Redelivery"
"""`1` when an earlier attempt at this message may have reached the receiver."""
TIMESTAMP_HEADER = "X-Jobsup-Timestamp"
SIGNATURE_HEADER = "X-Jobsup-Signature"
"""`v1=` + hex HMAC-SHA256(secret, `v1:{timestamp}:{body}`): generic webhook, with
`JOBSUP_WEBHOOK_SECRET` set (modelled on Slack's request signing)."""

REDACTED = "<redacted>"
MIN_MASKED_LEN = 8
"""Env values this long or longer are also masked wherever else they appear in a
message (the quoted log lines, the text); shorter ones (`1`, `cuda:0`) would mangle it."""

NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
            httpx.UnsupportedProtocol, httpx.LocalProtocolError, httpx.InvalidURL, ValueError)
"""Errors raised before the request can have reached the receiver (connecting, a
malformed URL: httpx.InvalidURL, or UnicodeError from IDNA, a ValueError). After any
other error the request may have arrived: the next attempt is marked a redelivery."""


def new_event_id() -> str:
    return str(uuid.uuid4())


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The `X-Jobsup-Signature` value of a request body sent at `timestamp`."""
    mac = hmac.new(secret.encode(), b"v1:%d:" % timestamp + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def redact(message: dict[str, Any]) -> dict[str, Any]:
    """The message without the job's env values: `job.spec.env` keeps its names, each
    value replaced by `<redacted>`, and values of `MIN_MASKED_LEN` characters or more
    are masked wherever else they appear (a log line that printed a token). The message
    itself is left as it is."""
    job = message.get("job")
    spec = job.get("spec") if isinstance(job, dict) else None
    env = spec.get("env") if isinstance(spec, dict) else None
    if not isinstance(env, dict) or not env:
        return message
    values = sorted({v for v in env.values() if isinstance(v, str)
                     and len(v) >= MIN_MASKED_LEN and v != REDACTED}, key=len, reverse=True)
    masked = _masked(message, values) if values else message
    job, spec = masked["job"], masked["job"]["spec"]
    return {**masked, "job": {**job, "spec": {**spec, "env": dict.fromkeys(env, REDACTED)}}}


def _masked(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: _masked(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v, secrets) for v in value]
    return value


def scrubbed(text: str, url: str) -> str:
    """`text` (an error, a receiver's answer) without the webhook URL or any part of it
    that could be its secret: the URL is a credential (Slack's is the whole key)."""
    try:
        parts = urlsplit(url)
        pieces = [url, parts.netloc, parts.path, parts.query, parts.fragment,
                  *parts.path.split("/"), *parts.query.split("&"),
                  *(pair.partition("=")[2] for pair in parts.query.split("&"))]
    except ValueError:
        pieces = [url]
    for piece in sorted({p for p in pieces if len(p) >= 4}, key=len, reverse=True):
        text = text.replace(piece, "<url>")
    return text


def describe_error(exc: Exception, url: str) -> str:
    if isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol | ValueError):
        return f"{type(exc).__name__} (the URL is malformed; not shown, it is a secret)"
    return scrubbed(f"{type(exc).__name__}: {exc}", url)


@dataclass(frozen=True)
class Destination:
    name: str  # "slack" or "webhook"
    url: str

    def body(self, message: dict[str, Any], event_id: str) -> dict[str, Any]:
        """Slack gets its Block Kit message (`slack`: text and blocks; the event id
        travels in a header); the generic webhook the event (`messages.py`) and its id."""
        message = redact(message)  # again: outbox rows written before redaction existed
        slack = message.get("slack")
        if self.name == "slack":  # a row written before Block Kit has `text` alone
            return slack if isinstance(slack, dict) else {"text": message["text"]}
        return {**{k: v for k, v in message.items() if k != "slack"}, "event_id": event_id}

    def request(self, message: dict[str, Any], *, event_id: str, attempt: int,
                redelivery: bool, secret: str | None, now: float) -> tuple[bytes, dict[str, str]]:
        """The body, serialized once (the bytes signed are the bytes sent), and headers."""
        body = json.dumps(self.body(message, event_id), separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", EVENT_ID_HEADER: event_id,
                   ATTEMPT_HEADER: str(attempt)}
        if redelivery:
            headers[REDELIVERY_HEADER] = "1"
        if secret and self.name == "webhook":
            timestamp = int(now)
            headers[TIMESTAMP_HEADER] = str(timestamp)
            headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
        return body, headers


def backoff_s(attempts: int, max_s: float = BACKOFF_MAX_S) -> float:
    """The wait after the `attempts`-th failed attempt at a message (5xx, a network
    error, a 429 without `Retry-After`): exponential from BACKOFF_BASE_S, capped at
    `max_s`, with "equal jitter" (half fixed, half random) so destinations that failed
    together do not retry together."""
    ceiling = min(max_s, BACKOFF_BASE_S * 2.0 ** min(attempts - 1, 64))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True)
class Outcome:
    """What one attempt at a message came to."""

    at: float
    """When the answer came (or the error): delays count from it."""
    sent: bool = False
    given_up: bool = False
    """Refused for good (a 4xx other than 429): never sent again."""
    retry_at: float | None = None
    """Set when the message is to be sent again, not before this."""
    may_have_arrived: bool = False
    """A failed attempt whose request may have reached the receiver: the next attempt
    is marked a redelivery."""
    error: str | None = None


def retry_after_s(value: str | None, now: float) -> float | None:
    """`Retry-After` as seconds: a number, or an HTTP date."""
    if not value:
        return None
    try:
        seconds = float(value)
        if seconds == seconds:  # not NaN
            return min(max(0.0, seconds), MAX_RETRY_AFTER_S)
    except ValueError:
        pass
    try:
        return min(max(0.0, parsedate_to_datetime(value).timestamp() - now),
                   MAX_RETRY_AFTER_S)
    except (TypeError, ValueError):
        return None
