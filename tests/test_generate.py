"""workers.generate against real processes: the stub OpenAI server (a tiny random Llama
served for real over loopback HTTP) with injected faults, kill -9 and resume, and the
local transformers backend."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import PY, REPO, free_port, wait_for, worker_env
from workers.openai_backend import backoff_s, parse_answer, parse_retry_after
from workers.tiny import build_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


class StubServer:
    """`python -m workers.stub_server` as a child process of the test."""

    def __init__(self, model: Path, log_path: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"{self.url}/v1"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PY, "-m", "workers.stub_server", str(model), "--port", str(self.port),
                 *flags], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=worker_env())

    def wait_ready(self, timeout: float = 60) -> StubServer:
        wait_for(self._ready, timeout, interval=0.2, what=f"stub server; log:\n{self.log()}")
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"stub server exited {self.proc.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def stats(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/stats", timeout=5).json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def stub(tiny: Path, tmp_path: Path) -> Iterator[Callable[..., StubServer]]:
    servers: list[StubServer] = []

    def start(*flags: str, wait: bool = True) -> StubServer:
        server = StubServer(tiny, tmp_path / f"stub{len(servers)}.log", *flags)
        servers.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in servers:
        server.stop()


def write_prompts(path: Path, count: int, extra_lines: tuple[str, ...] = ()) -> list[str]:
    ids = [f"p-{i:03d}" for i in range(count)]
    with open(path, "w") as f:
        for i, prompt_id in enumerate(ids):
            messages: list[dict[str, str]] = [{"role": "user", "content": f"Question {i}: why?"}]
            if i % 3 == 0:
                messages.insert(0, {"role": "system", "content": "Be brief."})
            f.write(json.dumps({"id": prompt_id, "messages": messages}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return ids


def generate_cmd(*args: str | Path) -> list[str]:
    return [PY, "-m", "workers.generate", *map(str, args)]


def generate(*args: str | Path, env: dict[str, str] | None = None,
             timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(generate_cmd(*args), capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=worker_env(**(env or {})))


def records(path: Path) -> list[dict[str, Any]]:
    """Every line of the output, each of which must be a complete JSON record."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), "the output ends in a torn line"
    return [json.loads(line) for line in text.splitlines()]


def openai_args(server: StubServer, prompts: Path, out: Path, *more: str) -> list[str | Path]:
    return ["--prompts", prompts, "--out", out, "--endpoint", server.endpoint,
            "--max-tokens", "8", "--temperature", "0", "--retry-backoff", "0.05", *more]


# -- openai backend -------------------------------------------------------------------------

def test_every_prompt_lands_within_the_concurrency_bound(stub: Callable[..., StubServer],
                                                         tmp_path: Path) -> None:
    server = stub("--delay", "0.3", "--reasoning")
    prompts, out, progress = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "pr.json"
    ids = write_prompts(prompts, 12)
    result = generate(*openai_args(server, prompts, out, "--concurrency", "3"),
                      env={"JOBSUP_PROGRESS_FILE": str(progress)})
    assert result.returncode == 0, result.stderr
    written = records(out)
    assert sorted(r["id"] for r in written) == ids
    for record in written:
        *asked, answer = record["messages"]
        assert asked[-1]["content"].startswith("Question ")
        assert answer["role"] == "assistant" and answer["content"]
        assert isinstance(answer["reasoning_content"], str)  # the stub's --reasoning
        assert record["backend"] == "openai" and record["finish_reason"] in ("stop", "length")
        assert 0 < record["usage"]["completion_tokens"] <= 8
    stats = server.stats()
    assert stats["requests"] == 12
    assert stats["max_in_flight"] == 3
    report = json.loads(progress.read_text())
    assert (report["done"], report["total"], report["unit"]) == (12, 12, "prompt")
    assert report["metrics"]["failed"] == 0 and report["metrics"]["tokens_per_s"] > 0
    assert report["metrics"]["requests_in_flight"] == 0


def test_server_errors_and_timeouts_are_retried(stub: Callable[..., StubServer],
                                               tmp_path: Path) -> None:
    server = stub("--fail-first", "2", "--hang-every", "3")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    ids = write_prompts(prompts, 6)
    result = generate(*openai_args(server, prompts, out, "--concurrency", "2", "--timeout", "1",
                                   "--retries", "6"))
    assert result.returncode == 0, result.stderr
    assert sorted(r["id"] for r in records(out)) == ids
    stats = server.stats()
    assert stats["errors_injected"] == 2 and stats["hangs_injected"] >= 1
    assert stats["requests"] >= 6 + stats["failures_injected"]  # more if a slow answer timed out
    assert "HTTP 500" in result.stderr and "no answer within 1 s" in result.stderr


