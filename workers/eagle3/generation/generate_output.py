"""What a generation run writes: the records (a prompt in, the model's answer out, one
conversation per line), the append-only output file, and the run's counters.

The output may be killed at any moment: each record is appended with one write of one
complete line, and reopening the file cuts away a line torn by a crash and collects the
ids already written, so a rerun skips them. Both backends
(`workers.eagle3.generation.openai_backend` and the transformers one in `workers.generate`) write
through this module.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.common import ProgressReporter, fail

log = logging.getLogger("workers.generate")  # one log for the whole generate worker

FSYNC_INTERVAL_S = 2.0
"""What a power loss may cost; a killed process loses nothing (the page cache keeps it)."""
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class Answer:
    content: str
    reasoning_content: str | None
    finish_reason: str | None
    usage: dict[str, Any] | None


class RunError(Exception):
    """Ends the run with `exit_code` and this message."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def encode_line(record: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a server: escape it, stay valid
        return (json.dumps(record) + "\n").encode("ascii")


class OutputFile:
    """The conversations JSONL, opened for appending complete lines.

    Opening takes an exclusive lock (two generators on one file would duplicate work),
    cuts away a last line with no newline (a crash mid-write) and collects the ids
    already written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            fail(f"{path} is being written by another generator")
        self.done_ids = self._recover()
        self._last_fsync = time.monotonic()

    def _recover(self) -> set[str]:
        ids: set[str] = set()
        complete_bytes = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.endswith(b"\n"):
                    break
                complete_bytes += len(line)
                try:
                    ids.add(str(json.loads(line)["id"]))
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: line %d is not a record; its prompt will be redone",
                                self.path, number)
        size = os.fstat(self.fd).st_size
        if size > complete_bytes:
            log.warning("%s: cutting a torn last line (%d bytes, an interrupted write)",
                        self.path, size - complete_bytes)
            os.ftruncate(self.fd, complete_bytes)
            os.fsync(self.fd)
        return ids

    def append(self, record: dict[str, Any]) -> None:
        line = encode_line(record)
        try:
            written = os.write(self.fd, line)  # one write on O_APPEND: a whole line lands
            if written != len(line):
                raise OSError(f"short write ({written} of {len(line)} bytes)")
            if time.monotonic() - self._last_fsync >= FSYNC_INTERVAL_S:
                os.fsync(self.fd)
                self._last_fsync = time.monotonic()
        except OSError as exc:
            raise RunError(f"cannot write {self.path}: {exc}", 3) from None

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def make_record(prompt: Prompt, answer: Answer, backend: str) -> dict[str, Any]:
    reply = {"role": "assistant", "content": answer.content,
             "reasoning_content": answer.reasoning_content}
    return {"id": prompt.id, "messages": [*prompt.messages, reply],
            "finish_reason": answer.finish_reason, "usage": answer.usage, "backend": backend}


@dataclass
class RunState:
    """Counters of one run, reported to the progress file and the log."""

    total: int
    done: int
    """Records in the output, earlier runs included."""
    max_consecutive_failures: int
    reporter: ProgressReporter
    failed_ids: list[str] = field(default_factory=list)
    consecutive_failures: int = 0
    completion_tokens: int = 0
    requests_in_flight: int = 0
    graph_fallback: bool = False
    """The static decoder gave up CUDA graphs (a capture failed or a replay differed):
    the run decodes step by step, several times slower (metric `graph_fallback`)."""
    written_this_run: int = 0
    started: float = field(default_factory=time.monotonic)
    last_log: float = field(default_factory=time.monotonic)

    def succeeded(self, answer: Answer) -> None:
        self.done += 1
        self.written_this_run += 1
        self.consecutive_failures = 0
        tokens = (answer.usage or {}).get("completion_tokens")
        if isinstance(tokens, int):
            self.completion_tokens += tokens
        self.tick()

    def failed(self, prompt_id: str, error: str) -> None:
        self.failed_ids.append(prompt_id)
        self.consecutive_failures += 1
        log.warning("prompt %s failed: %s", prompt_id, error)
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise RunError(f"aborting: {self.consecutive_failures} prompts in a row failed "
                           f"(last error: {error}); {self.done}/{self.total} written, "
                           "rerun to resume", 3)
        self.tick()

    def tick(self, *, force: bool = False) -> None:
        elapsed_s = max(time.monotonic() - self.started, 1e-9)
        tokens_per_s = self.completion_tokens / elapsed_s
        self.reporter.update(self.done, {"failed": len(self.failed_ids),
                                         "tokens_per_s": tokens_per_s,
                                         "requests_in_flight": self.requests_in_flight,
                                         "graph_fallback": float(self.graph_fallback)},
                             force=force)
        if force or time.monotonic() - self.last_log >= LOG_INTERVAL_S:
            self.last_log = time.monotonic()
            log.info("%d/%d prompts written (%.2f prompts/s, %.0f tokens/s), %d failed, "
                     "%d in flight", self.done, self.total, self.written_this_run / elapsed_s,
                     tokens_per_s, len(self.failed_ids), self.requests_in_flight)
