"""Synthetic data generation: the target model answers each prompt; its answer (and the
reasoning trace, where the server returns one) is kept as one conversation per line.

  python -m workers.generate --prompts prompts.jsonl --out conversations.jsonl \\
      --backend openai --endpoint http://127.0.0.1:8000/v1 --concurrency 64

Backends: `openai` is a concurrent client of an OpenAI-compatible server (`vllm serve`,
SGLang) with retries and backoff; `transformers` generates locally in batches (small
models, tests). The output may be killed at any moment: each record is appended with one
write of one complete line, and a rerun cuts away a line torn by a crash and skips the
ids already written.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import fcntl
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.common import (
    JsonlStats,
    ProgressReporter,
    fail,
    read_jsonl,
    require_file,
    setup_logging,
)

log = logging.getLogger("workers.generate")

EXIT_CODES = """exit codes:
  0  every prompt is in the output
  1  some prompts failed permanently (rerun to retry them)
  2  usage error (missing file, bad flag, model that cannot be loaded)
  3  aborted: K prompts in a row failed, the server never answered, or the output
     cannot be written"""
FSYNC_INTERVAL_S = 2.0
"""What a power loss may cost; a killed process loses nothing (the page cache keeps it)."""
LOG_INTERVAL_S = 10.0
MAX_BACKOFF_S = 60.0
MAX_RETRY_AFTER_S = 600.0
"""A server asking for a longer pause than this is not waited on that long."""
DEFAULT_MAX_NEW_TOKENS = 1024
"""transformers backend, when --max-tokens is not given (a server picks its own)."""


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


class PromptFailed(Exception):
    """One attempt at one prompt failed; `retryable` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool, retry_after_s: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s


