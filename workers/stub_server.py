"""An OpenAI-compatible server standing in for `vllm serve` where vLLM cannot run: it
serves a small local model for real with transformers and injects faults for tests.

  python -m workers.stub_server MODEL_DIR --port 8000 [--reasoning] [--fail-first N] ...

Endpoints: GET /health (503 while the model loads, then 200), GET /v1/models,
POST /v1/chat/completions (non-streaming: model, messages, max_tokens, temperature,
seed), GET /stats ({"requests", "in_flight", "max_in_flight", "failures_injected",
"errors_injected", "hangs_injected"}).

The HTTP server listens at once and loads the model in the background (slowed by
--load-delay), so a client sees what a loading vLLM gives it: no ready answer yet.
Generation runs in one worker thread, one request at a time (a 2-core machine).

Reasoning (--reasoning, or vLLM's --reasoning-parser NAME): the generated tokens are
split in two halves; the first half is returned as `reasoning_content`, the second as
`content`. A random tiny model has no trace to separate; this exercises the clients.

Faults, on chat completion number n (1-based, in order of arrival, the failed ones
counted): n <= --fail-first or n a multiple of --fail-every answers 500; n a multiple
of --hang-every answers nothing for --hang-s (longer than any client timeout; it ends
early when the client hangs up); --delay adds latency before generating. A request for
another model than the served one answers 404, like vLLM. vLLM options the stub does
not implement are accepted and ignored with a warning, so pipelines can pass them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from workers.common import fail, require_file, setup_logging

log = logging.getLogger("workers.stub_server")


@dataclass(frozen=True)
class Settings:
    model: Path
    served_model_name: str
    host: str
    port: int
    api_key: str | None
    max_model_len: int
    max_tokens_cap: int
    """Generated tokens per request at most; requests may ask for more (CPU time)."""
    reasoning: bool
    load_delay_s: float
    delay_s: float
    fail_first: int
    fail_every: int
    hang_every: int
    hang_s: float


@dataclass
class Stats:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    failures_injected: int = 0
    """errors_injected + hangs_injected."""
    errors_injected: int = 0
    hangs_injected: int = 0


class ClientError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Engine:
    """The model: loaded in a background thread, generating in one worker thread."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.lock = threading.Lock()
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self, server: Any) -> None:
        started = time.monotonic()
        try:
            time.sleep(self.settings.load_delay_s)
            import torch

            from workers.target import load_target, load_tokenizer

            self.torch = torch
            self.tokenizer = load_tokenizer(self.settings.model)
            self.model = load_target(self.settings.model, dtype=torch.float32).model
            eos = self.model.config.get_text_config(decoder=True).eos_token_id
            self.stop_ids = {self.tokenizer.eos_token_id, eos}
            self.complete([{"role": "user", "content": "warm up"}], 2, 0.0, None)
        except Exception as exc:  # any load failure ends the server
            self.load_error = repr(exc)
            log.error("cannot load %s: %r", self.settings.model, exc)
            server.should_exit = True
            return
        self.ready.set()
        log.info("model %s loaded in %.1f s", self.settings.model, time.monotonic() - started)

    def complete(self, messages: list[dict[str, Any]], max_tokens: int | None,
                 temperature: float | None, seed: int | None) -> dict[str, Any]:
        """Generate one answer: the OpenAI `choices[0]` and `usage`."""
        torch, tokenizer = self.torch, self.tokenizer
        with self.lock:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            room = self.settings.max_model_len - len(prompt_ids)
            wanted = room if max_tokens is None else max_tokens
            if room <= 0 or wanted > room:
                raise ClientError(400, (
                    f"This model's maximum context length is {self.settings.max_model_len} "
                    f"tokens. However, you requested {len(prompt_ids) + wanted} tokens "
                    f"({len(prompt_ids)} in the messages, {wanted} in the completion)."))
            options: dict[str, Any] = {"max_new_tokens": min(wanted, self.settings.max_tokens_cap),
                                       "pad_token_id": tokenizer.pad_token_id}
            temperature = 1.0 if temperature is None else temperature  # OpenAI's default
            options["do_sample"] = temperature > 0
            if temperature > 0:
                options["temperature"] = temperature
            if seed is not None:
                torch.manual_seed(seed)
            input_ids = torch.tensor([prompt_ids])
            with torch.inference_mode():
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                          **options)
            tokens = out[0, len(prompt_ids):].tolist()
        stop = next((i for i, t in enumerate(tokens) if t in self.stop_ids), None)
        kept = tokens if stop is None else tokens[:stop]
        message = {"role": "assistant"}
        if self.settings.reasoning:
            half = len(kept) // 2
            message["reasoning_content"] = tokenizer.decode(kept[:half], skip_special_tokens=True)
            kept = kept[half:]
        message["content"] = tokenizer.decode(kept, skip_special_tokens=True)
        completion_tokens = len(tokens) if stop is None else stop + 1
        return {"choice": {"index": 0, "message": message, "logprobs": None,
                           "finish_reason": "length" if stop is None else "stop"},
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    seed: int | None = None
    stream: bool = False


def create_app(settings: Settings, engine: Engine, stats: Stats) -> FastAPI:
    def error(status: int, message: str) -> JSONResponse:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                503: "ServiceUnavailableError"}.get(status, "InternalServerError")
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                            status_code=status)

    app = FastAPI(title="jobsup stub OpenAI server")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, str(exc.errors()))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, 200) if engine.ready.is_set() else error(503, "loading")

    @app.get("/stats")
    async def get_stats() -> dict[str, int]:
        return asdict(stats)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        if not engine.ready.is_set():
            return error(503, "the model is loading")
        return JSONResponse({"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "jobsup-stub", "root": str(settings.model),
            "max_model_len": settings.max_model_len}]})

    async def hang(raw: Request) -> None:
        deadline = time.monotonic() + settings.hang_s
        while time.monotonic() < deadline and not await raw.is_disconnected():
            await asyncio.sleep(0.1)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest, raw: Request) -> JSONResponse:
        stats.requests += 1
        number = stats.requests
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            if settings.api_key and raw.headers.get("authorization") != \
                    f"Bearer {settings.api_key}":
                return error(401, "invalid API key")
            if request.model not in (None, settings.served_model_name):
                return error(404, f"The model `{request.model}` does not exist.")
            if request.stream:
                return error(400, "the stub server does not stream")
            if number <= settings.fail_first or (settings.fail_every
                                                 and number % settings.fail_every == 0):
                stats.failures_injected += 1
                stats.errors_injected += 1
                return error(500, f"injected failure on request {number}")
            if settings.hang_every and number % settings.hang_every == 0:
                stats.failures_injected += 1
                stats.hangs_injected += 1
                await hang(raw)
                return error(500, f"injected hang on request {number} ended")
            if settings.delay_s:
                await asyncio.sleep(settings.delay_s)
            if not engine.ready.is_set():
                return error(503, "the model is loading")
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    engine.executor, engine.complete, messages,
                    request.max_completion_tokens or request.max_tokens, request.temperature,
                    request.seed)
            except ClientError as exc:
                return error(exc.status, str(exc))
            return JSONResponse({
                "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": settings.served_model_name,
                "choices": [result["choice"]], "usage": result["usage"]})
        finally:
            stats.in_flight -= 1

    return app


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m workers.stub_server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("model_tag", nargs="?", metavar="MODEL", help="local model directory (as vllm serve)")
    add("--model", help="the same, as a flag")
    add("--served-model-name", help="the name clients ask for (default: MODEL as given)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--api-key", help="require this bearer token")
    add("--max-model-len", type=int, default=4096, help="prompt + completion tokens at most")
    add("--max-tokens-cap", type=int, default=256, help="generated tokens per request at most")
    add("--reasoning", action="store_true", help="return half of each answer as its trace")
    add("--reasoning-parser", help="vLLM's option: any value turns --reasoning on")
    add("--load-delay", type=float, default=0.0, metavar="S", help="slow the model load")
    add("--delay", type=float, default=0.0, metavar="S", help="latency added per request")
    add("--fail-first", type=int, default=0, metavar="N", help="answer 500 to the first N")
    add("--fail-every", type=int, default=0, metavar="N", help="answer 500 to every Nth")
    add("--hang-every", type=int, default=0, metavar="N", help="never answer every Nth")
    add("--hang-s", type=float, default=3600.0, help="how long a hung request waits")
    add("-v", "--verbose", action="store_true")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, ignored = parse_args(argv)
    setup_logging(args.verbose)
    if args.model and args.model_tag and args.model != args.model_tag:
        fail(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model or args.model_tag
    if not model:
        fail("give the model directory: python -m workers.stub_server MODEL_DIR")
    require_file(model, "model directory")
    if ignored:
        log.warning("ignoring options the stub does not implement: %s", " ".join(ignored))
    settings = Settings(
        model=Path(model), served_model_name=args.served_model_name or model, host=args.host,
        port=args.port, api_key=args.api_key, max_model_len=args.max_model_len,
        max_tokens_cap=args.max_tokens_cap, reasoning=args.reasoning or bool(
            args.reasoning_parser), load_delay_s=args.load_delay, delay_s=args.delay,
        fail_first=args.fail_first, fail_every=args.fail_every, hang_every=args.hang_every,
        hang_s=args.hang_s)
    import uvicorn

    engine = Engine(settings)
    app = create_app(settings, engine, Stats())
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    threading.Thread(target=engine.load, args=(server,), daemon=True).start()
    log.info("serving %s as %r on http://%s:%d/v1", settings.model,
             settings.served_model_name, settings.host, settings.port)
    server.run()
    engine.executor.shutdown(wait=False, cancel_futures=True)
    if engine.load_error:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
