"""Event ids, recorded attempts, redelivery marks, request signing and redaction of the
notifier: a real outbox (SQLite and PostgreSQL), real HTTP receivers on loopback, a fake
clock, and `deliver_due()` called directly (the daemon-level proofs are in
test_notify_crash.py)."""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
import pytest
from alembic import command
from sqlalchemy import event, make_url, select, text
from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting import notify
from supervisor.alerting.messages import compose
from supervisor.alerting.notify import Notifier
from supervisor.alerting.wire import Destination
from supervisor.storage.database import (
    alembic_config,
    make_engine,
    make_sessionmaker,
    set_session,
    upgrade,
)
from supervisor.storage.tables import Notification
from tests.helpers import Receiver, free_port, wait_for
from tests.test_notify_unit import ALERT, JOB, LOG_TAIL, T0

SECRET = "whsec-test-0123456789"
HF_TOKEN = "hf_secretvalue_xyz"


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float,
           tolerance_s: int = 300) -> bool:
    """The receiver's check of docs/security.md, word for word but for `now` (the
    document uses time.time())."""
    timestamp = headers.get("X-Jobsup-Timestamp", "")
    signature = headers.get("X-Jobsup-Signature", "")
    if not timestamp.isdigit() or abs(now - int(timestamp)) > tolerance_s:
        return False  # missing, too old or from the future: a replay, or not from jobsup
    expected = "v1=" + hmac.new(secret.encode(), f"v1:{timestamp}:".encode() + body,
                                hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature)


def job_with_env() -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["spec"] = {"name": "extract-hidden", "command": ["python", "x.py", "--token",
                                                         HF_TOKEN],
                   "env": {"HF_TOKEN": HF_TOKEN, "CUDA_VISIBLE_DEVICES": "0", "N": "12"}}
    return job


pytestmark = pytest.mark.both_databases

LOCK_WAIT_MS = 200
"""The tests' lock wait (the daemon's is 10 s): a locked database fails in 0.2 s."""


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(database_url)

    @event.listens_for(engine, "connect")
    def _short_lock_wait(dbapi_conn: Any, _record: Any) -> None:  # after make_engine's own
        if engine.dialect.name == "sqlite":
            dbapi_conn.execute(f"PRAGMA busy_timeout={LOCK_WAIT_MS}")
        else:
            set_session(dbapi_conn, f"SET lock_timeout = {LOCK_WAIT_MS}")

    upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


class WriteLock:
    """Another writer holding the outbox, as long as the test says: SQLite's database
    lock (BEGIN IMMEDIATE), PostgreSQL's table lock that lets readers through and no
    writer (EXCLUSIVE), so the notifier's write waits and fails."""

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        self.sqlite = url.get_backend_name() == "sqlite"
        if self.sqlite:
            self.conn: Any = sqlite3.connect(url.database or "", timeout=0,
                                             isolation_level=None)
        else:
            import psycopg

            self.conn = psycopg.connect(url.set(drivername="postgresql").render_as_string(
                hide_password=False))

    def take(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE" if self.sqlite
                          else "LOCK TABLE notifications IN EXCLUSIVE MODE")

    def release(self) -> None:
        if self.sqlite:
            self.conn.execute("ROLLBACK")
        else:
            self.conn.rollback()

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def hook() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def enqueue(notifier: Notifier, sessions: sessionmaker[Session], msg: dict[str, Any],
            now: float) -> None:
    with sessions() as session:
        notifier.enqueue(session, "firing", msg, job_id="a1b2c3", alert_id=5, now=now)
        session.commit()


def rows(sessions: sessionmaker[Session], destination: str) -> list[Notification]:
    with sessions() as session:
        return list(session.scalars(select(Notification)
                                    .where(Notification.destination == destination)
                                    .order_by(Notification.id)))


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# -- event ids and attempt numbers ----------------------------------------------------------

def test_one_event_id_per_message_for_every_destination_and_attempt(
        make_notifier, sessions, clock, receiver, hook) -> None:
    receiver.script = [(500, {})]
    notifier = make_notifier(Destination("slack", receiver.url),
                             Destination("webhook", hook.url))
    msg = compose("firing", JOB, alert=ALERT, log_tail=LOG_TAIL)
    enqueue(notifier, sessions, msg, clock())
    enqueue(notifier, sessions, {**msg, "slack": {"text": "second"}}, clock())
    for _ in range(6):
        notifier.deliver_due()
        clock.advance(1.0)
    (slack_1, slack_2), (hook_1, hook_2) = rows(sessions, "slack"), rows(sessions, "webhook")
    assert slack_1.event_id == hook_1.event_id != slack_2.event_id == hook_2.event_id
    assert str(uuid.UUID(slack_1.event_id)) == slack_1.event_id
    seen = [(h["x-jobsup-event-id"], h["x-jobsup-attempt"]) for h, _ in receiver.requests]
    assert seen == [(slack_1.event_id, "1"), (slack_1.event_id, "2"), (slack_2.event_id, "1")]
    # Slack's body is its message alone: the id travels in the header only
    assert [json.loads(body) for _, body in receiver.requests] == [
        msg["slack"], msg["slack"], {"text": "second"}]
    for headers, body in hook.requests:
        assert json.loads(body)["event_id"] == headers["x-jobsup-event-id"]
        assert headers["x-jobsup-attempt"] == "1"
        assert headers["content-type"] == "application/json"
    assert [json.loads(b)["event_id"] for _, b in hook.requests] == [hook_1.event_id,
                                                                    hook_2.event_id]
    assert not any("x-jobsup-redelivery" in h for h, _ in receiver.requests + hook.requests)