class RunError(Exception):
    """Ends the run with `exit_code` and this message."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# -- input and output -----------------------------------------------------------------------

def prompt_problem(record: dict[str, Any]) -> str | None:
    if not isinstance(record["id"], str) or not record["id"]:
        return "id must be a non-empty string"
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return "every message needs a string role and content"
    return None


def load_prompts(path: Path, limit: int | None) -> tuple[list[Prompt], list[int]]:
    """Valid prompts in file order (a repeated id keeps its first line), and the line
    numbers of the malformed lines skipped."""
    stats = JsonlStats()
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, record in read_jsonl(path, stats, required=("id", "messages")):
        problem = prompt_problem(record)
        if problem:
            stats.malformed.append(number)
            log.warning("%s: skipping malformed line %d: %s", path, number, problem)
        elif record["id"] in seen:
            log.warning("%s: line %d repeats id %r; keeping the first", path, number,
                        record["id"])
        else:
            seen.add(record["id"])
            prompts.append(Prompt(record["id"], record["messages"]))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts, stats.malformed


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
                                         "requests_in_flight": self.requests_in_flight},
                             force=force)
        if force or time.monotonic() - self.last_log >= LOG_INTERVAL_S:
            self.last_log = time.monotonic()
            log.info("%d/%d prompts written (%.2f prompts/s, %.0f tokens/s), %d failed, "
                     "%d in flight", self.done, self.total, self.written_this_run / elapsed_s,
                     tokens_per_s, len(self.failed_ids), self.requests_in_flight)


# -- openai backend -------------------------------------------------------------------------

def parse_answer(data: Any) -> Answer:
    """An OpenAI chat completion; vLLM and SGLang reasoning parsers put the trace in
    `reasoning_content` (older) or `reasoning` (newer)."""
    choice = data["choices"][0]
    message = choice["message"]
    reasoning = message.get("reasoning_content") or message.get("reasoning") or None
    usage = data.get("usage")
    return Answer(content=message.get("content") or "", reasoning_content=reasoning,
                  finish_reason=choice.get("finish_reason"),
                  usage=usage if isinstance(usage, dict) else None)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Retry-After in seconds, or as an HTTP date; `now` is the wall clock (time.time())."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now) if when.tzinfo else None


def backoff_s(attempt: int, base_s: float, retry_after_s: float | None) -> float:
    """Exponential backoff with jitter (clients that failed together do not retry
    together), never shorter than what the server asked for."""
    exponential_s = min(MAX_BACKOFF_S, base_s * 2**attempt)
    delay_s = random.uniform(exponential_s / 2, exponential_s)
    if retry_after_s is not None:
        delay_s = max(delay_s, min(retry_after_s, MAX_RETRY_AFTER_S))
    return delay_s


def error_detail(response: Any) -> str:
    try:
        body = response.json()
        error = body.get("error", body)
        message = error.get("message") if isinstance(error, dict) else error
        return str(message)[:300]
    except (ValueError, AttributeError):
        return response.text[:300]


async def ask(client: Any, body: dict[str, Any], timeout_s: float) -> Answer:
    import httpx

    try:
        async with asyncio.timeout(timeout_s):
            response = await client.post("chat/completions", json=body)
    except (TimeoutError, httpx.TimeoutException):
        raise PromptFailed(f"no answer within {timeout_s:g} s", retryable=True) from None
    except httpx.TransportError as exc:
        raise PromptFailed(f"connection error: {exc!r}", retryable=True) from None
    status = response.status_code
    if status == 200:
        try:
            return parse_answer(response.json())
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise PromptFailed(f"malformed answer ({exc!r}): {response.text[:200]}",
                               retryable=True) from None
    retryable = status in (408, 429) or status >= 500
    retry_after_s = parse_retry_after(response.headers.get("retry-after"), time.time())
    raise PromptFailed(f"HTTP {status}: {error_detail(response)}", retryable=retryable,
                       retry_after_s=retry_after_s)


async def ask_with_retries(client: Any, prompt: Prompt, body: dict[str, Any],
                           args: argparse.Namespace, state: RunState) -> Answer:
    attempt = 0
    while True:
        state.requests_in_flight += 1
        try:
            return await ask(client, body, args.timeout)
        except PromptFailed as exc:
            if not exc.retryable or attempt >= args.retries:
                raise
            delay_s = backoff_s(attempt, args.retry_backoff, exc.retry_after_s)
            log.info("prompt %s: %s; retry %d/%d in %.1f s", prompt.id, exc, attempt + 1,
                     args.retries, delay_s)
        finally:
            state.requests_in_flight -= 1
        attempt += 1
        await asyncio.sleep(delay_s)


async def wait_for_server(client: Any, endpoint: str, wait_s: float) -> None:
    """Poll `{endpoint}/models` and the server's `/health` until one answers 200: a
    server loading a large model takes minutes before it listens or is ready."""
    import httpx

    health_url = endpoint.rstrip("/").removesuffix("/v1") + "/health"
    started = last_log = time.monotonic()
    while True:
        for url in ("models", health_url):
            try:
                if (await client.get(url, timeout=5)).status_code == 200:
                    log.info("server at %s is ready after %.0f s", endpoint,
                             time.monotonic() - started)
                    return
            except httpx.TransportError:
                pass
        if time.monotonic() - started >= wait_s:
            raise RunError(f"the server at {endpoint} did not answer within {wait_s:g} s", 3)
        if time.monotonic() - last_log >= LOG_INTERVAL_S:
            last_log = time.monotonic()
            log.info("waiting for the server at %s (%.0f s of %g s)", endpoint,
                     last_log - started, wait_s)
        await asyncio.sleep(1.0)


async def served_model(client: Any, endpoint: str) -> str:
    import httpx

    try:
        response = await client.get("models", timeout=10)
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RunError(f"--model not given and {endpoint}/models names none ({exc!r})",
                       2) from None


async def run_openai(args: argparse.Namespace, prompts: list[Prompt], output: OutputFile,
                     state: RunState) -> None:
    import httpx

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.endpoint, headers=headers, limits=limits,
                                 timeout=args.timeout) as client:
        if args.wait_for_server > 0:
            await wait_for_server(client, args.endpoint, args.wait_for_server)
        model = args.model or await served_model(client, args.endpoint)
        log.info("asking %s at %s, %d requests at a time", model, args.endpoint,
                 args.concurrency)
        state.started = time.monotonic()  # rates count generation, not waiting
        pending = iter(prompts)

        async def worker() -> None:
            # `concurrency` of these pull from one iterator: the bound is exact
            for prompt in pending:
                body: dict[str, Any] = {"model": model, "messages": prompt.messages}
                if args.max_tokens is not None:
                    body["max_tokens"] = args.max_tokens
                if args.temperature is not None:
                    body["temperature"] = args.temperature
                try:
                    answer = await ask_with_retries(client, prompt, body, args, state)
                except PromptFailed as exc:
                    state.failed(prompt.id, str(exc))
                    continue
                output.append(make_record(prompt, answer, "openai"))
                state.succeeded(answer)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                state.tick()

        tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        tasks.append(asyncio.create_task(ticker()))
        try:
            await asyncio.gather(*tasks[:-1])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- transformers backend -------------------------------------------------------------------

def run_transformers(args: argparse.Namespace, prompts: list[Prompt], output: OutputFile,
                     state: RunState) -> None:
    log.info("loading %s", args.model)
    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").to(device)
    except (OSError, ValueError) as exc:
        raise RunError(f"cannot load a model from {args.model}: {exc}", 2) from None
    if not tokenizer.chat_template:
        raise RunError(f"the tokenizer in {args.model} has no chat template", 2)
    log.info("model loaded on %s in %.1f s", device, time.monotonic() - started)
    state.started = time.monotonic()  # rates count generation, not loading
    model.eval()
    tokenizer.padding_side = "left"  # new tokens follow every prompt directly
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stop_ids = set(eos) if isinstance(eos, list) else {eos}
    options: dict[str, Any] = {"max_new_tokens": args.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                               "pad_token_id": tokenizer.pad_token_id}
    if args.temperature is not None:
        options["do_sample"] = args.temperature > 0
        if args.temperature > 0:
            options["temperature"] = args.temperature

    def generate(batch: list[Prompt]) -> list[Answer]:
        texts = [tokenizer.apply_chat_template(p.messages, tokenize=False,
                                               add_generation_prompt=True) for p in batch]
        encoded = tokenizer(texts, return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
        with torch.inference_mode():
            out = model.generate(**encoded, **options)
        answers = []
        prompt_lengths = encoded["attention_mask"].sum(dim=1).tolist()
        for tokens, prompt_tokens in zip(out[:, encoded["input_ids"].shape[1]:].tolist(),
                                         prompt_lengths, strict=True):
            stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
            kept = tokens if stop is None else tokens[:stop]
            completion_tokens = len(tokens) if stop is None else stop + 1
            answers.append(Answer(
                tokenizer.decode(kept, skip_special_tokens=True), None,
                "length" if stop is None else "stop",
                {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}))
        return answers

    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        state.requests_in_flight = len(batch)
        try:
            results: list[tuple[Prompt, Answer | Exception]] = list(
                zip(batch, generate(batch), strict=True))
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory on a long batch
            log.warning("a batch of %d failed (%s); trying its prompts one by one",
                        len(batch), exc)
            results = []
            for prompt in batch:
                try:
                    results.append((prompt, generate([prompt])[0]))
                except (RuntimeError, ValueError) as one_exc:
                    results.append((prompt, one_exc))
        state.requests_in_flight = 0
        for prompt, result in results:
            if isinstance(result, Exception):
                state.failed(prompt.id, repr(result))
            else:
                output.append(make_record(prompt, result, "transformers"))
                state.succeeded(result)


# -- command line ---------------------------------------------------------------------------

def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workers.generate", description=__doc__, epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--prompts", required=True, help='JSONL: {"id": str, "messages": [{role, content}]}')
    add("--out", required=True, type=Path, help="conversations JSONL (appended; rerun resumes)")
    add("--backend", choices=["openai", "transformers"], default="openai")
    add("--model", help="openai: served model name (default: the first of /models); "
                        "transformers: local model directory")
    add("--endpoint", default="http://127.0.0.1:8000/v1", help="openai: base URL")
    add("--api-key", help="openai: bearer token (default: $OPENAI_API_KEY)")
    add("--concurrency", type=positive(int), default=16, help="openai: requests at a time")
    add("--max-tokens", type=positive(int), help="per answer (default: the server's; "
                                                 f"transformers: {DEFAULT_MAX_NEW_TOKENS})")
    add("--temperature", type=float, help="default: the server's / the model's")
    add("--timeout", type=positive(float), default=600.0, help="seconds per request")
    add("--retries", type=int, default=5, help="retries per request on 5xx, 429, timeouts "
                                               "and connection errors (not on other 4xx)")
    add("--retry-backoff", type=positive(float), default=1.0,
        help="seconds before the first retry, doubled for each next one, with jitter")
    add("--max-consecutive-failures", type=positive(int), default=20, metavar="K",
        help="abort (exit 3) after K prompts in a row failed all their retries")
    add("--batch-size", type=positive(int), default=8, help="transformers: prompts per batch")
    add("--device", help="transformers: torch device (default: cuda if available, else cpu)")
    add("--limit", type=positive(int), help="only the first N valid prompts")
    add("--wait-for-server", type=float, default=0.0, metavar="SECONDS",
        help="openai: wait up to SECONDS for the server to answer before starting")
    add("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.retries < 0:
        parser.error("--retries must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if not args.verbose:  # one line per request is too many at 100k prompts
        logging.getLogger("httpx").setLevel(logging.WARNING)
    prompts_path = require_file(args.prompts, "prompts file")
    if args.backend == "transformers":
        if not args.model:
            fail("--backend transformers needs --model PATH, a local model directory")
        require_file(args.model, "model directory")
    prompts, malformed = load_prompts(prompts_path, args.limit)
    output = OutputFile(args.out)
    todo = [p for p in prompts if p.id not in output.done_ids]
    log.info("%d prompts: %d already in %s, %d to generate; %d malformed lines skipped",
             len(prompts), len(prompts) - len(todo), args.out, len(todo), len(malformed))
    state = RunState(total=len(prompts), done=len(prompts) - len(todo),
                     max_consecutive_failures=args.max_consecutive_failures,
                     reporter=ProgressReporter(total=len(prompts), unit="prompt"))
    error: RunError | None = None
    try:
        if todo and args.backend == "openai":
            asyncio.run(run_openai(args, todo, output, state))
        elif todo:
            run_transformers(args, todo, output, state)
    except RunError as exc:
        error = exc
    except KeyboardInterrupt:
        error = RunError("interrupted; rerun to resume", 130)
    finally:
        output.close()
        state.tick(force=True)
    if malformed:
        shown = ", ".join(map(str, malformed[:10])) + (", ..." if len(malformed) > 10 else "")
        log.warning("skipped %d malformed prompt lines: %s", len(malformed), shown)
    if error is not None:
        fail(str(error), error.exit_code)
    if state.failed_ids:
        position = {p.id: i for i, p in enumerate(prompts)}
        failed = sorted(state.failed_ids, key=position.__getitem__)
        shown = ", ".join(failed[:10]) + (", ..." if len(failed) > 10 else "")
        fail(f"{len(state.failed_ids)} prompts failed permanently: {shown} (rerun to retry "
             "them)", 1)
    log.info("done: %d/%d prompts in %s", state.done, state.total, args.out)


if __name__ == "__main__":
    main()
