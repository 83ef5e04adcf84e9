"""Slack messages in Block Kit: every message we build is parsed by Slack's own SDK models
(`slack_sdk.models.blocks`) and validated (`validate_json` enforces Slack's lengths and
counts), and checked against the limits the SDK does not enforce; escaping, fences, the
log tail's choice of lines and the header's truncation, in the worst case."""

from __future__ import annotations

import copy
import json
import re
import socket
from typing import Any

import pytest
from slack_sdk.models.blocks import Block, ContextBlock, HeaderBlock, SectionBlock

from supervisor.alerting import messages
from supervisor.alerting.messages import (
    MessageContext,
    code_block,
    compose,
    cut,
    escape,
    fence_safe,
    fit,
    log_line,
)
from supervisor.config import Settings
from tests.test_notify_unit import ALERT, JOB, LOG_TAIL

CONTEXT = MessageContext(host="gpu-node-7", public_url="http://jobs.example:8765",
                         grafana_url="https://grafana.example/d/jobsup/jobsup?orgId=1")
BLOCK_TYPES = {"header": HeaderBlock, "section": SectionBlock, "context": ContextBlock}


def validate(slack: dict[str, Any]) -> list[Block]:
    """Every block through Slack's models, and the message's limits; the parsed blocks."""
    assert set(slack) == {"text", "blocks"}
    assert 0 < len(slack["text"]) <= messages.FALLBACK_MAX_CHARS
    blocks = slack["blocks"]
    assert 1 <= len(blocks) <= messages.MAX_BLOCKS
    parsed = []
    for raw in blocks:
        block = Block.parse(raw)
        assert isinstance(block, BLOCK_TYPES[raw["type"]]), raw["type"]
        block.validate_json()  # raises SlackObjectFormationError past a limit
        assert block.to_dict() == raw  # nothing we sent is unknown to Slack's model
        parsed.append(block)
        if raw["type"] == "header":
            assert len(raw["text"]["text"]) <= messages.HEADER_MAX_CHARS
        if raw["type"] == "section":
            assert "text" in raw or "fields" in raw
            if "text" in raw:
                assert len(raw["text"]["text"]) <= messages.SECTION_TEXT_MAX_CHARS
            fields = raw.get("fields", [])
            assert len(fields) <= messages.MAX_FIELDS
            for f in fields:  # slack_sdk does not check this one
                assert len(f["text"]) <= messages.FIELD_MAX_CHARS
        if raw["type"] == "context":
            assert len(raw["elements"]) <= messages.CONTEXT_MAX_ELEMENTS
            for e in raw["elements"]:
                assert len(e["text"]) <= messages.SECTION_TEXT_MAX_CHARS
    assert parsed[0].type == "header"
    return parsed


def unescaped(text: str) -> list[str]:
    """The `&`, `<`, `>` that are not part of our escaping or of our own links."""
    without_links = re.sub(r"<https?://[^<>|\s]+\|[A-Za-z]+>", "", text)
    return re.findall(r"[<>]|&(?!amp;|lt;|gt;)", without_links)


def block_texts(slack: dict[str, Any]) -> list[str]:
    out = [slack["text"]]
    for b in slack["blocks"]:
        if "text" in b:
            out.append(b["text"]["text"])
        out += [f["text"] for f in b.get("fields", [])]
        out += [e["text"] for e in b.get("elements", [])]
    return out


NCCL = ("exited with code 1 — NCCL error: unhandled system error (run with NCCL_DEBUG=INFO "
        "for details), rank 3 of 8 on gpu-node-7 (seen in the log)")


def worst_job() -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["name"] = ("train-draft-<!channel>-&-" + "x" * 128)[:128]
    job.update(state="failed", reason=NCCL, exit_code=1, exit_reason="exit", attempt=3,
               ended_at="2023-11-14T23:00:00Z")
    return job


def worst_tail() -> list[str]:
    tail = []
    for n in range(20):
        if n % 4 == 0:
            tail.append(f"{n} " + "A&B<C>" * 600 + " ``` <!channel>")  # > 3000 chars
        elif n % 4 == 1:
            tail.append(f"{n} ```python\n")
        elif n % 4 == 2:
            tail.append(f"{n} <!channel> <!here> <@U123> & done " + "y" * 400)
        else:
            tail.append(f"{n} \r 10%|#    | 1/10\r 20%|##   | 2/10 ````")
    return tail