def test_the_attempt_is_recorded_before_the_request_leaves(make_notifier, sessions,
                                                           clock) -> None:
    slow = Receiver(delay_s=1.0)
    try:
        notifier = make_notifier(Destination("webhook", slow.url))
        enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]), clock())
        thread, errors = in_background(notifier.deliver_due)
        wait_for(lambda: slow.in_flight, 10, interval=0.01, what="the POST in flight")
        (row,) = rows(sessions, "webhook")  # what a daemon killed now leaves
        assert row.attempts == 1 and row.in_flight_since == T0 and row.sent_at is None
        thread.join(10)
        assert not errors
        (row,) = rows(sessions, "webhook")
        assert row.attempts == 1 and row.in_flight_since is None and row.sent_at == T0
    finally:
        slow.close()


def test_a_message_a_crash_cut_short_is_sent_once_more_marked(make_notifier, sessions, clock,
                                                             hook) -> None:
    notifier = make_notifier(Destination("webhook", hook.url))
    for n in (1, 2):
        enqueue(notifier, sessions, {**compose("firing", JOB, alert=ALERT, log_tail=[]),
                                     "text": f"#{n}"}, clock())
    first, second = rows(sessions, "webhook")
    with sessions() as session:  # what a daemon killed while posting #1 left behind
        session.execute(text("UPDATE notifications SET attempts = 1, in_flight_since = :t "
                             "WHERE id = :id"), {"t": T0, "id": first.id})
        session.commit()
    for _ in range(4):
        clock.advance(1.0)
        notifier.deliver_due()
    (h1, b1), (h2, b2) = hook.requests  # once each, no more
    assert (json.loads(b1)["text"], json.loads(b2)["text"]) == ("#1", "#2")
    assert h1["x-jobsup-event-id"] == first.event_id and h1["x-jobsup-attempt"] == "2"
    assert h1["x-jobsup-redelivery"] == "1"
    assert "x-jobsup-redelivery" not in h2 and h2["x-jobsup-attempt"] == "1"
    first, second = rows(sessions, "webhook")
    assert first.redelivery and not second.redelivery
    assert first.sent_at is not None and first.in_flight_since is None


def test_a_lost_answer_marks_the_next_attempt(make_notifier, sessions, clock,
                                              monkeypatch) -> None:
    monkeypatch.setattr(notify, "REQUEST_TIMEOUT_S", 0.3)
    slow = Receiver(delay_s=1.0)  # it acts on the POST, but answers after the timeout
    try:
        notifier = make_notifier(Destination("webhook", slow.url))
        enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]), clock())
        notifier.deliver_due()
        (row,) = rows(sessions, "webhook")
        assert row.sent_at is None and row.in_flight_since is None and row.redelivery
        assert (row.last_error or "").startswith("network error: ReadTimeout")
        slow.delay_s = 0.0
        clock.t = max(row.next_attempt_at, T0 + notify.MIN_INTERVAL_S)
        notifier.deliver_due()
        (h1, _), (h2, _) = slow.requests
        assert h1["x-jobsup-event-id"] == h2["x-jobsup-event-id"]
        assert "x-jobsup-redelivery" not in h1 and h2["x-jobsup-redelivery"] == "1"
    finally:
        slow.close()


def test_a_refused_connection_is_no_redelivery(make_notifier, sessions, clock, hook) -> None:
    notifier = make_notifier(Destination("webhook", f"http://127.0.0.1:{free_port()}/hook"))
    enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]), clock())
    notifier.deliver_due()
    notifier.destinations["webhook"] = Destination("webhook", hook.url)
    clock.advance(2.0)
    notifier.deliver_due()
    ((headers, _),) = hook.requests
    assert headers["x-jobsup-attempt"] == "2" and "x-jobsup-redelivery" not in headers


