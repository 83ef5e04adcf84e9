"""The `openai` backend of generation: a concurrent client of an OpenAI-compatible
server (`vllm serve`, SGLang), `--concurrency` requests at a time.

It owns everything HTTP: reading a chat completion (and the reasoning trace, under
either name the servers use), retries with jittered exponential backoff that honour
Retry-After, waiting for a server still loading its model, and asking it which model it
serves. Kept apart from `workers.generate` (the command line and the local backend) so
each stays one readable stage; records go through `workers.eagle3.generation.generate_output`.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import logging
import os
import random
import time
from typing import Any

from workers.eagle3.generation.generate_output import (
    LOG_INTERVAL_S,
    Answer,
    OutputFile,
    Prompt,
    RunError,
    RunState,
    make_record,
)

log = logging.getLogger("workers.generate")  # one log for the whole generate worker

MAX_BACKOFF_S = 60.0
MAX_RETRY_AFTER_S = 600.0
"""A server asking for a longer pause than this is not waited on that long."""


class PromptFailed(Exception):
    """One attempt at one prompt failed; `retryable` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool, retry_after_s: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s


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
