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
(`wire.redact`), webhook URLs never appear in our log lines or errors (`wire.scrubbed`), and the
daemon keeps httpx's own request log (which prints the URL) quiet.

The request itself (body, headers, signature, redaction, backoff) is `wire.py`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.wire import (
    BACKOFF_MAX_S,
    NOT_SENT,
    Destination,
    Outcome,
    backoff_s,
    describe_error,
    new_event_id,
    redact,
    retry_after_s,
    scrubbed,
)
from supervisor.storage import outbox
from supervisor.storage.tables import Notification

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
"""At most one message per second per destination (Slack's documented limit)."""
REQUEST_TIMEOUT_S = 10.0


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
        self._enqueued = False
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
        self._enqueued = True

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

    def wake_if_enqueued(self) -> None:
        """Wake the delivery thread if messages were enqueued since the last time: the
        tick calls it once its writes are committed. A tick that enqueued nothing does
        not wake it (each wake reads the outbox's head per destination: #15); it wakes
        on its own when a retry is due."""
        if self._enqueued:
            self._enqueued = False
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
            error = "network error: " + describe_error(response, destination.url)
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
        error = scrubbed(f"HTTP {response.status_code}: {response.text[:200]}",
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
