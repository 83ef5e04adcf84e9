"""Alerts end to end: real jobs, a real daemon, a local receiver standing in for Slack."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from slack_sdk.models.blocks import Block

from tests.helpers import Daemon, Receiver, python_job, wait_for

pytestmark = pytest.mark.slow


def slack_message(body: dict[str, Any]) -> str:
    """A Slack body's fallback text and every text of its blocks, one string; each block
    validated by Slack's own model on the way."""
    texts = [body["text"]]
    for raw in body["blocks"]:
        Block.parse(raw).validate_json()
        texts.append(json.dumps(raw, ensure_ascii=False))
    return "\n".join(texts)


def strings(value: Any) -> list[str]:
    """Every string in a decoded JSON body."""
    if isinstance(value, str):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
        else []
    return [text for item in items for text in strings(item)]


def slack_daemon(make_daemon, receiver: Receiver, **env: str) -> Daemon:
    return make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url,
                            "JOBSUP_NOTIFY_ON_SUCCESS": "false", **env})


def test_by_default_a_success_sends_nothing_and_a_crash_does(make_daemon,
                                                             receiver: Receiver) -> None:
    """Success messages are opt-in (`JOBSUP_NOTIFY_ON_SUCCESS=true`): on by default they
    were 42 of an on-call engineer's first 46 messages, the crash the 7th (#32 item 4)."""
    daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url})
    fine = daemon.submit(python_job("pass"), name="fine")
    daemon.wait_state(fine["id"], "succeeded")
    doomed = daemon.submit(python_job("import sys; sys.exit(3)"), name="doomed")
    daemon.wait_state(doomed["id"], "failed")
    wait_for(lambda: receiver.posts, 15, what="the crash's message")
    daemon.wait_ticks(3)  # the success was recorded ticks before; nothing more comes
    assert len(receiver.posts) == 1 and "doomed" in receiver.texts()[0], receiver.texts()


def test_crash_gives_exactly_one_message_within_5_s(make_daemon, receiver: Receiver) -> None:
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job(
        "import sys; print('loading'); print('RuntimeError: CUDA out of memory. Tried to "
        "allocate 2.00 GiB'); sys.exit(1)"), name="extract")
    done = daemon.wait_state(job["id"], "failed")
    t_end = time.time()
    wait_for(lambda: receiver.posts, 10, what="a Slack message")
    daemon.wait_ticks(5)  # a few more ticks: still exactly one
    ((posted_at, body),) = receiver.posts
    assert posted_at - t_end < 5  # the post's own time, not the checks' after it
    text = body["text"]
    assert "CRITICAL: crashed" in text and "extract" in text and job["id"] in text
    assert "exited with code 1" in text and "CUDA out of memory" in text
    whole = slack_message(body)
    assert "last log lines" in whole and "loading" in whole
    assert socket.gethostname() in whole  # the default host
    assert done["reason"] == "exited with code 1 — CUDA out of memory (seen in the log)"
    (alert,) = daemon.http.get("/api/v1/alerts", params={"state": "firing"}).json()
    assert alert["rule"] == "crashed" and alert["job_id"] == job["id"]
    assert [a["rule"] for a in daemon.job(job["id"])["alerts"]] == ["crashed"]


def test_colour_codes_and_nul_bytes_never_reach_slack_or_the_webhook(
        make_daemon, receiver: Receiver) -> None:
    """A job that logs in colour (as rich, loguru and torch's warnings do) and writes a
    NUL byte: the crash's Slack message and the generic webhook's event carry the words,
    not the escape codes or the NUL (#32 item 8)."""
    hook = Receiver()
    try:
        daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url,
                                  "JOBSUP_WEBHOOK_URL": hook.url})
        job = daemon.submit(python_job(
            "import sys; print('\\x1b[1;31mERROR\\x1b[0m \\x1b]0;title\\x07loading"
            " shard 3\\x00 of 8'); print('RuntimeError: CUDA out of memory\\x1b[0m');"
            " sys.exit(1)"), name="colourful")
        daemon.wait_state(job["id"], "failed")
        wait_for(lambda: receiver.posts and hook.posts, 15, what="both messages")
        ((_, slack),), ((_, event),) = receiver.posts, hook.posts
        for body in (slack, event):
            whole = "\n".join(strings(body))  # the decoded strings, not JSON's \u001b
            assert not set(whole) & {"\x1b", "\x00", "\x07"}, repr(whole)
            assert "ERROR loading shard 3 of 8" in whole, whole
        assert "ERROR loading shard 3 of 8" in slack_message(slack)
        assert "ERROR loading shard 3 of 8" in event["log_tail"]
        assert "CUDA out of memory" in event["cause"]
    finally:
        hook.close()


