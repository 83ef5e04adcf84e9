"""What a message says: the generic webhook's versioned event (`jobsup.event/v1`,
docs/api.md) and, built from it, the Slack message in Block Kit with a plain `text`
fallback (what Slack shows in notifications).

Everything a job controls (its name, its reason, its log) is escaped for Slack (`&`,
`<`, `>` as `&amp;` `&lt;` `&gt;`: a job printing `<!channel>` mentions no one), cut to
Slack's limits with an ellipsis, and the log tail is chosen by whole lines, each capped,
inside a code block whose fence a job's own backticks cannot close. The job's env
values are redacted (`wire.redact`) before anything is built from the job, so no
rendering of the message can carry them.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from typing import Any, TypedDict
from urllib.parse import quote

from supervisor.alerting.wire import redact
from supervisor.formatting import format_bytes, format_duration, from_iso, terminal_text

SCHEMA = "jobsup.event/v1"
"""The generic webhook's body format; a breaking change gets a new version."""

EMOJI = {"firing": ":rotating_light:", "resolved": ":white_check_mark:",
         "succeeded": ":tada:"}

# Slack's limits (https://api.slack.com/reference/block-kit/blocks)
HEADER_MAX_CHARS = 150
SECTION_TEXT_MAX_CHARS = 3000
FIELD_MAX_CHARS = 2000
MAX_FIELDS = 10
MAX_BLOCKS = 50
CONTEXT_MAX_ELEMENTS = 10
FALLBACK_MAX_CHARS = 3000
"""Slack cuts a message's `text` at 40,000 characters; a notification shows far less."""

LOG_LINE_MAX_CHARS = 300
"""A log line longer than this is cut (with an ellipsis): one long line must not push
the others (the traceback) out of the message."""
HOST_MAX_CHARS = 60
ELLIPSIS = "…"
ZERO_WIDTH_SPACE = "\u200b"
RUNNING_STATES = ("running", "pending")

JobDocument = dict[str, Any]
"""A job as `GET /jobs/{id}` shows it, in JSON: a message's `job` (docs/api.md). The API
builds it (`api/views.py`) and the daemon hands the builder to the recorder
(`AlertRecorder.job_document`): a message says of a job what the API says, and
`alerting/` imports nothing of the API."""


class MessageAlert(TypedDict):
    """An alert as a message tells it (a message's `alert`; docs/api.md's Alert), built
    from its row (`recorder.message_alert`)."""

    id: int
    job_id: str
    rule: str
    severity: str
    state: str
    started_at: str
    """ISO 8601; "" for an alert sent before it could be recorded."""
    resolved_at: str | None
    message: str


@dataclass(frozen=True)
class MessageContext:
    """What a message says besides the job: where it comes from and where to look."""

    host: str = field(default_factory=socket.gethostname)
    public_url: str = "http://127.0.0.1:8765"
    """The daemon as a reader of the message reaches it (`JOBSUP_PUBLIC_URL`)."""
    grafana_url: str | None = None
    """The jobsup dashboard's URL (`JOBSUP_GRAFANA_URL`); no Grafana link without it."""


def escape(text: str) -> str:
    """Slack's escaping: `&`, `<`, `>` only (https://api.slack.com/reference/surfaces/formatting#escaping)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def cut(text: str, max_chars: int) -> str:
    """`text`, or its start and an ellipsis, in at most `max_chars` characters."""
    return text if len(text) <= max_chars else text[:max(0, max_chars - 1)] + ELLIPSIS


def fit(text: str, max_chars: int) -> str:
    """`text` escaped for Slack and cut so that the escaped form has at most `max_chars`
    characters (cut before escaping: an entity is never split)."""
    escaped = escape(text)
    if len(escaped) <= max_chars:
        return escaped
    lo, hi = 0, min(len(text), max_chars)  # the longest cut whose escaped form fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(escape(cut(text, mid))) <= max_chars:
            lo = mid
        else:
            hi = mid - 1
    return escape(cut(text, lo)) if lo > 0 else ""


def fence_safe(text: str) -> str:
    """No two backticks in a row (a zero-width space between them): a job's ``` cannot
    close the code block it is quoted in."""
    return re.sub("`(?=`)", "`" + ZERO_WIDTH_SPACE, text)


def log_line(line: str) -> str:
    """A log line as a terminal would show it (what follows its last carriage return:
    tqdm redraws its bar with them; no colour codes or control characters), capped at
    LOG_LINE_MAX_CHARS."""
    line = terminal_text(line)
    shown = line.rstrip().rsplit("\r", 1)[-1] or line.strip()
    return cut(shown, LOG_LINE_MAX_CHARS)


def code_block(lines: list[str], max_chars: int, title: str = "") -> tuple[str, int]:
    """The last of `lines` that fit in `max_chars` as `title` + an escaped, fence-safe
    code block, each capped; and how many lines that is (at least one: a capped line
    always fits a section)."""
    shown: list[str] = []
    size = len(title) + len("```\n\n```")
    for line in reversed(lines):
        quoted = fence_safe(escape(log_line(line)))
        if shown and size + len(quoted) + 1 > max_chars:
            break
        shown.insert(0, quoted)
        size += len(quoted) + 1
    return title + "```\n" + "\n".join(shown) + "\n```", len(shown)


def _seconds(value: Any) -> float | None:
    """An ISO time of the API (`2026-11-29T14:18:15Z`) as seconds since the epoch."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return from_iso(value)
    except ValueError:
        return None