def test_resume_after_kill_9(stub: Callable[..., StubServer], tmp_path: Path) -> None:
    # the generator starts while the server still loads: --wait-for-server bridges it
    server = stub("--delay", "0.2", "--load-delay", "1", wait=False)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    ids = write_prompts(prompts, 16)
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(
            generate_cmd(*openai_args(server, prompts, out, "--concurrency", "2",
                                      "--wait-for-server", "60")),
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 4, 60,
                 what="some records written")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    assert "is ready after" in (tmp_path / "first.log").read_text()
    done_before = {r["id"] for r in records(out)}
    assert 4 <= len(done_before) < 16
    missing = sorted(set(ids) - done_before)
    with open(out, "a") as f:  # a crash in the middle of a write
        f.write(json.dumps({"id": missing[0], "messages": []})[:25])
    requests_before = server.stats()["requests"]

    result = generate(*openai_args(server, prompts, out, "--concurrency", "4"))
    assert result.returncode == 0, result.stderr
    assert "torn last line" in result.stderr
    written = [r["id"] for r in records(out)]
    assert sorted(written) == ids  # each id exactly once
    assert server.stats()["requests"] - requests_before == len(missing)

    again = generate(*openai_args(server, prompts, out))  # nothing left to do
    assert again.returncode == 0, again.stderr
    assert len(records(out)) == 16


def test_consecutive_failures_abort_with_exit_3(tmp_path: Path) -> None:
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    write_prompts(prompts, 10)
    started = time.monotonic()
    result = generate("--prompts", prompts, "--out", out, "--model", "m",
                      "--endpoint", f"http://127.0.0.1:{free_port()}/v1", "--retries", "1",
                      "--retry-backoff", "0.01", "--max-consecutive-failures", "3",
                      "--concurrency", "2")
    assert result.returncode == 3, result.stderr
    assert "error: aborting: 3 prompts in a row failed" in result.stderr
    assert "connection error" in result.stderr and "Traceback" not in result.stderr
    assert records(out) == []
    assert time.monotonic() - started < 20


def test_client_errors_are_not_retried(stub: Callable[..., StubServer], tmp_path: Path) -> None:
    server = stub()
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    write_prompts(prompts, 3)
    result = generate(*openai_args(server, prompts, out, "--model", "no-such-model",
                                   "--retries", "4"))
    assert result.returncode == 1, result.stderr
    assert "error: 3 prompts failed permanently: p-000, p-001, p-002" in result.stderr
    assert "HTTP 404" in result.stderr and "does not exist" in result.stderr
    assert server.stats()["requests"] == 3  # one each, no retry
    assert records(out) == []


# -- transformers backend -------------------------------------------------------------------

def test_transformers_backend_batches_and_skips_bad_lines(tiny: Path, tmp_path: Path) -> None:
    prompts, out, progress = tmp_path / "p.jsonl", tmp_path / "out.jsonl", tmp_path / "pr.json"
    ids = write_prompts(prompts, 5, extra_lines=(
        '{"id": "torn", "messages": [',  # line 6: not JSON
        '{"id": "p-001", "messages": [{"role": "user", "content": "again"}]}',  # duplicate
        '{"id": "no-content", "messages": [{"role": "user"}]}',  # line 8
    ))
    result = generate("--backend", "transformers", "--model", tiny, "--prompts", prompts,
                      "--out", out, "--batch-size", "2", "--max-tokens", "6", "--device", "cpu",
                      env={"JOBSUP_PROGRESS_FILE": str(progress)})
    assert result.returncode == 0, result.stderr
    assert "malformed line 6" in result.stderr and "malformed line 8" in result.stderr
    assert "skipped 2 malformed prompt lines: 6, 8" in result.stderr
    assert "line 7 repeats id 'p-001'" in result.stderr
    written = records(out)
    assert sorted(r["id"] for r in written) == ids
    for record in written:
        answer = record["messages"][-1]
        assert answer["role"] == "assistant" and answer["reasoning_content"] is None
        assert record["backend"] == "transformers"
        assert 0 < record["usage"]["completion_tokens"] <= 6
        assert record["messages"][-2]["content"] != "again"
    assert json.loads(progress.read_text())["done"] == 5


def test_transformers_missing_model_is_a_usage_error(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    write_prompts(prompts, 2)
    result = generate("--backend", "transformers", "--model", tmp_path / "nope",
                      "--prompts", prompts, "--out", tmp_path / "out.jsonl")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "nope" in result.stderr
    assert "Traceback" not in result.stderr


# -- pure parts -----------------------------------------------------------------------------

def test_answer_parsing_keeps_either_reasoning_field() -> None:
    def completion(**message: Any) -> dict[str, Any]:
        return {"choices": [{"message": {"role": "assistant", **message},
                             "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}

    vllm_old = parse_answer(completion(content="4", reasoning_content="2+2"))
    vllm_new = parse_answer(completion(content="4", reasoning="2+2"))
    assert vllm_old == vllm_new
    assert (vllm_old.content, vllm_old.reasoning_content) == ("4", "2+2")
    plain = parse_answer(completion(content=None))
    assert (plain.content, plain.reasoning_content, plain.finish_reason) == ("", None, "stop")
    with pytest.raises(KeyError):
        parse_answer({"object": "error"})


def test_retry_after_and_backoff() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("7", now) == 7.0
    assert parse_retry_after(None, now) is None and parse_retry_after("soon", now) is None
    http_date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 30))
    assert parse_retry_after(http_date, now) == pytest.approx(30, abs=1)
    for attempt in range(8):
        assert min(60, 2**attempt) / 2 <= backoff_s(attempt, 1.0, None) <= min(60, 2**attempt)
    assert backoff_s(0, 1.0, 12.0) == 12.0
    assert backoff_s(0, 1.0, 10_000.0) == 600.0