def test_a_crashed_job_arrives_in_block_kit_with_host_attempt_cause_tail_and_links(
        make_daemon, receiver: Receiver) -> None:
    """A job that fails on both of its attempts: one Block Kit message, from the host
    named by JOBSUP_HOSTNAME, with "attempt 2 of 2", the cause once, the log tail escaped
    (the job's `<!channel>` mentions no one, its ``` does not close the block) and links
    to the daemon and to Grafana."""
    daemon = slack_daemon(make_daemon, receiver, JOBSUP_HOSTNAME="gpu-node-7",
                          JOBSUP_PUBLIC_URL="https://jobs.example",
                          JOBSUP_GRAFANA_URL="https://grafana.example/d/jobsup/jobsup",
                          JOBSUP_RESTART_BACKOFF_S="0.2")
    code = ("import os, sys\n"
            "print('attempt', os.environ['JOBSUP_ATTEMPT'], '<!channel> & <b>')\n"
            "print('```')\n"
            "print('x' * 5000)\n"
            "print('RuntimeError: NCCL error: unhandled system error')\n"
            "sys.exit(1)")
    job = daemon.submit(python_job(code), name="train-draft", restart_policy="on-failure",
                        max_restarts=1)
    done = daemon.wait_state(job["id"], "failed", timeout=20)
    assert done["attempt"] == 2
    wait_for(lambda: receiver.posts, 8, what="the crash message")
    daemon.wait_ticks(3)  # a few more ticks: still one message
    ((_, body),) = receiver.posts
    assert set(body) == {"text", "blocks"}
    whole = slack_message(body)
    header = body["blocks"][0]["text"]["text"]
    assert header == ":rotating_light: CRITICAL: crashed — train-draft on gpu-node-7"
    assert '"*attempt*\\n2 of 2"' in whole
    assert whole.count("NCCL error or timeout (seen in the log)") == 2  # fallback, cause
    assert "attempt 2 &lt;!channel&gt; &amp; &lt;b&gt;" in whole
    assert "<!channel>" not in whole and "<b>" not in whole
    (tail,) = [b["text"]["text"] for b in body["blocks"]
               if b["type"] == "section" and "last log lines" in b.get("text", {}).get("text", "")]
    assert tail.count("```") == 2  # the job's own ``` made safe
    (long_line,) = [line for line in tail.split("\n") if "xxx" in line]
    assert len(long_line) == 300 and long_line.endswith("x…")  # capped, not the tail cut
    assert tail.endswith("RuntimeError: NCCL error: unhandled system error\n```")
    assert f"<https://jobs.example/jobs/{job['id']}|job>" in whole  # its page, not JSON
    # Grafana at the time of the run, 10 min either side of its start and end
    grafana = re.search(r"<https://grafana\.example/d/jobsup/jobsup\?var-job_name=train-draft"
                        r"&amp;from=(\d+)&amp;to=(\d+)\|Grafana>", whole)
    assert grafana is not None, whole
    started = datetime.fromisoformat(done["started_at"]).timestamp()
    ended = datetime.fromisoformat(done["ended_at"]).timestamp()
    assert int(grafana[1]) == int((started - 600) * 1000)
    assert int(grafana[2]) == int((ended + 600) * 1000)
    for absent in ("ETA", "*rate*", "*disk*", "*written*"):  # an ended job, no output dir
        assert absent not in whole


def test_the_generic_webhook_gets_the_versioned_event(make_daemon, receiver: Receiver) -> None:
    daemon = make_daemon(env={"JOBSUP_WEBHOOK_URL": receiver.url,
                              "JOBSUP_NOTIFY_ON_SUCCESS": "false",
                              "JOBSUP_HOSTNAME": "gpu-node-7"})
    job = daemon.submit(python_job("import sys; print('a <!channel> & b'); sys.exit(3)"),
                        name="hooked")
    daemon.wait_state(job["id"], "failed")
    wait_for(lambda: receiver.posts, 8, what="the webhook message")
    ((headers, raw),) = receiver.requests
    event = json.loads(raw)
    assert event["schema"] == "jobsup.event/v1" and event["kind"] == "firing"
    assert event["event_id"] == headers["x-jobsup-event-id"]
    assert event["host"] == "gpu-node-7"
    assert (event["attempt"], event["max_attempts"]) == (1, 1)
    assert event["cause"] == event["alert"]["message"] and "exited with code 3" in event["cause"]
    assert event["run_time_s"] is not None and event["stopped_by_user"] is False
    assert event["job"]["id"] == job["id"] and event["alert"]["rule"] == "crashed"
    assert event["log_tail"] == ["a <!channel> & b"]  # for machines: as the job wrote it
    assert event["links"]["job"] == f"{daemon.url}/api/v1/jobs/{job['id']}"
    assert event["links"]["grafana"] is None
    assert "slack" not in event and "blocks" not in event
    assert "on gpu-node-7" in event["text"]