def test_the_worst_case_validates_and_nothing_can_mention_anyone() -> None:
    job = worst_job()
    assert len(job["name"]) == 128
    crashed = {**ALERT, "rule": "crashed", "message": f"{job['name']} failed: {NCCL}"}
    msg = compose("firing", job, alert=crashed, log_tail=worst_tail(),
                  context=CONTEXT, now=1_700_000_000.0)
    slack = msg["slack"]
    parsed = validate(slack)
    raw = json.dumps(slack, ensure_ascii=False)
    assert "<!channel>" not in raw and "<!here>" not in raw and "<@U123>" not in raw
    assert "&lt;!channel&gt;" in raw
    for text in block_texts(slack):
        assert unescaped(text) == [], text[:200]
    header = slack["blocks"][0]["text"]["text"]
    assert header.endswith("… on gpu-node-7") and header.startswith(":rotating_light: CRITICAL")
    assert "train-draft-&lt;!channel&gt;-&amp;-xxx" in header
    assert isinstance(parsed[0], HeaderBlock)
    # the cause once (the alert's message holds the reason), NCCL named
    assert sum(t.count("NCCL error") for t in block_texts(slack)[1:]) == 1
    assert "NCCL error" in slack["text"]
    # the tail: the last lines that fit, each capped, the fence intact
    (code,) = [t for t in block_texts(slack) if t.startswith("*last log lines*")]
    body = code.removeprefix("*last log lines*\n```\n").removesuffix("\n```")
    assert "```" not in body and code.count("```") == 2
    lines = body.split("\n")
    # the last line, as a terminal shows a tqdm bar: after its last carriage return
    assert lines[-1].startswith(" 20%|##   | 2/10 `") and "10%" not in lines[-1]
    assert lines[-2].startswith("18 &lt;!channel&gt; &lt;!here&gt; &lt;@U123&gt; &amp; done")
    assert all(len(line) <= 5 * messages.LOG_LINE_MAX_CHARS for line in lines)
    assert any(line.endswith("…") for line in lines)  # a >3000-char line, capped
    assert 2 < len(lines) < 20  # not all 20 fit: the oldest were left out, whole
    # the plain event keeps the full tail for machines (only env values masked)
    assert msg["log_tail"] == worst_tail()


def test_every_kind_and_state_validates() -> None:
    bare = {"id": "f00", "name": "bare", "state": "pending", "reason": None, "attempt": 0,
            "progress": {}, "forecast": {}, "resources": {}}
    ended = {**JOB, "state": "succeeded", "ended_at": "2023-11-14T23:00:00Z",
             "reason": "exited with code 0"}
    stopped = {**JOB, "state": "stopped", "reason": "stopped on request (SIGTERM)",
               "ended_at": "2023-11-14T23:00:00Z"}
    resolved = {**ALERT, "state": "resolved", "rule": "stalled"}
    cases = [("firing", JOB, ALERT, LOG_TAIL), ("firing", bare, ALERT, []),
             ("succeeded", ended, None, LOG_TAIL), ("succeeded", bare, None, []),
             ("resolved", stopped, resolved, LOG_TAIL), ("resolved", JOB, resolved, []),
             ("firing", JOB, ALERT, [""]), ("firing", JOB, ALERT, ["\r\r"])]
    for kind, job, alert, tail in cases:
        for context in (CONTEXT, MessageContext(host="h" * 300)):
            validate(compose(kind, job, alert=alert, log_tail=tail, context=context,
                             now=1_700_000_000.0)["slack"])


def test_fields_follow_the_state() -> None:
    def field_labels(job: dict[str, Any]) -> list[str]:
        slack = compose("firing", job, alert=ALERT, log_tail=[], context=CONTEXT,
                        now=1_700_000_000.0)["slack"]
        (fields,) = [b["fields"] for b in slack["blocks"] if "fields" in b]
        return [f["text"].split("\n")[0].strip("*") for f in fields]

    assert field_labels(JOB) == ["state", "attempt", "run time", "progress", "rate", "ETA",
                                 "written", "disk", "GPU memory"]
    failed = {**JOB, "state": "failed", "ended_at": "2023-11-14T21:00:00Z"}
    assert field_labels(failed) == ["state", "attempt", "run time", "progress", "written"]
    no_output = {**failed, "spec": {**JOB["spec"], "output_dir": None}}
    assert field_labels(no_output) == ["state", "attempt", "run time", "progress"]
    never_restarts = {**failed, "spec": {"output_dir": None, "restart_policy": "never",
                                         "max_restarts": 5}, "attempt": 1}
    slack = json.dumps(compose("firing", never_restarts, alert=ALERT, log_tail=[],
                               context=CONTEXT)["slack"])
    assert "*attempt*\\n1 of 1" in slack