def run_time_s(job: JobDocument, now: float | None) -> float | None:
    """From the latest start to the end, or to `now` for a job still running."""
    started, ended = _seconds(job.get("started_at")), _seconds(job.get("ended_at"))
    end = ended if ended is not None else (now if job.get("state") == "running" else None)
    return None if started is None or end is None else max(0.0, end - started)


def max_attempts(job: JobDocument) -> int:
    spec = job.get("spec") or {}
    if spec.get("restart_policy") == "on-failure":
        return 1 + int(spec.get("max_restarts") or 0)
    return 1


def stopped_by_user(job: JobDocument) -> bool:
    """A stop someone asked for (not one because the jobs it served ended)."""
    return job.get("state") == "stopped" and "on request" in (job.get("reason") or "")


def cause(kind: str, job: JobDocument, alert: MessageAlert | None) -> str | None:
    """Why the message was sent, once: the alert's message (a `crashed` alert's already
    holds the job's reason), else the job's reason."""
    if kind == "resolved":
        was = f"was: {alert['message']}" if alert is not None else ""
        state, reason = job.get("state"), job.get("reason")
        if stopped_by_user(job):
            now = "the job was stopped by the user" + (f" ({reason})" if reason else "")
        elif state in RUNNING_STATES:
            now = "cleared while the job runs"
        else:
            now = f"the job {state}" + (f": {reason}" if reason else "")
        return f"{was}; {now}" if was else now
    if alert is not None:
        return str(alert["message"])
    return job.get("reason")


def facts(kind: str, job: JobDocument, run_s: float | None) -> list[tuple[str, str]]:
    """(label, value) pairs that apply to the job's state: no rate or ETA once it has
    ended, no bytes or disk without an output directory."""
    p, f, r = job.get("progress") or {}, job.get("forecast") or {}, job.get("resources") or {}
    running = job.get("state") == "running"
    has_output = bool((job.get("spec") or {}).get("output_dir"))
    out = [("state", str(job.get("state")))]
    if job.get("attempt"):
        out.append(("attempt", f"{job['attempt']} of {max_attempts(job)}"))
    if run_s is not None:
        out.append(("run time", format_duration(run_s)))
    if kind == "resolved":
        return out
    done, total = p.get("items_done"), p.get("items_total")
    if done is not None:
        out.append(("progress", f"{done}/{total} items" if total else f"{done} items"))
    if running and f.get("rate_items_per_s") is not None:  # 0: stalled, and no ETA
        out.append(("rate", f"{f['rate_items_per_s']:.3g} items/s"))
    if running and f.get("eta_s") is not None:
        out.append(("ETA", f"{format_duration(f['eta_s'])} (at {f.get('eta_at')})"))
    if has_output:
        out.append(("written", format_bytes(p.get("bytes_written"))))
        if running and f.get("disk_free_bytes") is not None:
            runway = f"{format_bytes(f['disk_free_bytes'])} free"
            if f.get("disk_full_in_s") is not None:
                runway += f", full in {format_duration(f['disk_full_in_s'])}"
            if f.get("will_fit") is False:
                runway += " — the rest will NOT fit"
            out.append(("disk", runway))
    if running and r.get("gpu_memory_bytes"):
        out.append(("GPU memory", format_bytes(r["gpu_memory_bytes"])))
    return out[:MAX_FIELDS]


GRAFANA_MARGIN_S = 600.0
"""Grafana links open the job's run with this much before its start and after its end
(or the event), so the change that led to the alert is in view."""


def grafana_range(job: JobDocument, alert: MessageAlert | None,
                  now: float | None) -> str:
    """`&from=...&to=...` (epoch milliseconds, Grafana's time range) around the job's
    run: from its start (or the alert's, if earlier) to its end, or to the event for a
    job still running (`to=now` when the event's time is not given); empty when the job
    never started and no alert gives a time."""
    starts = [t for t in (_seconds(job.get("started_at")),
                          _seconds(alert.get("started_at") if alert else None)) if t is not None]
    if not starts:
        return ""
    ended = _seconds(job.get("ended_at"))
    end = ended if ended is not None else now
    to = "now" if end is None else str(int((end + GRAFANA_MARGIN_S) * 1000))
    return f"&from={int((min(starts) - GRAFANA_MARGIN_S) * 1000)}&to={to}"