def test_a_delivered_message_whose_outcome_cannot_be_written_is_not_sent_again(
        make_notifier, sessions, clock, database_url, caplog) -> None:
    """The answer came back 200 but the database is locked (or full) when the outcome is
    written: the same process must not send the message again."""
    slow = Receiver(delay_s=0.5)
    blocker = WriteLock(database_url)
    try:
        notifier = make_notifier(Destination("webhook", slow.url))
        enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]), clock())
        thread, errors = in_background(notifier.deliver_due)
        wait_for(lambda: slow.in_flight, 10, interval=0.01, what="the POST in flight")
        blocker.take()  # another writer holds the lock past the answer
        thread.join(10)
        blocker.release()
        for _ in range(3):
            clock.advance(2.0)
            notifier.deliver_due()
        assert len(slow.requests) == 1, f"sent {len(slow.requests)} times"
        assert not errors
        (row,) = rows(sessions, "webhook")
        assert row.sent_at is not None and row.in_flight_since is None and row.attempts == 1
        assert "cannot record the outcome of notification" in caplog.text  # the lock held
    finally:
        blocker.close()
        slow.close()


# -- signing ------------------------------------------------------------------------------------

def test_webhook_requests_are_signed_over_the_exact_bytes_sent(make_notifier, sessions, clock,
                                                               receiver, hook) -> None:
    notifier = make_notifier(Destination("slack", receiver.url),
                             Destination("webhook", hook.url), secret=SECRET)
    msg = compose("firing", JOB, alert=ALERT, log_tail=["ünïcödé \"quoted\" line"])
    enqueue(notifier, sessions, msg, clock())
    notifier.deliver_due()
    ((raw_headers, body),) = hook.requests
    headers = httpx.Headers(raw_headers)  # case-insensitive, as a web framework's
    assert headers["X-Jobsup-Timestamp"] == str(int(T0))
    assert verify(SECRET, headers, body, now=T0)
    assert not verify("another-secret", headers, body, now=T0)
    assert not verify(SECRET, headers, body.replace(b"firing", b"resolved"), now=T0)
    assert not verify(SECRET, headers, body, now=T0 + 301)  # outside the replay window
    assert json.loads(body)["log_tail"] == ["ünïcödé \"quoted\" line"]
    ((slack_headers, _),) = receiver.requests  # Slack verifies nothing: nothing to sign
    assert "x-jobsup-signature" not in slack_headers
    unsigned = make_notifier(Destination("webhook", hook.url))  # no secret: no signature
    enqueue(unsigned, sessions, msg, clock())
    clock.advance(1.0)
    unsigned.deliver_due()
    (_, (headers_2, _)) = hook.requests
    assert "x-jobsup-signature" not in headers_2 and "x-jobsup-timestamp" not in headers_2


def test_each_attempt_is_signed_with_its_own_time(make_notifier, sessions, clock,
                                                  hook) -> None:
    hook.script = [(503, {})]
    notifier = make_notifier(Destination("webhook", hook.url), secret=SECRET)
    enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]), clock())
    notifier.deliver_due()
    clock.advance(400)  # a retry long after the first attempt is still fresh
    notifier.deliver_due()
    (h1, b1), (h2, b2) = hook.requests
    assert b1 == b2 and h1["x-jobsup-event-id"] == h2["x-jobsup-event-id"]
    assert verify(SECRET, httpx.Headers(h2), b2, now=T0 + 400)
    assert int(h2["x-jobsup-timestamp"]) - int(h1["x-jobsup-timestamp"]) == 400


# -- secrets ----------------------------------------------------------------------------------

def test_env_values_never_reach_a_payload(make_notifier, sessions, clock, receiver,
                                          hook) -> None:
    msg = compose("firing", job_with_env(), alert=ALERT,
                  log_tail=[f"login with {HF_TOKEN} failed", "device 0"])
    assert msg["job"]["spec"]["env"] == {"HF_TOKEN": "<redacted>",
                                         "CUDA_VISIBLE_DEVICES": "<redacted>",
                                         "N": "<redacted>"}
    assert msg["log_tail"] == ["login with <redacted> failed", "device 0"]  # short: kept
    assert msg["job"]["spec"]["command"][-1] == "<redacted>"
    assert HF_TOKEN not in json.dumps(msg)
    # a message that reaches the outbox unredacted (an older daemon wrote it) is sent
    # redacted all the same
    raw = {**msg, "job": job_with_env(), "log_tail": [HF_TOKEN], "text": f"x {HF_TOKEN}"}
    notifier = make_notifier(Destination("slack", receiver.url),
                             Destination("webhook", hook.url))
    with sessions() as session:
        for name in ("slack", "webhook"):
            session.add(Notification(destination=name, kind="firing", job_id="a1b2c3",
                                     alert_id=5, payload_json=json.dumps(raw), created_at=T0,
                                     attempts=0, next_attempt_at=T0, event_id="e-1"))
        session.commit()
    notifier.deliver_due()
    for r in (receiver, hook):
        ((_, body),) = r.requests
        assert HF_TOKEN.encode() not in body
    assert json.loads(hook.requests[0][1])["job"]["spec"]["env"]["HF_TOKEN"] == "<redacted>"