def test_links_in_the_context_block() -> None:
    slack = compose("firing", JOB, alert=ALERT, log_tail=[], context=CONTEXT)["slack"]
    (context,) = [b for b in slack["blocks"] if b["type"] == "context"]
    text = " ".join(e["text"] for e in context["elements"])
    # the job's page, for people, not the API's JSON (#32 item 6)
    assert "<http://jobs.example:8765/jobs/a1b2c3|job>" in text
    assert "<http://jobs.example:8765/jobs/a1b2c3#log|log>" in text
    assert "/api/" not in text
    # the URL's own `&` escaped, as Slack wants inside a link
    assert ("<https://grafana.example/d/jobsup/jobsup?orgId=1&amp;var-job_name=extract-hidden"
            "&amp;from=1699991400000&amp;to=now|Grafana>") in text  # no `now` given: to now
    assert "`gpu-node-7`" in text
    without = compose("firing", JOB, alert=ALERT, log_tail=[],
                      context=MessageContext(host="h"))["slack"]
    assert "Grafana" not in json.dumps(without)


def test_env_values_are_masked_in_the_slack_message_too() -> None:
    job = copy.deepcopy(JOB)
    job["spec"]["env"] = {"HF_TOKEN": "hf_secret_0123456789"}
    msg = compose("firing", job, alert={**ALERT, "message": "bad hf_secret_0123456789"},
                  log_tail=["token hf_secret_0123456789 & more"], context=CONTEXT)
    assert "hf_secret_0123456789" not in json.dumps(msg)
    assert "token &lt;redacted&gt; &amp; more" in json.dumps(msg["slack"])


# -- the pieces ---------------------------------------------------------------------------------

def test_escape_and_fit() -> None:
    assert escape("a & <b> <!channel>") == "a &amp; &lt;b&gt; &lt;!channel&gt;"
    assert cut("abcdef", 4) == "abc…" and cut("abc", 4) == "abc"
    assert fit("&&&&&&", 10) == "&amp;…"  # never half an entity: `&amp;&am` is not sent
    assert fit("<" * 1000, 3000) == "&lt;" * 749 + "…"
    assert fit("abc", 0) == ""
    for n in range(1, 40):
        out = fit("x&<>" * 20, n)
        assert len(out) <= n and unescaped(out) == []


def test_fence_safe_and_log_lines() -> None:
    assert "``" not in fence_safe("a ``` b ```` c")
    assert fence_safe("a ``` b").replace(messages.ZERO_WIDTH_SPACE, "") == "a ``` b"
    assert log_line("  5%|#  \r 50%|#####  \r100%|########## \n") == "100%|##########"
    assert log_line("x" * 5000) == "x" * 299 + "…"
    assert log_line("\x1b[1;31mERROR\x1b[0m shard\x00 3\r\x1b[2K 4\x07") == " 4"
    text, n = code_block([f"line {i}" for i in range(1000)], 200, "*t*\n")
    assert len(text) <= 200 and text.endswith("line 999\n```") and n == len(text.split("\n")) - 3
    text, n = code_block(["z" * 5000], 3000)  # one line always fits, capped
    assert n == 1 and len(text) == 8 + messages.LOG_LINE_MAX_CHARS - 1 + 1


def test_hostname_and_public_url_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOBSUP_HOSTNAME", raising=False)
    monkeypatch.delenv("JOBSUP_PUBLIC_URL", raising=False)
    assert Settings().resolved_hostname == socket.gethostname()
    assert Settings().resolved_public_url == "http://127.0.0.1:8765"
    assert Settings(host="0.0.0.0", port=9000).resolved_public_url == \
        f"http://{socket.gethostname()}:9000"
    assert Settings(host="::1").resolved_public_url == "http://[::1]:8765"
    monkeypatch.setenv("JOBSUP_HOSTNAME", "gpu-node-7")
    monkeypatch.setenv("JOBSUP_PUBLIC_URL", "https://jobs.example")
    monkeypatch.setenv("JOBSUP_GRAFANA_URL", "https://grafana.example/d/jobsup")
    s = Settings()
    assert (s.resolved_hostname, s.resolved_public_url, s.grafana_url) == (
        "gpu-node-7", "https://jobs.example", "https://grafana.example/d/jobsup")
    assert MessageContext().host == socket.gethostname()
