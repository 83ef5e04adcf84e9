"""Delivery logic of the notifier: a real outbox (SQLite and PostgreSQL), a real HTTP
receiver on loopback, a clock the test moves by hand, and `deliver_due()` called directly
(no thread)."""

from __future__ import annotations

import copy
from email.utils import formatdate
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting import notify
from supervisor.alerting.messages import SCHEMA, MessageContext, compose
from supervisor.alerting.notify import Notifier
from supervisor.alerting.wire import Destination, retry_after_s
from supervisor.storage.tables import Notification
from tests.helpers import T0, Receiver, free_port

pytestmark = pytest.mark.both_databases

JOB: dict[str, Any] = {
    "id": "a1b2c3", "name": "extract-hidden", "state": "running",
    "reason": None, "attempt": 2, "restarts": 1,
    "spec": {"name": "extract-hidden", "command": ["python", "x.py"],
             "output_dir": "/data/hidden", "restart_policy": "on-failure", "max_restarts": 2},
    "started_at": "2023-11-14T20:00:00Z", "ended_at": None,
    "progress": {"items_done": 400, "items_total": 1000, "files": 400,
                 "bytes_written": 33_200_000_000, "source": "progress_file",
                 "last_progress_at": "2023-11-14T22:13:20Z", "metrics": {}},
    "forecast": {"rate_items_per_s": 0.05, "eta_s": 12_000.0, "eta_at": "2023-11-15T01:33:20Z",
                 "bytes_per_item": 83_000_000.0, "projected_total_bytes": 83_000_000_000,
                 "disk_free_bytes": 40_000_000_000, "disk_full_in_s": 9_600.0,
                 "will_fit": False},
    "resources": {"status": "running", "num_procs": 3, "num_threads": 40, "cpu_percent": 99.0,
                  "rss_bytes": 8_000_000_000, "read_bytes": 0,
                  "gpu_memory_bytes": 76_000_000_000},
}
ALERT: dict[str, Any] = {
    "id": 5, "job_id": "a1b2c3", "rule": "disk_will_fill", "severity": "critical",
    "state": "firing", "started_at": "2023-11-14T22:13:20Z", "resolved_at": None,
    "message": "extract-hidden: its remaining output does not fit in the 40.0 GB free",
}
LOG_TAIL = ["step 399/1000", "step 400/1000 loss=1.23"]


def message(n: int) -> dict[str, Any]:
    """A distinct firing message; its number is in the text and in the job name."""
    job = copy.deepcopy(JOB)
    job["name"] = f"job-{n}"
    return compose("firing", job, alert={**ALERT, "message": f"message #{n}"},
                   log_tail=[f"line of {n}"])



def enqueue(notifier: Notifier, sessions: sessionmaker[Session], msg: dict[str, Any],
            now: float, kind: str = "firing") -> None:
    with sessions() as session:
        notifier.enqueue(session, kind, msg, job_id="a1b2c3", alert_id=5, now=now)
        session.commit()


def rows(sessions: sessionmaker[Session], destination: str = "slack") -> list[Notification]:
    with sessions() as session:
        return list(session.scalars(select(Notification)
                                    .where(Notification.destination == destination)
                                    .order_by(Notification.id)))


def sent_numbers(receiver: Receiver) -> list[str]:
    return [text.split("message #")[1].split()[0] for text in receiver.texts()]


# -- order and rate ---------------------------------------------------------------------------

def test_messages_arrive_in_order(make_notifier, sessions, clock, receiver) -> None:
    notifier = make_notifier(Destination("slack", receiver.url))
    for n in range(1, 6):
        enqueue(notifier, sessions, message(n), clock())
    for _ in range(5):
        notifier.deliver_due()
        clock.advance(1.0)
    assert sent_numbers(receiver) == ["1", "2", "3", "4", "5"]
    assert notifier.sent["slack"] == 5
    assert all(row.sent_at is not None and row.attempts == 1 for row in rows(sessions))