def links(job: JobDocument, context: MessageContext, *, alert: MessageAlert | None = None,
          now: float | None = None) -> dict[str, str | None]:
    """The job in the API and its log there (for programs: the webhook's readers), its
    page (for people: Slack's "job" and "log" open it, not raw JSON) and Grafana, at the
    time of the job's run (`grafana_range`)."""
    root, job_id = context.public_url.rstrip("/"), quote(str(job["id"]))
    base = f"{root}/api/v1/jobs/{job_id}"
    grafana = None
    if context.grafana_url:
        sep = "&" if "?" in context.grafana_url else "?"
        grafana = (f"{context.grafana_url}{sep}var-job_name={quote(str(job['name']), safe='')}"
                   + grafana_range(job, alert, now))
    return {"job": base, "logs": base + "/logs?tail=200", "page": f"{root}/jobs/{job_id}",
            "grafana": grafana}


def headline(kind: str, job: JobDocument, alert: MessageAlert | None) -> str:
    if alert is not None:
        verb = "RESOLVED" if kind == "resolved" else str(alert["severity"]).upper()
        return f"{verb}: {alert['rule']}"
    return f"job {job.get('state')}"


def compose(kind: str, job: JobDocument, *, alert: MessageAlert | None,
            log_tail: list[str], context: MessageContext | None = None,
            now: float | None = None) -> dict[str, Any]:
    """The message of one event: the `jobsup.event/v1` body of the generic webhook
    (without `event_id`, fixed by the outbox) and, under `slack`, the Slack message.
    `now` (seconds since the epoch) gives a running job's run time."""
    context = context or MessageContext()
    run_s = run_time_s(job, now)
    event = redact({
        "schema": SCHEMA, "kind": kind, "host": context.host, "text": "",
        "cause": cause(kind, job, alert), "attempt": job.get("attempt"),
        "max_attempts": max_attempts(job), "run_time_s": run_s,
        "stopped_by_user": stopped_by_user(job),
        "job": job, "alert": alert, "log_tail": [terminal_text(line) for line in log_tail],
        "links": links(job, context, alert=alert, now=now)})
    pairs = facts(kind, event["job"], run_s)  # from the redacted job, like the rest
    tail = event["log_tail"] if kind != "resolved" else []
    event["text"] = plain_text(kind, event, pairs, tail)
    event["slack"] = slack_message(kind, event, pairs, tail)
    return event


def plain_text(kind: str, event: dict[str, Any], pairs: list[tuple[str, str]],
               tail: list[str]) -> str:
    """The message for people, unescaped (the generic webhook's `text`)."""
    job = event["job"]
    lines = [f"{headline(kind, job, event['alert'])} — job {job['name']} ({job['id']}) "
             f"on {event['host']}"]
    if event["cause"]:
        lines.append(str(event["cause"]))
    lines += [f"{label}: {value}" for label, value in pairs]
    if tail:
        lines.append("last log lines:")
        lines += [log_line(line) for line in tail]
    lines.append(f"job: {event['links']['job']}")
    return "\n".join(lines)


def _mrkdwn(text: str) -> dict[str, str]:
    return {"type": "mrkdwn", "text": text}


def _link(url: str, label: str) -> str:
    return f"<{escape(url).replace('|', '%7C')}|{label}>"


def slack_message(kind: str, event: dict[str, Any], pairs: list[tuple[str, str]],
                  tail: list[str]) -> dict[str, Any]:
    """`{"text": fallback, "blocks": [...]}` within Slack's limits."""
    job, host = event["job"], cut(str(event["host"]), HOST_MAX_CHARS)
    emoji = EMOJI.get(kind, "")
    head = f"{emoji} {headline(kind, job, event['alert'])} — "
    where = f" on {host}"
    name_room = HEADER_MAX_CHARS - len(escape(head)) - len(escape(where))
    header = escape(head) + fit(str(job["name"]), name_room) + escape(where)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": header, "emoji": True}}]
    if event["cause"]:
        blocks.append({"type": "section",
                       "text": _mrkdwn(fit(str(event["cause"]), SECTION_TEXT_MAX_CHARS))})
    if pairs:
        blocks.append({"type": "section", "fields": [
            _mrkdwn(f"*{label}*\n" + fit(value, FIELD_MAX_CHARS - len(label) - 3))
            for label, value in pairs]})
    if tail:
        text, _ = code_block(tail, SECTION_TEXT_MAX_CHARS, "*last log lines*\n")
        blocks.append({"type": "section", "text": _mrkdwn(text)})
    urls = event["links"]
    elements = [f"job `{escape(str(job['id']))}` on `{escape(host)}`",
                _link(urls["page"], "job"), _link(f"{urls['page']}#log", "log")]
    if urls.get("grafana"):
        elements.append(_link(urls["grafana"], "Grafana"))
    blocks.append({"type": "context", "elements": [
        _mrkdwn(cut(e, SECTION_TEXT_MAX_CHARS)) for e in elements[:CONTEXT_MAX_ELEMENTS]]})
    fallback = f"{emoji} {headline(kind, job, event['alert'])} — job {job['name']} " \
               f"({job['id']}) on {host}" + (f": {event['cause']}" if event["cause"] else "")
    return {"text": fit(fallback, FALLBACK_MAX_CHARS), "blocks": blocks[:MAX_BLOCKS]}