def test_429_retry_after_is_honoured(make_daemon, receiver: Receiver) -> None:
    receiver.script = [(429, {"Retry-After": "2"})]
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job("import sys; sys.exit(2)"))
    daemon.wait_state(job["id"], "failed")
    wait_for(lambda: receiver.posts, 10, what="the retried message")
    (first_try, status), (second_try, ok) = receiver.attempts
    assert (status, ok) == (429, 200)
    assert second_try - first_try >= 2.0
    assert len(receiver.posts) == 1


def test_server_errors_back_off_and_4xx_is_not_retried(make_daemon, receiver: Receiver) -> None:
    receiver.script = [(500, {}), (503, {}), (400, {})]
    daemon = slack_daemon(make_daemon, receiver)
    a = daemon.submit(python_job("import sys; sys.exit(3)"), name="first")
    daemon.wait_state(a["id"], "failed")
    wait_for(lambda: len(receiver.attempts) >= 3, 15, what="three attempts")
    b = daemon.submit(python_job("import sys; sys.exit(4)"), name="second")
    daemon.wait_state(b["id"], "failed")
    wait_for(lambda: receiver.posts, 15, what="the second message")
    statuses = [s for _, s in receiver.attempts]
    assert statuses == [500, 503, 400, 200]  # the 400 was given up, the next one sent
    assert "second" in receiver.texts()[0]
    metrics = daemon.http.get("/metrics").text
    assert 'jobsup_notifications_failed_total{destination="slack"} 1.0' in metrics
    assert 'jobsup_notifications_sent_total{destination="slack"} 1.0' in metrics


@pytest.mark.both_databases
def test_message_survives_a_daemon_kill(make_daemon, receiver: Receiver) -> None:
    receiver.script = [(503, {})] * 3
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job("import sys; sys.exit(9)"), name="doomed")
    daemon.wait_state(job["id"], "failed")
    wait_for(lambda: receiver.attempts, 10, what="a first (failed) delivery")
    daemon.kill()
    assert receiver.posts == []
    receiver.script = []
    daemon.start()
    wait_for(lambda: receiver.posts, 10, what="delivery after the restart")
    assert "doomed" in receiver.texts()[0]


def test_stalled_fires_only_after_the_last_item(make_daemon, receiver: Receiver,
                                                 tmp_path: Path) -> None:
    """A 10 s silent load phase (busy CPU, no output) with stall_timeout_s 4 must not
    fire; the hang after the last item must."""
    out = tmp_path / "out"
    code = f"""
import os, time
t0 = time.time()
while time.time() - t0 < 10:   # loading: CPU busy, nothing written, nothing printed
    sum(i * i for i in range(10000))
os.makedirs({str(out)!r}, exist_ok=True)
for i in range(5):
    open(os.path.join({str(out)!r}, f"item{{i}}.bin"), "wb").write(b"x")
    time.sleep(0.3)
time.sleep(600)                # hang
"""
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job(code), name="hangs", output_dir=str(out), pattern="*.bin",
                        expected_items=100, stall_timeout_s=4)
    wait_for(lambda: daemon.job(job["id"])["progress"]["files"] == 5, 25, what="5 items")
    last_item = (out / "item4.bin").stat().st_mtime  # when it was written, not seen here
    # nothing fired in the load phase (seen late here, the stall after it may be due)
    assert [t for t, _ in receiver.posts if t < last_item + 3.0] == []
    if time.time() < last_item + 2.0:
        assert daemon.job(job["id"])["alerts"] == []
    wait_for(lambda: receiver.posts, 12, what="the stalled message")
    fired = receiver.posts[0][0]
    assert fired - last_item >= 3.0  # 4 s after the last item, less tick granularity
    assert "stalled" in receiver.texts()[0] and "no new item" in receiver.texts()[0]
    (alert,) = daemon.job(job["id"])["alerts"]
    assert alert["rule"] == "stalled"
    # it says so everywhere: rate 0 and no ETA, not the last rate and a sliding ETA (#32)
    forecast = daemon.job(job["id"])["forecast"]
    assert forecast["rate_items_per_s"] == 0 and forecast["eta_s"] is None, forecast
    blocks = json.dumps(receiver.posts[0][1]["blocks"])
    assert "0 items/s" in blocks and "ETA" not in blocks, blocks
    metrics = daemon.http.get("/metrics").text
    labels = f'{{job_id="{job["id"]}",job_name="hangs"}}'
    assert f"jobsup_job_stalled{labels} 1.0" in metrics
    assert f"jobsup_job_rate_items_per_second{labels} 0.0" in metrics
    assert f"jobsup_job_eta_seconds{labels}" not in metrics
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    wait_for(lambda: len(receiver.posts) >= 2, 15, what="the resolved message after the stop")
    resolved = receiver.texts()[1]
    assert "RESOLVED: stalled" in resolved and "stopped by the user" in resolved