def test_at_most_one_message_per_second(make_notifier, sessions, clock, receiver) -> None:
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    enqueue(notifier, sessions, message(2), clock())
    assert notifier.deliver_due() == pytest.approx(1.0)  # sent #1; next allowed in 1 s
    assert sent_numbers(receiver) == ["1"]
    assert notifier.deliver_due() == pytest.approx(1.0)  # #2 is due, but not allowed yet
    clock.advance(0.6)
    assert notifier.deliver_due() == pytest.approx(0.4)
    assert sent_numbers(receiver) == ["1"]
    assert len(receiver.attempts) == 1
    clock.advance(0.4)
    notifier.deliver_due()
    assert sent_numbers(receiver) == ["1", "2"]
    (first, second) = rows(sessions)
    assert second.sent_at is not None and first.sent_at is not None
    assert second.sent_at - first.sent_at == pytest.approx(1.0)


def test_idle_outbox_sleeps_the_default(make_notifier, receiver) -> None:
    notifier = make_notifier(Destination("slack", receiver.url))
    assert notifier.deliver_due() == 5.0
    assert receiver.attempts == []


def test_a_failing_head_blocks_the_messages_behind_it(make_notifier, sessions, clock,
                                                      receiver) -> None:
    receiver.script = [(500, {}), (503, {})]
    notifier = make_notifier(Destination("slack", receiver.url))
    for n in (1, 2, 3):
        enqueue(notifier, sessions, message(n), clock())
    for _ in range(40):  # 40 s of fake time, checked every 1/4 s
        notifier.deliver_due()
        clock.advance(0.25)
    assert [status for _, status in receiver.attempts] == [500, 503, 200, 200, 200]
    assert sent_numbers(receiver) == ["1", "2", "3"]
    first, *_ = rows(sessions)
    assert first.attempts == 3 and notifier.retried["slack"] == 2


# -- 429 ----------------------------------------------------------------------------------------

def test_429_retry_after_seconds(make_notifier, sessions, clock, receiver) -> None:
    receiver.script = [(429, {"Retry-After": "30"})]
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    notifier.deliver_due()
    (row,) = rows(sessions)
    assert row.next_attempt_at == T0 + 30 and row.sent_at is None and row.failed_at is None
    assert row.attempts == 1 and "429" in (row.last_error or "")
    assert notifier.retried["slack"] == 1 and notifier.failed["slack"] == 0
    clock.advance(10)
    assert notifier.deliver_due() == 5.0  # due in 20 s; the loop never sleeps over 5 s
    clock.advance(17)
    assert notifier.deliver_due() == pytest.approx(3.0)
    clock.advance(2.9)
    notifier.deliver_due()
    assert len(receiver.attempts) == 1
    clock.advance(0.1)
    notifier.deliver_due()
    assert sent_numbers(receiver) == ["1"]


def test_429_retry_after_http_date(make_notifier, sessions, clock, receiver) -> None:
    receiver.script = [(429, {"Retry-After": formatdate(T0 + 120, usegmt=True)})]
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    notifier.deliver_due()
    (row,) = rows(sessions)
    assert row.next_attempt_at == pytest.approx(T0 + 120)
    clock.advance(119)
    notifier.deliver_due()
    assert receiver.posts == []
    clock.advance(1)
    notifier.deliver_due()
    assert sent_numbers(receiver) == ["1"]


def test_429_without_retry_after_backs_off(make_notifier, sessions, clock, receiver) -> None:
    receiver.script = [(429, {})]
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    notifier.deliver_due()
    (row,) = rows(sessions)
    assert T0 + 0.5 <= row.next_attempt_at <= T0 + 1.0


# -- 5xx and network errors -----------------------------------------------------------------------

