"""Delivery of alert messages: Slack incoming webhook and a generic JSON webhook.

The outbox is the `notifications` table: the engine writes a row per destination in
the same transaction as the alert, and this module's thread delivers them, oldest
first per destination (so messages arrive in order), at most one per second per
destination. A `429` waits for its `Retry-After`; a `5xx` or a network error backs off
exponentially with jitter; any other `4xx` is given up at once (logged and counted):
resending the same body will not fix it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from supervisor.models import Notification

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0
"""At most one message per second per destination (Slack's documented limit)."""
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 120.0
REQUEST_TIMEOUT_S = 10.0
MAX_RETRY_AFTER_S = 3600.0
"""A `Retry-After` longer than this is taken as this: one bad header must not block a
destination's queue forever."""
EMOJI = {"firing": ":rotating_light:", "resolved": ":white_check_mark:",
         "succeeded": ":tada:"}


@dataclass(frozen=True)
class Destination:
    name: str  # "slack" or "webhook"
    url: str

    def body(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.name == "slack":
            return {"text": message["text"]}
        return message


def compose(kind: str, job: dict[str, Any], *, alert: dict[str, Any] | None,
            log_tail: list[str]) -> dict[str, Any]:
    """The message: a human text (Slack) plus the structured facts (generic webhook)."""
    p, f, r = job["progress"], job["forecast"], job["resources"]
    head = f"{EMOJI.get(kind, '')} "
    if alert is not None:
        verb = "RESOLVED" if kind == "resolved" else alert["severity"].upper()
        head += f"*{verb}: {alert['rule']}* — job `{job['name']}` ({job['id']})"
    else:
        head += f"*job `{job['name']}` ({job['id']}) {job['state']}*"
    lines = [head]
    if alert is not None:
        lines.append(f"was: {alert['message']}" if kind == "resolved" else alert["message"])
    if kind != "resolved":
        lines.append(f"state: {job['state']}" + (f" — {job['reason']}" if job.get("reason")
                                                  else ""))
        done, total = p.get("items_done"), p.get("items_total")
        if done is not None:
            lines.append(f"progress: {done}" + (f"/{total}" if total else "") + " items, "
                         f"{_bytes(p.get('bytes_written'))} written")
        if f.get("eta_s") is not None:
            lines.append(f"ETA: {_duration(f['eta_s'])} (at {f.get('eta_at')})")
        if f.get("disk_free_bytes") is not None:
            runway = f"disk: {_bytes(f['disk_free_bytes'])} free"
            if f.get("disk_full_in_s") is not None:
                runway += f", full in {_duration(f['disk_full_in_s'])}"
            if f.get("will_fit") is False:
                runway += " — the rest will NOT fit"
            lines.append(runway)
        if r.get("gpu_memory_bytes"):
            lines.append(f"GPU memory: {_bytes(r['gpu_memory_bytes'])}")
        if log_tail:
            lines.append("last log lines:\n```\n" + "\n".join(log_tail)[-2500:] + "\n```")
    return {"kind": kind, "text": "\n".join(lines), "job": job, "alert": alert,
            "log_tail": log_tail}


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
                 clock: Callable[[], float] = time.time, backoff_max_s: float = BACKOFF_MAX_S):
        self.destinations = {d.name: d for d in destinations}
        self.backoff_max_s = backoff_max_s
        self.sessions = sessions
        self.clock = clock
        self.sent: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        """Given up (a 4xx other than 429)."""
        self.retried: Counter[str] = Counter()
        self._next_allowed_at: dict[str, float] = {}
        self._unrecorded: dict[str, list[dict[str, Any]]] = {n: [] for n in self.destinations}
        """Messages that could not be written to the outbox (the disk is full)."""
        self._wake = threading.Event()
        self._should_exit = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT_S)

    def enqueue(self, session: Session, kind: str, message: dict[str, Any], *, job_id: str,
                alert_id: int | None, now: float) -> None:
        """Add the message for every destination to the outbox (in the caller's
        transaction); the delivery thread is woken once the caller commits."""
        payload = json.dumps(message)
        for name in self.destinations:
            session.add(Notification(destination=name, kind=kind, job_id=job_id,
                                     alert_id=alert_id, payload_json=payload, created_at=now,
                                     attempts=0, next_attempt_at=now))

    def send_unrecorded(self, message: dict[str, Any]) -> None:
        """Queue a message in memory only (its outbox row could not be written): sent
        before the outbox's next message, with the same rate limit and retries, but
        lost if the daemon dies first."""
        for queue in self._unrecorded.values():
            queue.append({"payload": message, "attempts": 0, "next_attempt_at": 0.0})
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
                head = session.scalars(
                    select(Notification)
                    .where(Notification.destination == name, Notification.sent_at.is_(None),
                           Notification.failed_at.is_(None))
                    .order_by(Notification.id).limit(1)
                ).first()
                if head is None:
                    continue
                due_at = max(head.next_attempt_at, allowed_at)
                if due_at > now:
                    wait_s = min(wait_s, due_at - now)
                    continue
                self._send(session, destination, head)
                session.commit()
            self._next_allowed_at[name] = self.clock() + MIN_INTERVAL_S
            wait_s = min(wait_s, MIN_INTERVAL_S)
        return max(0.01, wait_s)

    def _send_unrecorded(self, destination: Destination, item: dict[str, Any],
                         now: float) -> bool:
        """True when the in-memory message is done with (sent, or refused for good)."""
        item["attempts"] += 1
        try:
            response = self._http.post(destination.url, json=destination.body(item["payload"]))
        except (httpx.HTTPError, httpx.InvalidURL):
            self.retried[destination.name] += 1
            item["next_attempt_at"] = now + min(self.backoff_max_s, 2.0 ** item["attempts"])
            return False
        now = self.clock()  # delays such as Retry-After count from the answer
        if 200 <= response.status_code < 300:
            self.sent[destination.name] += 1
            return True
        if response.status_code == 429 or response.status_code >= 500:
            self.retried[destination.name] += 1
            delay = retry_after_s(response.headers.get("retry-after"), now)
            item["next_attempt_at"] = now + (delay if delay is not None
                                             else min(self.backoff_max_s,
                                                      2.0 ** item["attempts"]))
            return False
        self.failed[destination.name] += 1
        return True

    def _send(self, session: Session, destination: Destination, row: Notification) -> None:
        row.attempts += 1
        body = destination.body(json.loads(row.payload_json))
        try:
            response = self._http.post(destination.url, json=body)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            # InvalidURL (a malformed URL) is not an HTTPError; raised out of deliver_due it
            # would stop delivery to every destination after this one, on every pass
            self._retry_later(destination, row, self.clock(), f"network error: {exc!r}")
            return
        now = self.clock()  # delays such as Retry-After count from the answer
        status = response.status_code
        if 200 <= status < 300:
            row.sent_at = now
            self.sent[destination.name] += 1
            log.info("job %s: %s notification %d sent to %s", row.job_id, row.kind, row.id,
                     destination.name)
        elif status == 429:
            delay = retry_after_s(response.headers.get("retry-after"), now)
            self.retried[destination.name] += 1
            row.next_attempt_at = now + (delay if delay is not None else self._backoff(row))
            row.last_error = f"429 Too Many Requests (Retry-After: {delay})"
            log.warning("%s rate-limited us; retrying notification %d in %.1f s",
                        destination.name, row.id, row.next_attempt_at - now)
        elif status >= 500:
            self._retry_later(destination, row, now, f"HTTP {status}: {response.text[:200]}")
        else:
            row.failed_at = now
            row.last_error = f"HTTP {status}: {response.text[:200]}"
            self.failed[destination.name] += 1
            log.error("%s refused notification %d for job %s (%s); not retrying",
                      destination.name, row.id, row.job_id, row.last_error)

    def _retry_later(self, destination: Destination, row: Notification, now: float,
                     error: str) -> None:
        self.retried[destination.name] += 1
        row.next_attempt_at = now + self._backoff(row)
        row.last_error = error
        log.warning("notification %d to %s failed (%s); retry in %.1f s", row.id,
                    destination.name, error, row.next_attempt_at - now)

    def _backoff(self, row: Notification) -> float:
        """Exponential with "equal jitter": half fixed, half random."""
        ceiling = min(self.backoff_max_s, BACKOFF_BASE_S * 2 ** (row.attempts - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)