def test_stall_before_the_first_item_and_recovery(make_daemon, receiver: Receiver,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "out"
    flag = tmp_path / "go"
    code = f"""
import os, time
while not os.path.exists({str(flag)!r}):
    time.sleep(0.2)            # no CPU, no reads: no activity at all
os.makedirs({str(out)!r}, exist_ok=True)
for i in range(200):
    open(os.path.join({str(out)!r}, f"item{{i}}.bin"), "wb").write(b"x")
    time.sleep(0.2)
"""
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job(code), name="sleepy", output_dir=str(out), pattern="*.bin",
                        stall_timeout_s=3)
    wait_for(lambda: receiver.posts, 15, what="stalled before the first item")
    assert "no activity" in receiver.texts()[0]
    flag.touch()
    wait_for(lambda: len(receiver.posts) >= 2, 15, what="the resolve follow-up")
    assert "RESOLVED: stalled" in receiver.texts()[1]
    assert "cleared while the job runs" in receiver.texts()[1]
    assert daemon.job(job["id"])["alerts"] == []
    resolved = daemon.http.get("/api/v1/alerts", params={"state": "resolved"}).json()
    assert [a["rule"] for a in resolved] == ["stalled"] and resolved[0]["resolved_at"]
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_an_idle_job_without_an_output_contract_sends_no_stall(
        make_daemon, receiver: Receiver, tmp_path: Path) -> None:
    """Two equally quiet jobs: the one with an output dir is stalled before its first
    item, the one that never said what progress looks like (a server, a `sleep`) is idle
    and sends nothing (#32 item 4: it was flagged after stall_timeout_s)."""
    daemon = slack_daemon(make_daemon, receiver)
    idle = daemon.submit(python_job("import time; time.sleep(120)"), name="idle-server",
                         stall_timeout_s=2)
    watched = daemon.submit(python_job("import time; time.sleep(120)"), name="watched",
                            output_dir=str(tmp_path / "out"), stall_timeout_s=2)
    wait_for(lambda: receiver.posts, 20, what="the watched job's stall")
    daemon.wait_ticks(3)  # the idle one began at the same time: it would have come by now
    assert len(receiver.posts) == 1 and "watched" in receiver.texts()[0], receiver.texts()
    assert daemon.job(idle["id"])["alerts"] == []
    for job in (idle, watched):
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_success_message_and_incomplete(make_daemon, receiver: Receiver, tmp_path: Path) -> None:
    daemon = slack_daemon(make_daemon, receiver, JOBSUP_NOTIFY_ON_SUCCESS="true")
    out = tmp_path / "out"
    code = (f"import os; os.makedirs({str(out)!r}); "
            f"[open(os.path.join({str(out)!r}, f'{{i}}.bin'), 'w').close() for i in range(3)]")
    job = daemon.submit(python_job(code), name="short", output_dir=str(out), pattern="*.bin",
                        expected_items=10)
    daemon.wait_state(job["id"], "succeeded")
    wait_for(lambda: len(receiver.posts) >= 2, 10, what="incomplete + succeeded messages")
    texts = "\n".join(receiver.texts())
    assert "incomplete" in texts and "3 of 10 expected items" in texts
    assert "short" in texts and "succeeded" in texts