def test_server_errors_back_off_exponentially_with_jitter(make_notifier, sessions, clock,
                                                          receiver) -> None:
    attempts = 10
    receiver.script = [(500 + n % 4, {}) for n in range(attempts)]  # 500..503
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    fractions = []
    for n in range(1, attempts + 1):
        now = clock()
        notifier.deliver_due()
        (row,) = rows(sessions)
        assert row.attempts == n and row.sent_at is None and row.failed_at is None
        assert row.last_error is not None and row.last_error.startswith("HTTP 50")
        delay = row.next_attempt_at - now
        ceiling = min(120.0, 2.0 ** (n - 1))
        assert ceiling / 2 <= delay <= ceiling, (n, delay)
        fractions.append(delay / ceiling)
        clock.t = row.next_attempt_at - 0.01
        notifier.deliver_due()  # not yet due: no request
        assert len(receiver.attempts) == n
        clock.t = max(row.next_attempt_at, now + notify.MIN_INTERVAL_S)
    assert len(set(fractions)) > 1, "no jitter"
    assert notifier.retried["slack"] == attempts
    notifier.deliver_due()  # the script is used up: the receiver answers 200
    assert sent_numbers(receiver) == ["1"] and notifier.failed["slack"] == 0


def test_network_error_to_an_unused_port_is_retried(make_notifier, sessions, clock,
                                                    receiver) -> None:
    notifier = make_notifier(Destination("slack", f"http://127.0.0.1:{free_port()}/hook"))
    enqueue(notifier, sessions, message(1), clock())
    notifier.deliver_due()
    (row,) = rows(sessions)
    assert row.attempts == 1 and row.sent_at is None and row.failed_at is None
    assert "network error" in (row.last_error or "")
    assert T0 + 0.5 <= row.next_attempt_at <= T0 + 1.0
    assert notifier.retried["slack"] == 1 and notifier.failed["slack"] == 0
    # the endpoint comes back (here: at a new address): the same row is delivered
    notifier.destinations["slack"] = Destination("slack", receiver.url)
    clock.advance(1.0)
    notifier.deliver_due()
    assert sent_numbers(receiver) == ["1"]
    (row,) = rows(sessions)
    assert row.attempts == 2 and row.sent_at == T0 + 1.0


def test_network_error_when_the_receiver_closed(make_notifier, sessions, clock,
                                                receiver) -> None:
    gone = Receiver()
    notifier = make_notifier(Destination("slack", gone.url))
    enqueue(notifier, sessions, message(1), clock())
    enqueue(notifier, sessions, message(2), clock())
    notifier.deliver_due()
    assert sent_numbers(gone) == ["1"]
    gone.close()
    clock.advance(1.0)
    notifier.deliver_due()
    first, second = rows(sessions)
    assert first.sent_at is not None
    assert second.sent_at is None and second.attempts == 1
    assert "network error" in (second.last_error or "")
    notifier.destinations["slack"] = Destination("slack", receiver.url)
    clock.advance(1.0)
    notifier.deliver_due()
    assert sent_numbers(receiver) == ["2"]


