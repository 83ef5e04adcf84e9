"""Synthetic data generation: the target model answers each prompt; its answer (and the
reasoning trace, where the server returns one) is kept as one conversation per line.

  python -m workers.generate --prompts prompts.jsonl --out conversations.jsonl \\
      --backend openai --endpoint http://127.0.0.1:8000/v1 --concurrency 64
  python -m workers.generate --self-prompts 5000 --out conversations.jsonl \\
      --backend transformers --model /models/target

With --self-prompts N the target first writes the prompts (Magpie: its chat template up
to a user turn's content, continued until the turn ends), which are filtered and
de-duplicated (workers/eagle3/generation/self_prompts.py) into OUT_STEM.self_prompts.jsonl beside
the output, with counts in OUT_STEM.self_prompts.summary.json; a rerun keeps them and
samples only what is missing.

Backends: `openai` is a concurrent client of an OpenAI-compatible server (`vllm serve`,
SGLang) with retries and backoff; `transformers` generates locally in batches (small
models, tests). The output may be killed at any moment: each record is appended with one
write of one complete line, and a rerun cuts away a line torn by a crash and skips the
ids already written.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.common import (
    JsonlStats,
    ProgressReporter,
    fail,
    read_jsonl,
    record_messages,
    require_file,
    setup_logging,
)
from workers.eagle3.generation import openers, self_prompts
from workers.eagle3.generation.generate_output import (
    Answer,
    OutputFile,
    Prompt,
    RunError,
    RunState,
    make_record,
)
from workers.eagle3.generation.openai_backend import run_openai
from workers.eagle3.target.loading import EXPERTS

log = logging.getLogger("workers.generate")

EXIT_CODES = """exit codes:
  0  every prompt is in the output
  1  some prompts failed permanently (rerun to retry them)
  2  usage error (missing file, bad flag, model that cannot be loaded)
     or --self-prompts: fewer than N prompts accepted within --max-rounds
  3  aborted: K prompts in a row failed, the server never answered, or the output
     cannot be written"""
DEFAULT_MAX_NEW_TOKENS = 1024
"""transformers backend, when --max-tokens is not given (a server picks its own)."""


# -- prompts -------------------------------------------------------------------------------

def prompt_problem(record: dict[str, Any]) -> str | None:
    if not isinstance(record["id"], str) or not record["id"]:
        return "id must be a non-empty string"
    try:  # `messages`, or ShareGPT-style `conversations`, as {role, content}
        messages = record["messages"] = record_messages(record)
    except ValueError as exc:
        return str(exc)
    if not messages:
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
    for number, record in read_jsonl(path, stats, required=("id",)):
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


# -- transformers backend -------------------------------------------------------------------

@dataclass(frozen=True)
class LocalTarget:
    """A target loaded by the transformers backend: it answers, and in self-prompts mode
    first writes the prompts."""

    model: Any
    tokenizer: Any
    device: str
    decoder: Any = None
    """Its `static_decode.StaticDecoder`; None: transformers' `generate` decodes."""


DECODERS = ("auto", "static", "transformers")
"""--decoder: how the transformers backend decodes (`pick_decoder`)."""


def pick_decoder(choice: str, model: Any) -> Any:
    """The static decoder for `model` (`static_decode.StaticDecoder`), or None for
    transformers' `generate`: `auto` takes the static one where the model's layout
    allows it."""
    if choice == "transformers":
        log.info("decoding with transformers' generate (--decoder transformers)")
        return None
    from workers.eagle3.generation import static_decode

    reason = static_decode.unsupported_reason(model)
    if reason is not None:
        if choice == "static":
            raise RunError(f"--decoder static cannot run this model: {reason}", 2)
        log.info("decoding with transformers' generate: the static decoder cannot run this "
                 "model (%s)", reason)
        return None
    decoder = static_decode.StaticDecoder(model)
    log.info("decoding with a static KV cache%s", " and the step as a CUDA graph"
             if decoder.device.type == "cuda" else "")
    return decoder


