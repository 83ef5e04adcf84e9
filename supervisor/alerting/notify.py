"""Delivery of alert messages: Slack incoming webhook and a generic JSON webhook (what
the messages say: `messages.py`).

The outbox is the `notifications` table: the engine writes a row per destination in
the same transaction as the alert, and this module's thread delivers them, oldest
first per destination (so messages arrive in order), at most one per second per
destination. A `429` waits for its `Retry-After`; a `5xx` or a network error backs off
exponentially with jitter; any other `4xx` is given up at once (logged and counted):
resending the same body will not fix it. A message whose outbox row could not be
written (a full disk) waits in memory and goes the same way: one attempt function
(`Notifier._attempt`) and one backoff (`backoff_s`) serve both.

Delivery is at least once, and duplicates are rare and marked. Every message has an
event id, fixed when it enters the outbox (`X-Jobsup-Event-Id`, and `event_id` in the
generic webhook's body). Each attempt is committed (`attempts`, `in_flight_since`)
before its request leaves and its outcome after the answer, so a message is sent again
only when an attempt's outcome is unknown: the daemon died while it was in flight, or
the answer was lost (a read timeout, a dropped connection). Those re-sends carry
`X-Jobsup-Redelivery: 1`; a receiver that remembers event ids drops them.

Nothing secret leaves in a message or a log line: the job's `env` shows its names only
(`redact`), webhook URLs never appear in our log lines or errors (`_scrubbed`), and the
daemon keeps httpx's own request log (which prints the URL) quiet.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from supervisor.storage import outbox
from supervisor.storage.tables import Notification

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
"""At most one message per second per destination (Slack's documented limit)."""
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 120.0
REQUEST_TIMEOUT_S = 10.0
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


def _scrubbed(text: str, url: str) -> str:
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


def _describe(exc: Exception, url: str) -> str:
    if isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol | ValueError):
        return f"{type(exc).__name__} (the URL is malformed; not shown, it is a secret)"
    return _scrubbed(f"{type(exc).__name__}: {exc}", url)


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