def test_metrics_names_and_retention(make_daemon) -> None:
    daemon = make_daemon(env={"JOBSUP_METRICS_ENDED_RETENTION_S": "3"})
    job = daemon.submit(python_job("import time; time.sleep(600)"), name="m", expected_items=7)
    daemon.wait_state(job["id"], "running")
    labels = f'job_id="{job["id"]}",job_name="m"'
    names = ("jobsup_job_items_expected", "jobsup_job_cpu_percent", "jobsup_job_rss_bytes",
             "jobsup_job_restarts")
    scrapes: list[str] = []

    def sampled() -> str | None:  # the job's series come with its first sample
        scrapes.append(daemon.http.get("/metrics").text)
        return scrapes[-1] if all(f"{n}{{{labels}}}" in scrapes[-1] for n in names) else None

    text = wait_for(sampled, 15, what=lambda: f"the job's series; last scrape:\n{scrapes[-1]}")
    assert f'jobsup_job_state{{{labels},state="running"}} 1.0' in text
    assert f'jobsup_job_state{{{labels},state="failed"}} 0.0' in text
    assert 'jobsup_alerts_firing{rule="crashed"} 0.0' in text
    assert "jobsup_tick_duration_seconds_bucket" in text
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    daemon.wait_state(job["id"], "stopped")
    assert f'jobsup_job_state{{{labels},state="stopped"}} 1.0' in daemon.http.get("/metrics").text
    wait_for(lambda: job["id"] not in daemon.http.get("/metrics").text, 10,
             what="the ended job's series to disappear")


def end_recorded_then_daemon_died(daemon: Daemon, job_id: str, state: str,
                                  exit_code: int) -> None:
    """What a daemon killed right after committing a job's end leaves: the end in the
    database, no alert step run, the job's processes gone."""
    import json

    from sqlalchemy import update

    from supervisor.storage.database import make_engine
    from supervisor.storage.tables import Job

    wait_for(lambda: daemon.job(job_id)["pid"], 10, what="the worker's pid")
    daemon.kill()
    db = make_engine(daemon.env.get("JOBSUP_DATABASE_URL")
                     or f"sqlite:///{daemon.data_dir / 'jobsup.db'}")
    with db.begin() as conn:
        conn.execute(update(Job).where(Job.id == job_id).values(
            state=state, exit_code=exit_code, exit_reason="exit",
            reason=f"exited with code {exit_code}", ended_at=time.time()))
    db.dispose()
    attempt = daemon.data_dir / "jobs" / job_id / "attempt-1"
    os.kill(json.loads((attempt / "shim.json").read_text())["pid"], 9)
    os.killpg(json.loads((attempt / "worker.json").read_text())["pid"], 9)


@pytest.mark.both_databases
def test_crash_recorded_by_a_daemon_that_died_before_alerting(make_daemon,
                                                               receiver: Receiver) -> None:
    """The job's end was committed but the daemon died before its alert step: the next
    daemon still opens `crashed` and sends it, once."""
    daemon = slack_daemon(make_daemon, receiver)
    job = daemon.submit(python_job("import time; time.sleep(600)"), name="orphaned")
    end_recorded_then_daemon_died(daemon, job["id"], "failed", 1)
    daemon.start()
    wait_for(lambda: receiver.posts, 10, what="the crash message from the new daemon")
    daemon.wait_ticks(4)  # four more ticks: not sent again
    assert len(receiver.posts) == 1 and "orphaned" in receiver.texts()[0]
    assert [a["rule"] for a in daemon.job(job["id"])["alerts"]] == ["crashed"]


@pytest.mark.both_databases
def test_success_recorded_by_a_daemon_that_died_before_telling(make_daemon,
                                                               receiver: Receiver) -> None:
    """The same for a success: the next daemon sends its message, once."""
    daemon = slack_daemon(make_daemon, receiver, JOBSUP_NOTIFY_ON_SUCCESS="true")
    job = daemon.submit(python_job("import time; time.sleep(600)"), name="quietly-done")
    end_recorded_then_daemon_died(daemon, job["id"], "succeeded", 0)
    daemon.start()
    wait_for(lambda: receiver.posts, 10, what="the success message from the new daemon")
    daemon.wait_ticks(4)  # four more ticks: not sent again
    assert len(receiver.posts) == 1
    assert "quietly-done" in receiver.texts()[0] and "succeeded" in receiver.texts()[0]