def load_local_target(args: argparse.Namespace) -> LocalTarget:
    log.info("loading %s", args.model)
    started = time.monotonic()
    import torch

    from workers.eagle3.target.loading import load_target, load_tokenizer
    from workers.eagle3.target.model import TargetError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = load_tokenizer(args.model)
        # the checkpoint's dtype on a GPU; fp32 on a CPU, where bf16 matmuls crawl. A
        # multimodal target (Kimi-K2.5) generates from text alone through its wrapper.
        dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        model = load_target(args.model, device=device, dtype=dtype,
                            experts=args.experts).model
    except (OSError, ValueError, TargetError) as exc:
        raise RunError(f"cannot load a model from {args.model}: {exc}", 2) from None
    if not tokenizer.chat_template:
        raise RunError(f"the tokenizer in {args.model} has no chat template", 2)
    log.info("model loaded on %s in %.1f s", device, time.monotonic() - started)
    model.eval()
    return LocalTarget(model, tokenizer, device, pick_decoder(args.decoder, model))


def run_transformers(args: argparse.Namespace, target: LocalTarget, prompts: list[Prompt],
                     output: OutputFile, state: RunState) -> None:
    """Greedy (or --temperature) answers in batches of prompts of similar length: the
    prompts are sorted by their token count, longest first (a batch too large for the
    device fails at the start, not hours in), so little of a batch is left padding.
    Records land in that order, each with its own id."""
    import torch

    model, tokenizer, device = target.model, target.tokenizer, target.device
    state.started = time.monotonic()  # rates count generation, not loading
    tokenizer.padding_side = "left"  # new tokens follow every prompt directly
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stop_ids = set(eos) if isinstance(eos, list) else {eos}
    # greedy: the argmax of the target's logits, as workers.evaluate decodes, whatever the
    # model's generation config says (sampling, a repetition penalty); sampled at
    # --temperature within the config's top-k and top-p (not transformers' default top-k)
    sampled = args.temperature is not None and args.temperature > 0
    top_k = getattr(model.generation_config, "top_k", None) or 0
    top_p = getattr(model.generation_config, "top_p", None) or 1.0
    options: dict[str, Any] = {"max_new_tokens": args.max_tokens or DEFAULT_MAX_NEW_TOKENS,
                               "pad_token_id": tokenizer.pad_token_id, "do_sample": sampled,
                               "repetition_penalty": 1.0}
    if sampled:
        options.update(temperature=args.temperature, top_k=top_k, top_p=top_p)

    rendered = {p.id: str(tokenizer.apply_chat_template(p.messages, tokenize=False,
                                                        add_generation_prompt=True))
                for p in prompts}
    prompt_ids = {prompt_id: tokenizer(text, add_special_tokens=False)["input_ids"]
                  for prompt_id, text in rendered.items()}
    prompts = sorted(prompts, key=lambda p: -len(prompt_ids[p.id]))  # ties keep file order

    def decode(batch: list[Prompt]) -> tuple[list[list[int]], list[int]]:
        """Each prompt's new tokens (a stop token, then anything, may end them) and its
        prompt's token count."""
        rows = [prompt_ids[p.id] for p in batch]
        if target.decoder is not None:
            from workers.eagle3.generation.static_decode import Sampling

            sampling = Sampling(args.temperature, top_p, seed=args.seed + state.done,
                                top_k=top_k) if sampled else None
            return target.decoder.generate(rows, max_new_tokens=options["max_new_tokens"],
                                           stop_ids=stop_ids, sampling=sampling), \
                list(map(len, rows))
        encoded = tokenizer([rendered[p.id] for p in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
        with torch.inference_mode():
            out = model.generate(**encoded, **options)
        return (out[:, encoded["input_ids"].shape[1]:].tolist(),
                encoded["attention_mask"].sum(dim=1).tolist())

    def generate(batch: list[Prompt]) -> list[Answer]:
        answers = []
        for tokens, prompt_tokens in zip(*decode(batch), strict=True):
            stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
            kept = tokens if stop is None else tokens[:stop]
            completion_tokens = len(tokens) if stop is None else stop + 1
            answers.append(Answer(
                tokenizer.decode(kept, skip_special_tokens=True), None,
                "length" if stop is None else "stop",
                {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}))
        return answers

    def answered(batch: list[Prompt]) -> list[tuple[Prompt, Answer | Exception]]:
        """The batch's answers; a batch that fails (out of memory on a long one) is split
        in halves, each tried in turn, down to one prompt, whose error is its answer."""
        failure = None
        try:
            return list(zip(batch, generate(batch), strict=True))
        except (RuntimeError, ValueError) as exc:
            failure = exc if len(batch) == 1 else str(exc)  # frames hold the batch's cache
        if isinstance(failure, Exception):
            return [(batch[0], failure)]
        log.warning("a batch of %d failed (%s); trying it in halves", len(batch), failure)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(batch) // 2
        return answered(batch[:half]) + answered(batch[half:])

    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        state.requests_in_flight = len(batch)
        results = answered(batch)
        state.requests_in_flight = 0
        if target.decoder is not None:
            state.graph_fallback = target.decoder.graphs_failed
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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompts", help='JSONL: {"id": str, "messages": [{role, content}]} (or ShareGPT '
                          '"conversations": [{from: human|gpt|system, value}])')
    source.add_argument(
        "--self-prompts", type=positive(int), metavar="N",
        help="the target writes N prompts itself (transformers backend), then answers them")
    add("--out", required=True, type=Path, help="conversations JSONL (appended; rerun resumes)")
    add("--backend", choices=["openai", "transformers"], default="openai")
    add("--model", help="openai: served model name (default: the first of /models); "
                        "transformers: local model directory")
    add("--endpoint", default="http://127.0.0.1:8000/v1", help="openai: base URL")
    add("--api-key", help="openai: bearer token (default: $OPENAI_API_KEY)")
    add("--concurrency", type=positive(int), default=16, help="openai: requests at a time")
    add("--max-tokens", type=positive(int), help="per answer (default: the server's; "
                                                 f"transformers: {DEFAULT_MAX_NEW_TOKENS})")
    add("--temperature", type=float,
        help="openai: default the server's; transformers: default greedy (the argmax, no "
             "penalties), else sampled within the model's top-k and top-p")
    add("--timeout", type=positive(float), default=600.0, help="seconds per request")
    add("--retries", type=int, default=5, help="retries per request on 5xx, 429, timeouts "
                                               "and connection errors (not on other 4xx)")
    add("--retry-backoff", type=positive(float), default=1.0,
        help="seconds before the first retry, doubled for each next one, with jitter")
    add("--max-consecutive-failures", type=positive(int), default=20, metavar="K",
        help="abort (exit 3) after K prompts in a row failed all their retries")
    add("--batch-size", type=positive(int), default=8, help="transformers: prompts per batch")
    add("--device", help="transformers: torch device (default: cuda if available, else cpu)")
    add("--decoder", choices=DECODERS, default="auto",
        help="transformers: how answers and self prompts are decoded: static (a KV cache "
             "allocated once per batch, the decode step a CUDA graph on a GPU; Llama, Qwen2 "
             "and Qwen3 layouts; the same greedy answers and sampling settings as "
             "generate, its own seeded draws), transformers (its generate), auto (the "
             "default: static where the model's layout allows it)")
    add("--experts", choices=EXPERTS, default="auto",
        help="transformers: a pack-quantized INT4 checkpoint's routed experts kept packed "
             "or dequantized to bf16 (auto: packed)")
    add("--limit", type=positive(int), help="only the first N valid prompts")
    add("--wait-for-server", type=float, default=0.0, metavar="SECONDS",
        help="openai: wait up to SECONDS for the server to answer before starting")
    self_prompts = parser.add_argument_group("--self-prompts")
    self_prompts.add_argument("--prompt-temperature", type=float, default=1.0,
                              help="sampling temperature of the prompts (0: greedy)")
    self_prompts.add_argument("--prompt-top-p", type=float, default=1.0,
                              help="nucleus sampling of the prompts")
    self_prompts.add_argument("--prompt-max-tokens", type=positive(int), default=256,
                              help="a prompt not ended within this many tokens is "
                                   "rejected as truncated")
    self_prompts.add_argument("--min-prompt-words", type=positive(int), default=3,
                              help="shorter prompts are rejected")
    self_prompts.add_argument("--max-rounds", type=positive(int), default=8,
                              help="sampling rounds (each sized by the acceptance so far) "
                                   "before giving up with exit 1")
    self_prompts.add_argument("--prompt-openers", default=None,
                              metavar="none|builtin|FILE",
                              help="first words of the user turn the target goes on from, "
                                   "one drawn per prompt: builtin (the default: requests of "
                                   "every kind: code, sums, stories, role-play, extraction, "
                                   "...; workers/eagle3/generation/openers.py), none (the "
                                   "bare template, Magpie's way), or a file of one per line. "
                                   "A rerun without it keeps the setting its prompts began "
                                   "with")
    self_prompts.add_argument("--free-prompt-share", type=float, default=0.25, metavar="S",
                              help="with openers: the share of prompts written with none")
    self_prompts.add_argument("--seed", type=int, default=0,
                              help="seed of the prompt sampling (reproducible runs)")
    add("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.retries < 0:
        parser.error("--retries must be >= 0")
    if args.self_prompts and args.backend != "transformers":
        parser.error("--self-prompts needs --backend transformers (the openai backend "
                     "cannot yet have a server continue a raw chat template)")
    if args.prompt_temperature < 0 or not 0 < args.prompt_top_p <= 1:
        parser.error("--prompt-temperature must be >= 0 and --prompt-top-p in (0, 1]")
    if not 0 <= args.free_prompt_share <= 1:
        parser.error("--free-prompt-share must be in [0, 1]")
    if args.prompt_openers is None:
        args.prompt_openers = openers_begun(args.out) or "builtin"
    try:
        args.openers = openers.read_openers(args.prompt_openers)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.openers:
        args.free_prompt_share = 1.0
    return args


def openers_begun(out: Path) -> str | None:
    """The --prompt-openers the self prompts at `out` were sampled with (their summary),
    or None when none were: a rerun without the flag adds prompts of the same kind, also
    to a set begun before builtin became the default (written with "none")."""
    try:
        summary = json.loads(self_prompts.summary_path(out).read_text(encoding="utf-8"))
        spec = summary["settings"].get("openers", "none")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return spec if isinstance(spec, str) and spec else None


def write_self_prompts(args: argparse.Namespace, target: LocalTarget) -> dict[str, Any]:
    """The target's own prompts into `self_prompts.prompts_path(args.out)` (Magpie)."""
    tokenizer = target.tokenizer
    try:
        template = self_prompts.pre_query_template(tokenizer)
    except ValueError as exc:
        raise RunError(f"--self-prompts: {exc}", 2) from None
    log.info("self prompts: continuing %r until %r", template.text, template.end_of_turn)
    sampling = self_prompts.SamplingSettings(args.prompt_temperature, args.prompt_top_p,
                                             args.prompt_max_tokens, args.openers,
                                             args.free_prompt_share)
    sampler = self_prompts.transformers_sampler(target.model, tokenizer, template, sampling,
                                                target.device, target.decoder)
    filters = self_prompts.FilterSettings(
        min_words=args.min_prompt_words,
        markers=(*self_prompts.GENERIC_MARKERS, *self_prompts.template_markers(tokenizer)))
    settings = self_prompts.CollectSettings(args.self_prompts, args.batch_size, args.seed,
                                            args.max_rounds, filters)
    context = {"pre_query": template.text, "end_of_turn": template.end_of_turn,
               "temperature": sampling.temperature, "top_p": sampling.top_p,
               "max_new_tokens": sampling.max_new_tokens, "seed": args.seed,
               "openers": args.prompt_openers, "opener_count": len(args.openers),
               "openers_sha256": hashlib.sha256("\n".join(args.openers).encode()).hexdigest(),
               "free_prompt_share": sampling.free_prompt_share}
    summary = self_prompts.collect(args.out, sampler, settings,
                                   ProgressReporter(total=args.self_prompts, unit="self prompt"),
                                   context)
    rejected = ", ".join(f"{reason} {count}" for reason, count in summary["rejected"].items()
                         if count) or "none"
    log.info("self prompts: %d accepted of %d sampled (rejected: %s); distinct-1/2/3 "
             "%.2f/%.2f/%.2f, %.1f words on average; in %s", summary["accepted"],
             summary["sampled"], rejected, summary["distinct_1"], summary["distinct_2"],
             summary["distinct_3"], summary["mean_prompt_words"],
             self_prompts.prompts_path(args.out))
    return summary


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.verbose)
    if not args.verbose:  # one line per request is too many at 100k prompts
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.backend == "transformers":
        if not args.model:
            fail("--backend transformers needs --model PATH, a local model directory")
        require_file(args.model, "model directory")
    target: LocalTarget | None = None
    if args.self_prompts:
        try:
            target = load_local_target(args)
            write_self_prompts(args, target)
        except RunError as exc:
            fail(str(exc), exc.exit_code)
        except self_prompts.SelfPromptsIncomplete as exc:
            fail(str(exc), 1)
        except KeyboardInterrupt:
            fail("interrupted; rerun to resume", 130)
        prompts_path = self_prompts.prompts_path(args.out)
    else:
        prompts_path = require_file(args.prompts, "prompts file")
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
            run_transformers(args, target or load_local_target(args), todo, output, state)
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