# -- other 4xx --------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [400, 403, 404, 410])
def test_4xx_is_given_up_and_counted(make_notifier, sessions, clock, receiver,
                                     status: int) -> None:
    receiver.script = [(status, {})]
    notifier = make_notifier(Destination("slack", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    enqueue(notifier, sessions, message(2), clock())
    notifier.deliver_due()
    first, second = rows(sessions)
    assert first.failed_at == T0 and first.sent_at is None and first.attempts == 1
    assert first.last_error == f"HTTP {status}: nope"
    assert notifier.failed["slack"] == 1 and notifier.retried["slack"] == 0
    for _ in range(3):  # the given-up row is never tried again; the next one goes out
        clock.advance(1.0)
        notifier.deliver_due()
    assert [s for _, s in receiver.attempts] == [status, 200]
    assert sent_numbers(receiver) == ["2"]
    assert notifier.failed["slack"] == 1 and notifier.sent["slack"] == 1


# -- destinations -----------------------------------------------------------------------------

def test_slack_gets_text_and_webhook_gets_the_whole_message(make_notifier, sessions, clock,
                                                             receiver) -> None:
    hook = Receiver()
    try:
        notifier = make_notifier(Destination("slack", receiver.url),
                                 Destination("webhook", hook.url))
        msg = compose("firing", JOB, alert=ALERT, log_tail=LOG_TAIL)
        enqueue(notifier, sessions, msg, clock())
        assert len(rows(sessions, "slack")) == len(rows(sessions, "webhook")) == 1
        notifier.deliver_due()  # one call serves both destinations
        ((_, slack_body),) = receiver.posts
        ((_, webhook_body),) = hook.posts
        assert slack_body == msg["slack"] and list(slack_body) == ["text", "blocks"]
        event = {k: v for k, v in msg.items() if k != "slack"}
        assert webhook_body == {**event, "event_id": rows(sessions, "webhook")[0].event_id}
        assert webhook_body["schema"] == SCHEMA
        assert webhook_body["job"]["id"] == "a1b2c3"
        assert webhook_body["alert"]["rule"] == "disk_will_fill"
        assert webhook_body["log_tail"] == LOG_TAIL and webhook_body["kind"] == "firing"
        assert notifier.sent == {"slack": 1, "webhook": 1}
    finally:
        hook.close()


def test_destinations_are_independent(make_notifier, sessions, clock, receiver) -> None:
    hook = Receiver()
    try:
        receiver.script = [(500, {}), (500, {}), (500, {})]
        notifier = make_notifier(Destination("slack", receiver.url),
                                 Destination("webhook", hook.url))
        for n in (1, 2):
            enqueue(notifier, sessions, message(n), clock())
        notifier.deliver_due()
        clock.advance(1.0)
        notifier.deliver_due()
        assert sent_numbers(hook) == ["1", "2"]  # slack's failures do not hold it up
        assert receiver.posts == []
    finally:
        hook.close()


def test_a_malformed_url_does_not_stop_the_other_destination(make_notifier, sessions, clock,
                                                              receiver) -> None:
    notifier = make_notifier(Destination("slack", "http://[::1/hook"),  # httpx.InvalidURL
                             Destination("webhook", receiver.url))
    enqueue(notifier, sessions, message(1), clock())
    notifier.deliver_due()
    assert len(receiver.posts) == 1
    (row,) = rows(sessions, "slack")
    assert row.sent_at is None and row.failed_at is None and row.attempts == 1
    assert notifier.retried["slack"] == 1


def test_a_new_notifier_delivers_what_an_old_one_left(make_notifier, sessions, clock,
                                                      receiver) -> None:
    before = make_notifier(Destination("slack", receiver.url))
    enqueue(before, sessions, message(1), clock())
    enqueue(before, sessions, message(2), clock())
    before.deliver_due()
    before.stop()  # the daemon restarts with #2 still in the outbox
    after = make_notifier(Destination("slack", receiver.url))
    clock.advance(1.0)
    after.deliver_due()
    after.deliver_due()
    assert sent_numbers(receiver) == ["1", "2"]


def test_enqueue_writes_one_row_per_destination(make_notifier, sessions, clock) -> None:
    notifier = make_notifier(Destination("slack", "http://127.0.0.1:9/a"),
                             Destination("webhook", "http://127.0.0.1:9/b"))
    enqueue(notifier, sessions, message(1), clock(), kind="resolved")
    for name in ("slack", "webhook"):
        (row,) = rows(sessions, name)
        assert (row.kind, row.job_id, row.alert_id) == ("resolved", "a1b2c3", 5)
        assert row.attempts == 0 and row.next_attempt_at == T0 and row.created_at == T0


# -- compose ----------------------------------------------------------------------------------

CONTEXT = MessageContext(host="gpu-node-7", public_url="http://jobs.example:8765",
                         grafana_url="https://grafana.example/d/jobsup/jobsup")
T_NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z: 2h13m20s after JOB's start


def test_firing_text_has_the_facts() -> None:
    msg = compose("firing", JOB, alert=ALERT, log_tail=LOG_TAIL, context=CONTEXT, now=T_NOW)
    text = msg["text"]
    assert text.startswith("CRITICAL: disk_will_fill — job extract-hidden (a1b2c3) on "
                           "gpu-node-7\n")
    assert ALERT["message"] in text
    assert "state: running" in text and "attempt: 2 of 3" in text
    assert "run time: 2h13m" in text
    assert "progress: 400/1000 items" in text and "written: 33.2 GB" in text
    assert "rate: 0.05 items/s" in text
    assert "ETA: 3h20m (at 2023-11-15T01:33:20Z)" in text
    assert "disk: 40.0 GB free, full in 2h40m — the rest will NOT fit" in text
    assert "GPU memory: 76.0 GB" in text
    assert "last log lines:\nstep 399/1000\nstep 400/1000 loss=1.23" in text
    assert "job: http://jobs.example:8765/api/v1/jobs/a1b2c3" in text
    assert msg["job"] is JOB and msg["alert"] is ALERT and msg["log_tail"] == LOG_TAIL


def test_the_event_is_versioned_and_carries_host_attempt_cause_links() -> None:
    msg = compose("firing", JOB, alert=ALERT, log_tail=LOG_TAIL, context=CONTEXT, now=T_NOW)
    assert msg["schema"] == "jobsup.event/v1" and msg["kind"] == "firing"
    assert msg["host"] == "gpu-node-7"
    assert (msg["attempt"], msg["max_attempts"]) == (2, 3)
    assert msg["run_time_s"] == 8000.0 and msg["stopped_by_user"] is False
    assert msg["cause"] == ALERT["message"]
    assert msg["links"] == {
        "job": "http://jobs.example:8765/api/v1/jobs/a1b2c3",
        "logs": "http://jobs.example:8765/api/v1/jobs/a1b2c3/logs?tail=200",
        "page": "http://jobs.example:8765/jobs/a1b2c3",
        # the run's time range, 10 min either side: from its start to the event (#32 item 12)
        "grafana": "https://grafana.example/d/jobsup/jobsup?var-job_name=extract-hidden"
                   "&from=1699991400000&to=1700000600000"}
    ended = {**JOB, "state": "failed", "ended_at": "2023-11-14T21:00:00Z"}
    assert compose("firing", ended, alert=None, log_tail=[], context=CONTEXT)["links"][
        "grafana"].endswith("&from=1699991400000&to=1699996200000")  # to its end
    assert compose("firing", {**JOB, "started_at": None}, alert=None, log_tail=[],
                   context=CONTEXT)["links"]["grafana"].endswith("=extract-hidden")  # none
    plain = compose("firing", JOB, alert=ALERT, log_tail=[],
                    context=MessageContext(host="h", public_url="http://127.0.0.1:8765/"))
    assert plain["links"]["grafana"] is None and plain["run_time_s"] is None  # no `now`
    assert plain["links"]["job"] == "http://127.0.0.1:8765/api/v1/jobs/a1b2c3"
    assert "run time" not in plain["text"]


def test_a_crashed_job_shows_its_cause_once_and_no_running_facts() -> None:
    job = {**JOB, "state": "failed", "ended_at": "2023-11-14T21:00:00Z", "attempt": 3,
           "reason": "exited with code 1 — NCCL error (seen in the log)",
           "spec": {**JOB["spec"], "output_dir": None}}
    crashed = {**ALERT, "rule": "crashed",
               "message": "extract-hidden failed: exited with code 1 — NCCL error (seen in "
                          "the log)"}
    msg = compose("firing", job, alert=crashed, log_tail=[], context=CONTEXT, now=T_NOW)
    text = msg["text"]
    assert text.startswith("CRITICAL: crashed")
    assert text.count("exited with code 1") == 1 and msg["cause"] == crashed["message"]
    assert "attempt: 3 of 3" in text and "run time: 1h00m" in text
    assert "progress: 400/1000 items" in text
    for absent in ("ETA", "rate:", "disk:", "written:", "GPU memory:", "last log lines"):
        assert absent not in text, absent
    blocks = json_text(msg["slack"])
    for absent in ("ETA", "*rate*", "*disk*", "*written*", "B written"):
        assert absent not in blocks, absent


def test_no_output_dir_means_no_bytes_or_disk_even_while_running() -> None:
    job = {**JOB, "spec": {**JOB["spec"], "output_dir": None}}
    msg = compose("firing", job, alert=ALERT, log_tail=[], context=CONTEXT, now=T_NOW)
    assert "written" not in msg["text"] and "disk:" not in msg["text"]
    assert "ETA: 3h20m" in msg["text"]  # still running: its forecast applies


def test_resolved_text_is_short() -> None:
    alert = {**ALERT, "rule": "stalled", "severity": "warning", "state": "resolved",
             "message": "extract-hidden: no new item for 11 min at 400 items"}
    msg = compose("resolved", JOB, alert=alert, log_tail=LOG_TAIL, context=CONTEXT)
    text = msg["text"]
    assert text.startswith("RESOLVED: stalled — job extract-hidden (a1b2c3) on gpu-node-7")
    assert "was: extract-hidden: no new item" in text and "cleared while the job runs" in text
    for absent in ("progress:", "ETA:", "disk:", "GPU memory:", "last log lines", "step 400"):
        assert absent not in text
        assert absent not in json_text(msg["slack"])
    assert msg["slack"]["text"].startswith(":white_check_mark: RESOLVED: stalled")


def test_resolved_after_a_user_stop_says_so() -> None:
    alert = {**ALERT, "rule": "stalled", "severity": "warning", "state": "resolved",
             "message": "extract-hidden: no new item for 11 min at 400 items"}
    job = {**JOB, "state": "stopped", "exit_reason": "stopped",
           "reason": "stopped on request (SIGTERM)", "ended_at": "2023-11-14T21:00:00Z"}
    msg = compose("resolved", job, alert=alert, log_tail=[], context=CONTEXT)
    assert msg["stopped_by_user"] is True
    assert "the job was stopped by the user (stopped on request (SIGTERM))" in msg["cause"]
    assert "stopped by the user" in msg["slack"]["text"]
    served = {**job, "reason": "stopped because the jobs it served have ended"}
    other = compose("resolved", served, alert=alert, log_tail=[], context=CONTEXT)
    assert other["stopped_by_user"] is False and "by the user" not in other["text"]
    assert "the job stopped: stopped because the jobs it served have ended" in other["cause"]


def test_succeeded_text_without_an_alert() -> None:
    job = {**JOB, "state": "succeeded", "reason": "exited with code 0",
           "ended_at": "2023-11-14T21:00:00Z"}
    msg = compose("succeeded", job, alert=None, log_tail=[], context=CONTEXT)
    assert msg["text"].startswith("job succeeded — job extract-hidden (a1b2c3) on gpu-node-7")
    assert msg["slack"]["text"].startswith(":tada: job succeeded")
    assert msg["alert"] is None and msg["cause"] == "exited with code 0"


def test_a_long_log_tail_keeps_the_last_lines() -> None:
    tail = [f"line {n:05d}" for n in range(1000)]
    msg = compose("firing", JOB, alert=ALERT, log_tail=tail, context=CONTEXT)
    (code,) = [b["text"]["text"] for b in msg["slack"]["blocks"]
               if "last log lines" in b.get("text", {}).get("text", "")]
    assert code.endswith("line 00999\n```") and "line 00000" not in code
    assert len(code) <= 3000


def test_an_old_outbox_row_without_blocks_still_reaches_slack() -> None:
    old = {"kind": "firing", "text": "*CRITICAL: crashed* old row", "job": JOB, "alert": ALERT,
           "log_tail": []}
    assert Destination("slack", "http://127.0.0.1:9/").body(old, "e") == {
        "text": "*CRITICAL: crashed* old row"}
    assert Destination("webhook", "http://127.0.0.1:9/").body(old, "e") == {**old,
                                                                          "event_id": "e"}


def json_text(value: Any) -> str:
    import json
    return json.dumps(value, ensure_ascii=False)


# -- Retry-After --------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("120", 120.0), ("0", 0.0), ("1.5", 1.5), (" 7 ", 7.0), ("-3", 0.0),
    (None, None), ("", None), ("soon", None), ("Wed, 99 Foo 2015", None),
])
def test_retry_after_values(value: str | None, expected: float | None) -> None:
    assert retry_after_s(value, T0) == expected


def test_retry_after_http_date() -> None:
    assert retry_after_s(formatdate(T0 + 90, usegmt=True), T0) == pytest.approx(90.0)
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 1_445_412_480.0) == 0.0  # 07:28:00
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 1_445_412_420.0) == 60.0
    assert retry_after_s(formatdate(T0 - 3600, usegmt=True), T0) == 0.0  # in the past
