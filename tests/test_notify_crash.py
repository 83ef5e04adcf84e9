"""Notifications against a real daemon: SIGKILLed while a POST to a slow receiver is in
flight, and with secrets around (job env, token, webhook URLs, signing secret) that must
reach neither a receiver nor the daemon's log."""

from __future__ import annotations

import random
import sqlite3
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from tests.helpers import Daemon, Receiver, python_job, wait_for
from tests.test_notify_delivery import verify

pytestmark = pytest.mark.slow

UUID_LEN = 36


def pending_notifications(daemon: Daemon) -> int:
    db = sqlite3.connect(f"file:{daemon.data_dir / 'jobsup.db'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT count(*) FROM notifications "
                              "WHERE sent_at IS NULL AND failed_at IS NULL").fetchone()[0])
    finally:
        db.close()


@pytest.mark.timeout(300)
def test_kills_mid_delivery_give_only_marked_duplicates(make_daemon) -> None:
    """The receiver acts on each POST and answers 1.5 s later. The daemon is SIGKILLed 3
    times while a POST is in flight and 3 times at random moments, restarted each time.
    Every message carries its event id; a message arrives more than once only when a
    kill cut its delivery short, and every extra copy says it may be a redelivery."""
    hook = Receiver(delay_s=1.5)
    try:
        daemon = make_daemon(env={"JOBSUP_WEBHOOK_URL": hook.url,
                                  "JOBSUP_NOTIFY_ON_SUCCESS": "true"})
        jobs = [daemon.submit(python_job("print('done')"), name=f"quick-{n}")
                for n in range(3)]
        rng = random.Random(20261130)
        aimed, cut_short = 0, 0
        for n in range(6):
            if n == 3:  # more messages, for the kills at random moments
                jobs += [daemon.submit(python_job("print('done')"), name=f"late-{k}")
                         for k in range(2)]
            if n < 3:
                wait_for(lambda: hook.in_flight, 30, interval=0.01, what="a POST in flight")
            else:
                time.sleep(rng.uniform(0.0, 2.0))
            with hook.lock:
                received, in_flight = len(hook.requests), hook.in_flight > 0
                answered_lately = any(t > time.time() - 0.25 for t in hook.answered)
            daemon.kill()
            # a request the dead daemon had already written still arrives
            wait_for(lambda: hook.open_connections() == 0, 15,
                     what=lambda: f"the receiver done with the dead daemon's connections "
                                  f"({hook.open_connections()} open)")
            with hook.lock:
                arrived_after = len(hook.requests) > received
            aimed += n < 3
            cut_short += in_flight or arrived_after or answered_lately
            daemon.start()
        ids = {job["id"] for job in jobs}

        def all_delivered() -> bool:
            with hook.lock:
                told = {body["job"]["id"] for _, body in hook.posts}
            return told >= ids and pending_notifications(daemon) == 0

        wait_for(all_delivered, 60, interval=0.2, what="every success message delivered")
        time.sleep(3)  # and nothing more comes
        copies: dict[str, list[dict[str, str]]] = defaultdict(list)
        event_of_job: dict[str, set[str]] = defaultdict(set)
        for (headers, _), (_, body) in zip(hook.requests, hook.posts, strict=True):
            event_id = body.get("event_id")
            assert isinstance(event_id, str) and len(event_id) == UUID_LEN, body.keys()
            assert headers["x-jobsup-event-id"] == event_id
            copies[event_id].append(headers)
            event_of_job[body["job"]["id"]].add(event_id)
        assert set(event_of_job) == ids
        assert all(len(events) == 1 for events in event_of_job.values()), event_of_job
        duplicates = len(hook.posts) - len(copies)
        assert aimed <= duplicates <= cut_short, (aimed, duplicates, cut_short)
        for sent in copies.values():
            attempts = [int(h["x-jobsup-attempt"]) for h in sent]
            assert attempts == sorted(set(attempts)), attempts
            assert all(h.get("x-jobsup-redelivery") == "1" for h in sent[1:]), sent
        log = "".join((daemon.log_dir / f"daemon-{n}.log").read_text()
                      for n in range(1, daemon.starts + 1))
        assert "marked as a possible redelivery" in log
    finally:
        hook.close()


@pytest.mark.timeout(120)
def test_no_secret_reaches_a_receiver_or_the_log(make_daemon, tmp_path: Path) -> None:
    slack, hook = Receiver(), Receiver()
    try:
        slack_url = slack.url.replace("/hook", "/services/T0SECRET1/B0SECRET2/slackPathSecret3")
        hook_url = hook.url.replace("/hook", "/in/hookPathSecret4?key=hookQuerySecret5")
        token = f"tok-{uuid.uuid4().hex}"
        signing = f"whsec-{uuid.uuid4().hex}"
        daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": slack_url,
                                  "JOBSUP_WEBHOOK_URL": hook_url,
                                  "JOBSUP_WEBHOOK_SECRET": signing, "JOBSUP_TOKEN": token,
                                  "JOBSUP_LOG_LEVEL": "debug",
                                  "JOBSUP_NOTIFY_ON_SUCCESS": "false"}, start=False)
        daemon.http.headers["Authorization"] = f"Bearer {token}"
        daemon.start()
        job = daemon.submit(python_job(
            "import os, sys\n"
            "print('logging in with', os.environ['HF_TOKEN'])\n"
            "print('webhook secret seen by the job:', os.environ.get('JOBSUP_WEBHOOK_SECRET'))\n"
            "sys.exit(1)"), name="leaky",
            env={"HF_TOKEN": "secret-xyz", "WANDB_API_KEY": "wandb-0123456789abcdef"})
        daemon.wait_state(job["id"], "failed")
        wait_for(lambda: slack.posts and hook.posts, 15, what="the crash message at both")
        daemon.wait_ticks(3)  # a few more ticks of logging
        assert "logging in with secret-xyz" in daemon.logs(job["id"])  # the secret was there
        secrets = ["secret-xyz", "wandb-0123456789abcdef", token, signing, "T0SECRET1",
                   "B0SECRET2", "slackPathSecret3", "hookPathSecret4", "hookQuerySecret5"]
        log = daemon.log()
        assert " DEBUG " in log  # the daemon really logged at DEBUG
        for secret in secrets:
            assert secret not in log, f"{secret} in the daemon's log"
            for receiver in (slack, hook):
                for headers, body in receiver.requests:
                    assert secret.encode() not in body, f"{secret} in a payload"
                    assert secret not in str(headers), f"{secret} in a header"
        ((_, message),) = hook.posts
        assert message["job"]["spec"]["env"] == {"HF_TOKEN": "<redacted>",
                                                 "WANDB_API_KEY": "<redacted>"}
        assert "logging in with <redacted>" in "\n".join(message["log_tail"])
        assert "seen by the job: None" in message["text"]
        ((_, slack_body),) = slack.posts
        assert list(slack_body) == ["text", "blocks"] and "CRITICAL: crashed" in slack_body["text"]
        ((slack_headers, _),) = slack.requests
        ((headers, body),) = hook.requests
        assert slack_headers["x-jobsup-event-id"] == headers["x-jobsup-event-id"] \
            == message["event_id"]
        signed = httpx.Headers(headers)
        assert verify(signing, signed, body, now=time.time())
        assert not verify("another-secret", signed, body, now=time.time())
        assert not verify(signing, signed, body + b" ", now=time.time())
    finally:
        slack.close()
        hook.close()
