"""What every worker shares: progress reporting, JSONL input, conversation tokenization."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger("workers")


def setup_logging(verbose: bool = False, prefix: str = "") -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")


def replace_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool) -> None:
    """The workers' atomic write of a small file: a reader sees the old file or the whole
    new one, never half of it. `data` goes to `.NAME.PID.tmp` beside `path` (hidden and
    ending `.tmp`, so jobsup never counts it as an output item; the pid keeps two writers
    apart), then is renamed over it; no temp file is left behind, whatever fails.

    `fsync` is the caller's choice, made explicitly: with it the data is on disk before
    the rename (after a power loss the name holds the old file or the whole new one);
    without it a power loss can leave the new name empty, which suits a file rewritten
    every fraction of a second (the progress file). Large outputs have their own
    writeback policy (`hidden_files.write_atomically`). The supervisor's twin is
    `supervisor.runtime.fileio.replace_file` (the workers never import the supervisor)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # gone once renamed


def write_json(path: Path, data: Any) -> Path:
    """A worker's JSON report (summary, config, eval.json), indented, through
    `replace_file` with fsync (written once per run, and what a rerun resumes from)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"), fsync=True)
    return path


def fail(message: str, code: int = 2) -> NoReturn:
    """A user mistake: one clear line, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


class ProgressReporter:
    """Writes the jobsup progress file (docs/progress-file.md) at `$JOBSUP_PROGRESS_FILE`,
    atomically (`replace_file`, no fsync: it is rewritten all the time and a lost one is
    only a stale report), at most every `min_interval_s` unless forced, so a fast loop
    does not spend its time on it. Without the variable (not run by jobsup) it does
    nothing."""

    def __init__(self, total: int | None, unit: str, path: str | None = None,
                 min_interval_s: float = 0.5):
        self.path = path if path is not None else os.environ.get("JOBSUP_PROGRESS_FILE")
        self.total = total
        self.unit = unit
        self.min_interval_s = min_interval_s
        self._last_write = 0.0

    def update(self, done: int, metrics: Mapping[str, float] | None = None, *,
               force: bool = False) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if not force and now - self._last_write < self.min_interval_s:
            return
        self._last_write = now
        payload = {"done": done, "total": self.total, "unit": self.unit,
                   "metrics": {k: float(v) for k, v in (metrics or {}).items()}}
        try:
            replace_file(self.path, json.dumps(payload).encode("utf-8"), fsync=False)
        except OSError as exc:  # progress is best effort: never kill the work for it
            log.warning("cannot write progress file %s: %s", self.path, exc)


@dataclass
class JsonlStats:
    lines: int = 0
    malformed: list[int] = field(default_factory=list)
    """Line numbers (1-based) skipped as malformed."""


def read_jsonl(path: str | os.PathLike[str], stats: JsonlStats | None = None,
               required: Sequence[str] = ()) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for each valid line. A malformed line (not JSON, not an
    object, missing a required key) is skipped, logged with its number, and counted."""
    stats = stats if stats is not None else JsonlStats()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                missing = [key for key in required if key not in record]
                if missing:
                    raise ValueError(f"missing {', '.join(missing)}")
            except ValueError as exc:
                stats.malformed.append(number)
                log.warning("%s: skipping malformed line %d: %s", path, number, exc)
                continue
            yield number, record


def assistant_content(message: Mapping[str, Any]) -> str:
    """An assistant turn as the target model produced it: the reasoning trace (when the
    server returned one) inside <think>…</think>, then the answer."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if reasoning:
        return f"<think>\n{reasoning}\n</think>\n\n{content}"
    return str(content)


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
"""ShareGPT `from` names (and the OpenAI roles) to OpenAI roles, as SpecForge's
scripts/prepare_data.py and speculators' preprocessing map them."""


def record_messages(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation of an input record as OpenAI-style messages ({role, content}).

    Takes `messages` ([{role, content}], ours and OpenAI's) or, when absent,
    `conversations` (ShareGPT / SpecForge / speculators: [{from: human|gpt|system,
    value}] or [{role, content}]); `reasoning_content` (or speculators' `thinking`) is
    kept. Raises ValueError, naming the problem, for anything else: every reader
    (generate, extract, vocab) then skips the line as malformed."""
    if "messages" in record:
        messages, key = record["messages"], "messages"
    elif "conversations" in record:
        messages, key = record["conversations"], "conversations"
    else:
        raise ValueError("missing messages (or conversations)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{key} is not a list of objects")
    if key == "messages":
        return messages
    out = []
    for number, turn in enumerate(messages):
        name = turn.get("role", turn.get("from"))
        role = SHAREGPT_ROLES.get(name) if isinstance(name, str) else None
        if role is None:
            raise ValueError(f"conversations[{number}]: unknown role {name!r} (expected one "
                             f"of {', '.join(sorted(SHAREGPT_ROLES))})")
        content = turn["content"] if "content" in turn else turn.get("value")
        if not isinstance(content, str):
            raise ValueError(f"conversations[{number}]: content/value must be a string")
        message: dict[str, Any] = {"role": role, "content": content}
        reasoning = turn.get("reasoning_content") or turn.get("thinking")
        if reasoning:
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        role = str(m.get("role", "user"))
        text = assistant_content(m) if role == "assistant" else str(m.get("content") or "")
        out.append({"role": role, "content": text})
    return out


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the assistant wrote (what a draft model learns to predict)."""
    truncated: bool


def tokenize_conversation(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
                          max_length: int | None = None) -> Tokenized:
    """Render the conversation with the tokenizer's chat template and mark the tokens
    that fall inside assistant turns.

    The assistant spans are found on the text: the template is rendered for each prefix
    of the conversation, and each assistant turn spans from the end of the prefix that
    ends before it (with the generation prompt) to the end of the prefix that includes
    it. Tokens are mapped to characters through the fast tokenizer's offsets, so
    merges across a boundary cannot shift the mask.
    """
    msgs = chat_messages(messages)
    full = tokenizer.apply_chat_template(msgs, tokenize=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(msgs[:i], tokenize=False,
                                               add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(msgs[: i + 1], tokenize=False)
        if not full.startswith(through) or not through.startswith(before):
            raise ValueError("the chat template does not render conversations prefix by "
                             "prefix; cannot locate assistant turns")
        # the whole turn, its end-of-turn marker included: the draft learns to stop
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [0] * len(ids)
    for index, (start, stop) in enumerate(encoded["offset_mapping"]):
        if any(start >= a and stop <= b and stop > start for a, b in spans):
            mask[index] = 1
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return Tokenized(ids, mask, truncated)


def require_file(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if not p.exists():
        fail(f"{what} {str(p)!r} does not exist")
    return p