class Notifier:
    """The outbox's delivery thread."""

    def __init__(self, destinations: list[Destination], sessions: sessionmaker[Session], *,
                 clock: Callable[[], float] = time.time, backoff_max_s: float = BACKOFF_MAX_S,
                 webhook_secret: str | None = None,
                 wall: Callable[[], float] | None = None):
        self.destinations = {d.name: d for d in destinations}
        self.backoff_max_s = backoff_max_s
        self.sessions = sessions
        self.clock = clock
        """Delays and backoffs (the daemon's steady clock)."""
        self.wall = wall or clock
        """What another machine compares with: the signature's timestamp, a
        `Retry-After` HTTP date (the system clock; default: `clock`)."""
        self.webhook_secret = webhook_secret
        """Signs the generic webhook's requests when set."""
        self.sent: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        """Given up (a 4xx other than 429)."""
        self.retried: Counter[str] = Counter()
        self._next_allowed_at: dict[str, float] = {}
        self._unrecorded: dict[str, list[dict[str, Any]]] = {n: [] for n in self.destinations}
        """Messages that could not be written to the outbox (the disk is full)."""
        self._outcomes: dict[int, dict[str, Any]] = {}
        """Outbox row id -> the outcome of its last attempt, where the database could not
        take it: written before anything else is done with the row, never re-sent."""
        self._database_unwritable = False
        self._wake = threading.Event()
        self._should_exit = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def enqueue(self, session: Session, kind: str, message: dict[str, Any], *, job_id: str,
                alert_id: int | None, now: float) -> None:
        """Add the message for every destination to the outbox (in the caller's
        transaction), with its event id; the delivery thread is woken once the caller
        commits."""
        event_id = new_event_id()
        payload = json.dumps(redact(message))
        outbox.add(session, self.destinations, kind=kind, job_id=job_id, alert_id=alert_id,
                   payload_json=payload, event_id=event_id, now=now)

    def send_unrecorded(self, message: dict[str, Any]) -> None:
        """Queue a message in memory only (its outbox row could not be written): sent
        before the outbox's next message, with the same rate limit and retries, but
        lost if the daemon dies first."""
        event_id = new_event_id()
        for queue in self._unrecorded.values():
            queue.append({"payload": redact(message), "event_id": event_id, "attempts": 0,
                          "redelivery": False, "next_attempt_at": 0.0})
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if not self.destinations:
            return
        self._thread = threading.Thread(target=self._run, name="jobsup-notifier", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._should_exit.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S + 2)
        self._http.close()

    def _run(self) -> None:
        while not self._should_exit.is_set():
            try:
                wait_s = self.deliver_due()
            except Exception:  # a broken outbox row must not end delivery
                log.exception("notification delivery failed")
                wait_s = 5.0
            self._wake.wait(wait_s)
            self._wake.clear()

    def deliver_due(self) -> float:
        """Send the head of each destination's queue if it is due; returns how long the
        loop may sleep before something is due again."""
        wait_s = 5.0
        for name, destination in self.destinations.items():
            now = self.clock()
            allowed_at = self._next_allowed_at.get(name, 0.0)
            memory = self._unrecorded[name]
            if memory:
                due_at = max(memory[0]["next_attempt_at"], allowed_at)
                if due_at > now:
                    wait_s = min(wait_s, due_at - now)
                    continue
                if self._send_unrecorded(destination, memory[0], now):
                    memory.pop(0)
                self._next_allowed_at[name] = self.clock() + MIN_INTERVAL_S
                wait_s = min(wait_s, MIN_INTERVAL_S)
                continue
            with self.sessions() as session:
                head = outbox.head(session, name)
                if head is None:
                    continue
                if head.id in self._outcomes:  # answered; its outcome not yet written
                    if not self._record(session, head.id, self._outcomes[head.id]):
                        wait_s = min(wait_s, MIN_INTERVAL_S)
                    continue
                due_at = max(head.next_attempt_at, allowed_at)
                if due_at > now:
                    wait_s = min(wait_s, due_at - now)
                    continue
                self._send(session, destination, head, now)
            self._next_allowed_at[name] = self.clock() + MIN_INTERVAL_S
            wait_s = min(wait_s, MIN_INTERVAL_S)
        return max(0.01, wait_s)

    def _post(self, destination: Destination, message: dict[str, Any], *, event_id: str,
              attempt: int, redelivery: bool, now: float) -> httpx.Response | Exception:
        body, headers = destination.request(message, event_id=event_id, attempt=attempt,
                                            redelivery=redelivery, secret=self.webhook_secret,
                                            now=self.wall())
        try:
            return self._http.post(destination.url, content=body, headers=headers)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            # InvalidURL (a malformed URL) is not an HTTPError, nor is IDNA's UnicodeError;
            # raised out of deliver_due they would stop delivery to every destination
            # after this one, on every pass
            return exc

    def _send_unrecorded(self, destination: Destination, item: dict[str, Any],
                         now: float) -> bool:
        """One attempt at an in-memory message; True when it is done with (sent, or
        refused for good)."""
        item["attempts"] += 1
        outcome = self._attempt(destination, item["payload"], event_id=item["event_id"],
                                attempt=item["attempts"], redelivery=item["redelivery"],
                                now=now, what="unrecorded notification")
        item["redelivery"] = item["redelivery"] or outcome.may_have_arrived
        if outcome.retry_at is not None:
            item["next_attempt_at"] = outcome.retry_at
            return False
        return True

    def _send(self, session: Session, destination: Destination, row: Notification,
              now: float) -> None:
        """One attempt at the row: recorded first, then sent, then its outcome recorded."""
        row_id, event_id = row.id, row.event_id
        message = json.loads(row.payload_json)  # a broken row fails here, before any mark
        if row.in_flight_since is not None:
            # only a daemon that died mid-request leaves this set: this process clears it
            # with every outcome (or holds the outcome in `_outcomes`, handled above)
            log.warning("notification %d (event %s) to %s was in flight when the daemon "
                        "stopped; sending it again, marked as a possible redelivery",
                        row_id, event_id, destination.name)
        outbox.start_attempt(row, now=now)
        if not self._commit(session, f"the attempt at notification {row_id}"):
            return  # not sent: nothing may leave that the outbox does not know about
        outcome = self._attempt(destination, message, event_id=event_id,
                                attempt=row.attempts, redelivery=row.redelivery, now=now,
                                what=f"notification {row_id}")
        changes: dict[str, Any] = {"in_flight_since": None}
        if outcome.sent:
            changes["sent_at"] = outcome.at
        elif outcome.given_up:
            changes["failed_at"] = outcome.at
        else:
            changes["next_attempt_at"] = outcome.retry_at
        if outcome.error is not None:
            changes["last_error"] = outcome.error
        if outcome.may_have_arrived:
            changes["redelivery"] = True
        self._record(session, row_id, changes)

    def _attempt(self, destination: Destination, message: dict[str, Any], *, event_id: str,
                 attempt: int, redelivery: bool, now: float, what: str) -> Outcome:
        """Send one attempt at a message, count and log what came of it (`what` names the
        message in the log); the one delivery path of the outbox and the in-memory queue."""
        response = self._post(destination, message, event_id=event_id, attempt=attempt,
                              redelivery=redelivery, now=now)
        now = self.clock()  # delays such as Retry-After count from the answer
        name = destination.name
        if isinstance(response, Exception):
            error = "network error: " + _describe(response, destination.url)
            return self._retry_later(name, what, attempt, now, error,
                                     may_have_arrived=not isinstance(response, NOT_SENT))
        if 200 <= response.status_code < 300:
            self.sent[name] += 1
            log.info("%s (event %s) sent to %s", what, event_id, name)
            return Outcome(at=now, sent=True)
        if response.status_code == 429:
            delay = retry_after_s(response.headers.get("retry-after"), self.wall())
            return self._retry_later(name, what, attempt, now,
                                     f"429 Too Many Requests (Retry-After: {delay})",
                                     delay_s=delay)
        error = _scrubbed(f"HTTP {response.status_code}: {response.text[:200]}",
                          destination.url)
        if response.status_code >= 500:
            return self._retry_later(name, what, attempt, now, error)
        self.failed[name] += 1
        log.error("%s refused %s (%s); not retrying", name, what, error)
        return Outcome(at=now, given_up=True, error=error)

    def _record(self, session: Session, row_id: int, outcome: dict[str, Any]) -> bool:
        """Write an attempt's outcome; where the database cannot take it, keep it until
        it can (the row is not sent again meanwhile: its outcome is known)."""
        if not outbox.record_outcome(session, row_id, outcome):
            self._outcomes.pop(row_id, None)
            return True
        if self._commit(session, f"the outcome of notification {row_id}"):
            self._outcomes.pop(row_id, None)
            return True
        self._outcomes[row_id] = outcome
        return False

    def _commit(self, session: Session, what: str) -> bool:
        try:
            session.commit()
        except OperationalError as exc:  # disk full, or locked past the busy timeout
            session.rollback()
            if not self._database_unwritable:
                log.error("cannot record %s (%s); delivery waits until the database is "
                          "writable", what, exc.orig)
            self._database_unwritable = True
            return False
        if self._database_unwritable:
            log.warning("notifications: the database is writable again")
            self._database_unwritable = False
        return True

    def _retry_later(self, name: str, what: str, attempt: int, now: float, error: str, *,
                     delay_s: float | None = None, may_have_arrived: bool = False) -> Outcome:
        """A failed attempt to repeat after `delay_s` (a `Retry-After`), else after the
        backoff of its attempt number."""
        self.retried[name] += 1
        retry_at = now + (delay_s if delay_s is not None
                          else backoff_s(attempt, self.backoff_max_s))
        log.warning("%s to %s failed (%s); retry in %.1f s", what, name, error, retry_at - now)
        return Outcome(at=now, retry_at=retry_at, may_have_arrived=may_have_arrived,
                       error=error)
