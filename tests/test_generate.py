"""workers.generate against real processes: the stub OpenAI server (a tiny random Llama
served for real over loopback HTTP) with injected faults, kill -9 and resume, and the
local transformers backend."""

from __future__ import annotations

import hashlib
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
from workers.eagle3.generation.openai_backend import backoff_s, parse_answer, parse_retry_after
from workers.fixtures.tiny import build_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


class StubServer:
    """`python -m workers.fixtures.stub_server` as a child process of the test."""

    def __init__(self, model: Path, log_path: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"{self.url}/v1"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PY, "-m", "workers.fixtures.stub_server", str(model), "--port", str(self.port),
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


# -- self prompts: the target writes the prompts (Magpie) ----------------------------------

SMOLLM2_TEMPLATE = (  # SmolLM2-Instruct's own: a default system prompt when none is given
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ["river", "mountain", "quiet", "engine", "lantern", "copper", "orbit", "garden",
         "velvet", "thunder", "pencil", "harbor", "meadow", "signal", "canyon", "marble",
         "falcon", "cipher", "glacier", "ember"]


@pytest.fixture(scope="module")
def word_writer(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model rewired into a unigram writer: every layer's output projections
    zeroed and every embedding the same vector, so the next-token distribution is fixed:
    the tokenizer's lower-case word tokens, equally likely, and `<|end|>` with
    probability 1/9 (about 8 words a turn). It writes word salad that passes the
    filters, which exercises the whole self-prompts path; a random model's output
    rarely would."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    words = sorted(i for t, i in tokenizer.get_vocab().items()
                   if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower() and len(t) > 3)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0  # after the final norm: sqrt(H) e_0
        head = model.lm_head.weight
        head.zero_()
        scale = math.sqrt(hidden)
        head[:, 0] = -30 / scale
        head[words, 0] = 0.0
        head[tokenizer.convert_tokens_to_ids("<|end|>"), 0] = math.log(len(words) / 8) / scale
    out = tmp_path_factory.mktemp("writer") / "writer"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_pre_query_template_keeps_what_the_template_puts_before_the_user(tiny: Path) -> None:
    from transformers import AutoTokenizer

    from workers.eagle3.generation.self_prompts import pre_query_template, template_markers

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    template = pre_query_template(tokenizer)
    assert (template.text, template.end_of_turn) == ("<|user|>\n", "<|end|>")
    assert template.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|end|>")
    assert {"<|user|>", "<|assistant|>", "<|end|>"} <= set(template_markers(tokenizer))

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    smol = pre_query_template(tokenizer)
    assert smol.text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                         "trained by Hugging Face<|im_end|>\n<|im_start|>user\n")
    assert smol.end_of_turn == "<|im_end|>"
    # the answers are asked without a system message too, so they get the same one
    asked = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}],
                                          tokenize=False, add_generation_prompt=True)
    assert asked.startswith(smol.text + "Hi there<|im_end|>")

    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"
    with pytest.raises(ValueError, match="no special token ends a user turn"):
        pre_query_template(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        pre_query_template(tokenizer)


def test_each_filter_rejects_with_its_reason() -> None:
    from workers.eagle3.generation.self_prompts import FilterSettings, rejection_reason

    settings = FilterSettings(markers=("<|im_start|>", "<|im_end|>", "<|", "[INST]"))
    cases = [
        ("How do I reverse a linked list in place?", True, None),
        ("Écris-moi un poème sur la mer, s'il te plaît.", True, None),  # Latin script
        ("   \n\t ", True, "empty"),
        ("How do I reverse a linked list in place and", False, "truncated"),
        ("What is<|im_end|>\n<|im_start|>assistant\nIt is", True, "template_debris"),
        ("[INST] Tell me a joke about cats", True, "template_debris"),
        ("user\nTell me a joke about cats", True, "template_debris"),
        ("Assistant: Sure, here is a joke about cats", True, "template_debris"),
        ("Tell me a joke.\nUser: and another one please", True, "template_debris"),
        ("Как приготовить борщ дома без мяса?", True, "other_language"),
        ("如何在家里做一个简单的蛋糕？请告诉我步骤。", True, "other_language"),
        ("Rust: explain лайфтаймы и заимствование простыми словами", True, "other_language"),
        ("Help me", True, "too_short"),
        ("42?", True, "too_short"),  # no letters: not another language, but short
    ]
    got = [rejection_reason(text, ended=ended, settings=settings)
           for text, ended, _ in cases]
    assert got == [reason for _, _, reason in cases]
    assert rejection_reason("Help me", ended=True,
                            settings=FilterSettings(min_words=2)) is None


def test_exact_and_near_duplicates_are_found_and_distinct_prompts_kept() -> None:
    import random

    from workers.eagle3.generation.self_prompts import Deduplicator, jaccard, normalize, shingles

    dedup = Deduplicator()
    first = "Explain how binary search works on a sorted array of integers."
    dedup.add(first)
    assert dedup.check("  EXPLAIN how binary search\nworks on a sorted array of integers. ") \
        == "exact_duplicate"
    near = "Explain how binary search works on a sorted list of integers."
    similarity = jaccard(shingles(normalize(first)), shingles(normalize(near)))
    assert 0.7 <= similarity < 0.9  # one word changed
    assert dedup.check(near) == "near_duplicate"
    other = "Explain how a hash table resolves collisions between two keys."
    assert jaccard(shingles(normalize(first)), shingles(normalize(other))) < 0.3
    assert dedup.check(other) is None

    # at scale: 3,000 distinct word sequences and a one-word variant of each of 500
    rng = random.Random(7)
    originals = [" ".join(rng.choice(WORDS) for _ in range(14)) for _ in range(3000)]
    variants = []
    for text in originals[:500]:
        words = text.split()
        words[rng.randrange(len(words))] = "zebra"
        variants.append(" ".join(words))
    started = time.monotonic()
    big = Deduplicator()
    kept = 0
    for text in originals:
        if big.check(text) is None:
            big.add(text)
            kept += 1
    found = [big.check(text) for text in variants]
    elapsed_s = time.monotonic() - started
    truly_near = [jaccard(shingles(normalize(v)), shingles(normalize(o))) >= 0.7
                  for v, o in zip(variants, originals[:500], strict=True)]
    assert kept == 3000  # random 14-word sequences are far apart: nothing falsely dropped
    caught = sum(f == "near_duplicate" for f, t in zip(found, truly_near, strict=True) if t)
    assert caught >= 0.95 * sum(truly_near) and sum(truly_near) > 400
    assert elapsed_s < 60, elapsed_s  # ~2 s on an idle core
    again = Deduplicator()  # deterministic: the same decisions in a fresh one
    for text in originals[:500]:
        again.add(text)
    assert [again.check(text) for text in variants] == found


def test_distinct_n_and_the_summary_fields() -> None:
    from collections import Counter

    from workers.eagle3.generation.self_prompts import SelfPromptStats, distinct_n

    texts = ["a b c", "A b  d"]
    assert distinct_n(texts, 1) == 4 / 6 and distinct_n(texts, 2) == 3 / 4
    assert distinct_n(texts, 3) == 1.0 and distinct_n(["one"], 2) == 0.0
    stats = SelfPromptStats(sampled=10, accepted=2,
                            rejected=Counter(exact_duplicate=3, near_duplicate=1, empty=4))
    summary = stats.summary(texts, target=2)
    assert summary["exact_duplicate_share"] == 0.3 and summary["near_duplicate_share"] == 0.1
    assert summary["rejected"]["empty"] == 4 and summary["rejected"]["truncated"] == 0
    assert (summary["mean_prompt_words"], summary["distinct_1"]) == (3.0, 4 / 6)
    assert summary["target"] == 2


def test_openers_are_drawn_per_seed_with_the_free_share() -> None:
    from workers.eagle3.generation.openers import BUILTIN
    from workers.eagle3.generation.self_prompts import SamplingSettings, pick_openers

    settings = SamplingSettings(openers=BUILTIN, free_prompt_share=0.25)
    drawn = pick_openers(4000, 7, settings)
    assert drawn == pick_openers(4000, 7, settings) != pick_openers(4000, 8, settings)
    assert 0.22 < drawn.count("") / 4000 < 0.28  # the free share, within ~4 sigma
    used = [opener for opener in drawn if opener]
    assert set(used) <= set(BUILTIN) and len(set(used)) > 0.95 * len(set(BUILTIN))
    assert pick_openers(5, 7, SamplingSettings()) == [""] * 5  # no openers: all free
    assert "" not in pick_openers(50, 1, SamplingSettings(openers=("Solve",), free_prompt_share=0))


def test_a_question_starts_with_an_opener_only_as_whole_words() -> None:
    from workers.eagle3.evaluation.handwritten import read_handwritten
    from workers.eagle3.generation.openers import BUILTIN, starts_with_opener

    assert starts_with_opener("If 3 painters need 3 hours", BUILTIN) == "If"
    assert starts_with_opener("If", ("If",)) == "If"
    assert starts_with_opener("Iffy weather", ("If",)) is None
    assert starts_with_opener("Solve: x + 1 = 2", ("Solve",)) == "Solve"
    assert starts_with_opener("solve x", ("Solve",)) is None  # case counts
    assert starts_with_opener("Solve x", ()) is None
    # 19 of the 80 hand-written questions share one (the evaluation reports them apart)
    questions = read_handwritten()
    assert len(questions) == 80
    assert sum(starts_with_opener(q.prompt.messages[0]["content"], BUILTIN) is not None
               for q in questions) == 19


def test_read_openers_builtin_none_and_a_file(tmp_path: Path) -> None:
    from workers.eagle3.generation.openers import BUILTIN, read_openers

    assert read_openers("builtin") == BUILTIN and read_openers("none") == ()
    assert len(set(BUILTIN)) == len(BUILTIN) and all(o == o.strip() and o for o in BUILTIN)
    file = tmp_path / "openers.txt"
    file.write_text("# requests for a maths tutor\nSolve\n\n  Prove that  \n")
    assert read_openers(str(file)) == ("Solve", "Prove that")
    file.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no opener in the file"):
        read_openers(str(file))
    with pytest.raises(ValueError, match="No such file"):
        read_openers(str(tmp_path / "missing.txt"))


def test_an_opener_keeps_the_space_a_sentencepiece_tokenizer_decodes_away() -> None:
    """Decoded alone, a Metaspace (SentencePiece: Llama 2, Mistral) continuation loses
    its first space: "Write a poem" + "about the sea". Decoded after its prefix and cut
    from it, it keeps it; a byte-level BPE one (the tiny model's) is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from workers.eagle3.generation.self_prompts import written_text

    words = ["<unk>", "<|user|>", "\u2581Write", "\u2581a", "\u2581poem", "\u2581about",
             "\u2581the", "\u2581sea"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>"]})
    prefix = tokenizer("<|user|>Write a poem", add_special_tokens=False)["input_ids"]
    continued = tokenizer(" about the sea", add_special_tokens=False)["input_ids"]
    assert "Write a poem" + tokenizer.decode(continued) == "Write a poemabout the sea"
    assert written_text(tokenizer, prefix, "Write a poem", continued) \
        == "Write a poem about the sea"
    assert written_text(tokenizer, prefix, "Write a poem", []) == ""  # nothing added
    assert written_text(tokenizer, prefix[:1], "", continued) == "about the sea"


def test_openers_of_different_lengths_batch_as_they_sample_alone(tiny: Path) -> None:
    """Samples of different openers are left-padded into one batch: greedy, each comes
    out as it does in a batch of its own (the padding is masked, positions start at 0),
    and each text starts with its opener."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.eagle3.generation.self_prompts import (
        SamplingSettings,
        pick_openers,
        pre_query_template,
        transformers_sampler,
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    template = pre_query_template(tokenizer)
    openers = ("Solve", "Write a Python function that sorts", "Pretend you are a")
    settings = SamplingSettings(temperature=0, max_new_tokens=6, openers=openers,
                                free_prompt_share=0.25)
    batch = transformers_sampler(model, tokenizer, template, settings, "cpu")(12, 3)
    chosen = pick_openers(12, 3, settings)
    assert {opener for opener in chosen} == {"", *openers}  # every length in one batch
    for opener, sample in zip(chosen, batch, strict=True):
        alone = SamplingSettings(temperature=0, max_new_tokens=6, openers=(opener,) if opener
                                 else (), free_prompt_share=0.0 if opener else 1.0)
        [single] = transformers_sampler(model, tokenizer, template, alone, "cpu")(1, 3)
        assert sample == single
        assert sample.text.startswith(opener) or not sample.text.strip()  # nothing added


def word_sampler(calls: list[int], crash_after: int | None = None) -> Any:
    """A stand-in target: per seed, the same mix of usable prompts, repeats, debris,
    truncated and short ones."""
    import random

    from workers.eagle3.generation.self_prompts import Sample

    def sample(count: int, seed: int) -> list[Sample]:
        if crash_after is not None and len(calls) >= crash_after:
            raise RuntimeError("killed")
        calls.append(count)
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            kind = rng.random()
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
            if kind < 0.1:
                out.append(Sample("river mountain quiet engine lantern", True))  # repeats
            elif kind < 0.2:
                out.append(Sample(f"{words}<|end|>\n<|assistant|>", True))
            elif kind < 0.3:
                out.append(Sample(words, False))
            elif kind < 0.4:
                out.append(Sample("ok", True))
            else:
                out.append(Sample(words.capitalize() + "?", True))
        return out

    return sample


def test_self_prompts_resume_after_a_crash_without_duplicates(tmp_path: Path) -> None:
    from workers.common import ProgressReporter
    from workers.eagle3.generation.self_prompts import (
        CollectSettings,
        collect,
        normalize,
        prompts_path,
        summary_path,
    )

    out, progress = tmp_path / "conv.jsonl", tmp_path / "progress.json"
    settings = CollectSettings(target=40, batch_size=8, seed=3, max_rounds=6)
    calls: list[int] = []
    with pytest.raises(RuntimeError, match="killed"):
        collect(out, word_sampler(calls, crash_after=3), settings,
                ProgressReporter(total=40, unit="self prompt", path=str(progress)))
    before = records(prompts_path(out))
    assert 0 < len(before) < 40 and sum(calls) == 24
    assert json.loads(summary_path(out).read_text())["sampled"] == 24
    with open(prompts_path(out), "a") as f:  # killed in the middle of a line too
        f.write('{"id": "self-0000')

    summary = collect(out, word_sampler(calls), settings,
                      ProgressReporter(total=40, unit="self prompt", path=str(progress)))
    after = records(prompts_path(out))
    assert after[:len(before)] == before  # the accepted prompts are kept as they were
    texts = [r["messages"][0]["content"] for r in after]
    assert len(after) == 40 and len({normalize(t) for t in texts}) == 40
    assert len({r["id"] for r in after}) == 40
    assert summary["accepted"] == 40 and summary["prompts_in_file"] == 40
    assert summary["sampled"] == summary["accepted"] + sum(summary["rejected"].values())
    for reason in ("exact_duplicate", "template_debris", "truncated", "too_short"):
        assert summary["rejected"][reason] > 0, reason
    assert summary == json.loads(summary_path(out).read_text())
    report = json.loads(progress.read_text())
    assert (report["done"], report["total"], report["unit"]) == (40, 40, "self prompt")
    assert report["metrics"]["sampled"] == summary["sampled"]

    sampled = summary["sampled"]  # enough already: nothing is sampled
    assert collect(out, word_sampler(calls), settings,
                   ProgressReporter(total=40, unit="self prompt"))["sampled"] == sampled


def test_self_prompts_give_up_after_max_rounds_with_counts(tmp_path: Path) -> None:
    from workers.common import ProgressReporter
    from workers.eagle3.generation.self_prompts import (
        CollectSettings,
        Sample,
        SelfPromptsIncomplete,
        collect,
        summary_path,
    )

    def debris(count: int, seed: int) -> list[Sample]:
        return [Sample("<|user|> what now is it", True)] * count

    with pytest.raises(SelfPromptsIncomplete) as caught:
        collect(tmp_path / "c.jsonl", debris, CollectSettings(10, 4, 0, max_rounds=2),
                ProgressReporter(total=10, unit="self prompt"))
    summary = json.loads(summary_path(tmp_path / "c.jsonl").read_text())
    # round 1: 10 / 0.5 * 1.1 = 22; round 2 the same (nothing accepted to rate by)
    assert summary["sampled"] == 44 == summary["rejected"]["template_debris"]
    assert "0 of 10 self prompts accepted after 2 rounds (44 sampled; rejected: " \
           "template_debris 44)" in str(caught.value)


def test_self_prompts_end_to_end_and_rerun(word_writer: Path, tmp_path: Path) -> None:
    """The target writes 6 prompts and answers the first 4 (--limit, as the pipeline
    holds the rest out); a rerun asking for 9 keeps the 6, writes 3 more, answers 5."""
    out, progress = tmp_path / "conv.jsonl", tmp_path / "progress.json"
    prompts_file, summary_file = (tmp_path / "conv.self_prompts.jsonl",
                                  tmp_path / "conv.self_prompts.summary.json")
    common = ("--backend", "transformers", "--model", word_writer, "--out", out,
              "--device", "cpu", "--max-tokens", "4", "--batch-size", "4", "--seed", "1")
    first = generate("--self-prompts", "6", "--limit", "4", *common,
                     env={"JOBSUP_PROGRESS_FILE": str(progress)}, timeout=240)
    assert first.returncode == 0, first.stderr
    written = records(prompts_file)
    assert [r["id"] for r in written] == [f"self-{i:06d}" for i in range(6)]
    assert sorted(r["id"] for r in records(out)) == [r["id"] for r in written[:4]]
    for record in records(out):
        assert record["messages"][0] == next(
            r for r in written if r["id"] == record["id"])["messages"][0]
    summary = json.loads(summary_file.read_text())
    assert summary["accepted"] == 6 and summary["settings"]["pre_query"] == "<|user|>\n"
    assert summary["settings"]["openers"] == "builtin"  # the default
    assert summary["settings"]["free_prompt_share"] == 0.25
    assert summary["sampled"] == 6 + sum(summary["rejected"].values())
    assert 0 < summary["distinct_1"] <= summary["distinct_2"] <= 1
    assert "self prompts: 6 accepted of" in first.stderr
    assert json.loads(progress.read_text())["done"] == 4  # the answering phase's report

    second = generate("--self-prompts", "9", *common, timeout=240)
    assert second.returncode == 0, second.stderr
    again = records(prompts_file)
    assert again[:6] == written and len(again) == 9
    assert len({r["messages"][0]["content"].lower() for r in again}) == 9
    assert sorted(r["id"] for r in records(out)) == [r["id"] for r in again]
    assert json.loads(summary_file.read_text())["sampled"] > summary["sampled"]
    assert "4 already in" in second.stderr


def test_self_prompts_from_openers_of_a_file(word_writer: Path, tmp_path: Path) -> None:
    """`--prompt-openers FILE --free-prompt-share 0`: every prompt starts with one of
    the file's openers and goes on in the target's words; the summary says so."""
    openers = tmp_path / "openers.txt"
    openers.write_text("Solve\nWrite a Python function\n")
    out = tmp_path / "conv.jsonl"
    result = generate("--self-prompts", "8", "--limit", "1", "--backend", "transformers",
                      "--model", word_writer, "--out", out, "--device", "cpu",
                      "--max-tokens", "2", "--batch-size", "8", "--prompt-openers", openers,
                      "--free-prompt-share", "0", timeout=240)
    assert result.returncode == 0, result.stderr
    texts = [r["messages"][0]["content"] for r in records(tmp_path / "conv.self_prompts.jsonl")]
    assert len(texts) == 8
    for text in texts:
        opener = next(o for o in ("Solve", "Write a Python function") if text.startswith(o))
        rest = text[len(opener):].split()  # the writer's lower-case words
        assert rest and all(w.isalpha() and w.islower() for w in rest), text
    assert {t.split()[0] for t in texts} == {"Solve", "Write"}
    summary = json.loads((tmp_path / "conv.self_prompts.summary.json").read_text())
    assert summary["settings"]["openers"] == str(openers)
    assert (summary["settings"]["opener_count"], summary["settings"]["free_prompt_share"]) == (2, 0)
    assert summary["settings"]["openers_sha256"] == hashlib.sha256(
        b"Solve\nWrite a Python function").hexdigest()  # which openers, not just the file
    # a rerun without --prompt-openers samples the missing prompts with the same openers,
    # not the default's
    again = generate("--self-prompts", "11", "--limit", "1", "--backend", "transformers",
                     "--model", word_writer, "--out", out, "--device", "cpu",
                     "--max-tokens", "2", "--batch-size", "8", "--free-prompt-share", "0",
                     timeout=240)
    assert again.returncode == 0, again.stderr
    texts = [r["messages"][0]["content"] for r in records(tmp_path / "conv.self_prompts.jsonl")]
    assert len(texts) == 11
    assert all(t.startswith(("Solve ", "Write a Python function ")) for t in texts), texts
    summary = json.loads((tmp_path / "conv.self_prompts.summary.json").read_text())
    assert summary["settings"]["openers"] == str(openers)


def test_self_prompts_usage_errors_and_a_model_that_writes_nothing_usable(
        tiny: Path, tmp_path: Path) -> None:
    both = generate("--self-prompts", "5", "--prompts", tmp_path / "p.jsonl",
                    "--out", tmp_path / "o.jsonl")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    for flags, message in [(("--prompt-openers", tmp_path / "none.txt"), "No such file"),
                           (("--free-prompt-share", "1.5"), "must be in [0, 1]")]:
        bad = generate("--self-prompts", "5", "--out", tmp_path / "o.jsonl", "--backend",
                       "transformers", "--model", tiny, *flags)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    openai = generate("--self-prompts", "5", "--out", tmp_path / "o.jsonl")
    assert openai.returncode == 2 and "--self-prompts needs --backend transformers" \
        in openai.stderr
    # a random model rarely closes the turn within 3 tokens: all truncated, then exit 1
    result = generate("--self-prompts", "3", "--out", tmp_path / "o.jsonl", "--backend",
                      "transformers", "--model", tiny, "--device", "cpu",
                      "--prompt-max-tokens", "3", "--max-rounds", "1", timeout=240)
    assert result.returncode == 1, result.stderr
    assert "0 of 3 self prompts accepted after 1 rounds (7 sampled" in result.stderr
    summary = json.loads((tmp_path / "o.self_prompts.summary.json").read_text())
    assert summary["sampled"] == 7 and summary["rejected"]["truncated"] >= 5
    assert not (tmp_path / "o.jsonl").exists()  # nothing answered