SLACK_PATH = "/services/T0SECRET1/B0SECRET2/slackPathSecret3"


MALFORMED_OR_UNREACHABLE = [
    "http://[::1" + SLACK_PATH,                        # httpx.InvalidURL
    "http://127.0.0.1:abc" + SLACK_PATH,               # httpx.InvalidURL (port)
    "http://xn--a.com" + SLACK_PATH,                   # IDNA: UnicodeError, not httpx's
    "htp://hooks.example" + SLACK_PATH,                # UnsupportedProtocol
    "http://127.0.0.1:{port}" + SLACK_PATH,            # connection refused
    "http://127.0.0.1:{port}" + SLACK_PATH + "?token=querySecret4",
]


@pytest.mark.slow
def test_a_bad_webhook_url_stops_nothing_and_is_never_logged(make_notifier, sessions, clock,
                                                              caplog) -> None:
    """Each kind of malformed or unreachable Slack URL: the generic webhook still gets its
    message, the failure is logged and recorded, and no piece of the URL shows."""
    for template in MALFORMED_OR_UNREACHABLE:
        url = template.format(port=free_port())
        hook = Receiver()
        caplog.clear()
        try:
            notifier = make_notifier(Destination("slack", url), Destination("webhook", hook.url))
            with caplog.at_level(logging.DEBUG, logger="supervisor"):
                enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]),
                        clock())
                notifier.deliver_due()
            assert len(hook.requests) == 1, url
            row = rows(sessions, "slack")[-1]
            assert row.attempts == 1 and row.sent_at is None and row.failed_at is None, url
            ours = "\n".join(r.getMessage() for r in caplog.records
                             if r.name.startswith("supervisor"))
            assert f"notification {row.id} to slack failed" in ours, url
            for secret in ("T0SECRET1", "B0SECRET2", "slackPathSecret3", "querySecret4"):
                assert secret not in ours and secret not in (row.last_error or ""), url
        finally:
            hook.close()
        with sessions() as session:  # the next URL starts from an empty outbox
            session.execute(text("DELETE FROM notifications"))
            session.commit()


def test_an_error_page_that_echoes_the_url_is_not_logged_with_it(make_notifier, sessions,
                                                                  clock, caplog) -> None:
    """Plenty of servers and proxies answer 404 with a page naming the path asked for."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Echo(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers.get("content-length", 0)))
            status = 503 if "retry" in self.path else 404
            page = f"<h1>{status}</h1> no route for POST {self.path}".encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        notifier = make_notifier(Destination("slack", base + SLACK_PATH),
                                 Destination("webhook", base + "/retry/hookPathSecret4"))
        with caplog.at_level(logging.DEBUG, logger="supervisor"):
            enqueue(notifier, sessions, compose("firing", JOB, alert=ALERT, log_tail=[]),
                    clock())
            notifier.deliver_due()
        (slack,), (webhook,) = rows(sessions, "slack"), rows(sessions, "webhook")
        assert slack.failed_at is not None and webhook.next_attempt_at > T0  # 404, 503
        ours = "\n".join(r.getMessage() for r in caplog.records
                         if r.name.startswith("supervisor"))
        assert "no route for POST" in ours and "no route for POST" in (slack.last_error or "")
        for secret in ("T0SECRET1", "B0SECRET2", "slackPathSecret3", "hookPathSecret4"):
            assert secret not in ours
            assert secret not in (slack.last_error or "") + (webhook.last_error or "")
    finally:
        server.shutdown()
        server.server_close()


# -- the migration ----------------------------------------------------------------------------

def test_rows_from_before_0005_get_one_event_id_per_message(database_url: str) -> None:
    url = database_url
    engine = make_engine(url)
    cfg = alembic_config(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0004")
        for destination in ("slack", "webhook"):
            for kind, created in (("firing", 1.0), ("resolved", 2.0)):
                conn.execute(text(
                    "INSERT INTO notifications (destination, kind, job_id, alert_id, "
                    "payload_json, created_at, attempts, next_attempt_at) VALUES "
                    "(:d, :k, 'j1', 5, '{}', :t, 0, :t)"), {"d": destination, "k": kind,
                                                             "t": created})
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    slack, webhook = rows(sessions, "slack"), rows(sessions, "webhook")
    assert [r.event_id for r in slack] == [r.event_id for r in webhook]
    assert len({r.event_id for r in slack}) == 2
    assert all(not r.redelivery and r.in_flight_since is None for r in slack + webhook)
    engine.dispose()
