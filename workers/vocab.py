"""Draft vocabulary mapping for EAGLE-3 (docs/eagle3.md section 3): `python -m workers.vocab`.

Counts the target token ids the assistant wrote (loss_mask == 1) in a conversations JSONL
or in the directory `workers.extract` wrote, keeps the `--draft-vocab-size` most frequent
(ties go to the lower id; fewer distinct ids than that are filled with the smallest
unused ids) and writes `d2t` (int64 [N]: draft id i is target id i + d2t[i]) and `t2d`
(bool [V]: true at the chosen target ids) to a safetensors file, plus `<out>.json`.

With `--from-checkpoint` the mapping of an existing draft is reused, never recounted:
a pre-trained draft's lm_head rows are tied to its own mapping, and a recounted one
silently misaligns them (acceptance collapses while accuracy metrics look fine).

Timing (2-core CPU, torch 2.13, `TokenCounter` + `select_draft_vocab` + `build_mapping`):
10M random token ids counted in 6,897 samples of 1,450 over V=163,840, then N=32,000
selected: ~0.5 s, of which selection, mapping and coverage take 10-80 ms (one stable
sort). A bincount per sample instead took ~7 s (each allocates a [V] histogram), hence
the buffering. On real inputs reading the files or, for a JSONL, rendering the chat
template dominates.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.common import (
    JsonlStats,
    ProgressReporter,
    fail,
    read_jsonl,
    record_messages,
    require_file,
    setup_logging,
    tokenize_conversation,
)
from workers.eagle3.draft.vocab_mapping import (
    VocabError,
    VocabReport,
    build_mapping,
    coverage_of,
    load_mapping,
    select_draft_vocab,
    write_vocab,
)

log = logging.getLogger("workers.vocab")  # not __main__ under `python -m`

DEFAULT_DRAFT_VOCAB_SIZE = 32000
FLUSH_TOKENS = 1 << 22
"""Token ids buffered before one bincount (4M ids = 32 MB of int64)."""


# -- counting ---------------------------------------------------------------------------

class TokenCounter:
    """A [V] histogram of token ids. Ids are buffered and counted with one bincount per
    FLUSH_TOKENS: a bincount per sample allocates a [V] tensor each time, ~20x slower."""

    def __init__(self, vocab_size: int, flush_tokens: int = FLUSH_TOKENS):
        self.vocab_size = vocab_size
        self.flush_tokens = flush_tokens
        self._counts = torch.zeros(vocab_size, dtype=torch.int64)
        self._pending: list[torch.Tensor] = []
        self._pending_tokens = 0

    def add(self, ids: torch.Tensor, mask: torch.Tensor, where: str) -> int:
        """Count `ids` where `mask == 1`; returns how many were counted."""
        ids, mask = ids.reshape(-1), mask.reshape(-1)
        if ids.numel() != mask.numel():
            raise VocabError(f"{where}: input_ids has {ids.numel()} tokens but loss_mask "
                             f"has {mask.numel()}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise VocabError(f"{where}: input_ids must be integers, not {ids.dtype}")
        counted = ids[mask == 1].to(torch.int64)
        if counted.numel() == 0:
            return 0
        low, high = int(counted.min()), int(counted.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise VocabError(f"{where}: token id {bad} is outside the target vocabulary of "
                             f"{self.vocab_size} ids: was the data tokenized with another "
                             "tokenizer?")
        self._pending.append(counted)
        self._pending_tokens += counted.numel()
        if self._pending_tokens >= self.flush_tokens:
            self._flush()
        return counted.numel()

    def _flush(self) -> None:
        if self._pending:
            self._counts += torch.bincount(torch.cat(self._pending), minlength=self.vocab_size)
        self._pending, self._pending_tokens = [], 0

    def counts(self) -> torch.Tensor:
        self._flush()
        return self._counts


def extracted_files(data_dir: Path) -> list[Path]:
    """The sample files under `data_dir`, sorted; dotfiles, hidden directories and
    temp files (a partial write never counts) are left out."""
    files = []
    for path in data_dir.rglob("*.safetensors"):
        parts = path.relative_to(data_dir).parts
        if any(part.startswith(".") for part in parts) or ".tmp" in path.name:
            continue
        if path.is_file():
            files.append(path)
    return sorted(files)


def count_extracted(data_dir: Path, counter: TokenCounter, report: VocabReport,
                    progress: ProgressReporter, max_length: int | None) -> None:
    files = extracted_files(data_dir)
    progress.total = len(files)
    for done, path in enumerate(files, start=1):
        name = str(path.relative_to(data_dir))
        try:
            # only these two tensors are read (memory-mapped); never the hidden states
            with safe_open(str(path), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            if ids.numel() != mask.numel():
                raise ValueError(f"{ids.numel()} input_ids but {mask.numel()} loss_mask")
        except Exception as exc:  # a foreign or broken file: skip it, name it, go on
            log.warning("%s: skipping %s: %s", data_dir, name, exc)
            report.skipped_files.append(name)
            continue
        if max_length is not None and ids.numel() > max_length:
            ids, mask = ids.reshape(-1)[:max_length], mask.reshape(-1)[:max_length]
            report.truncated_samples += 1
        _count_sample(counter, report, ids, mask, f"{data_dir}/{name}")
        progress.update(done)


def count_jsonl(path: Path, tokenizer: Any, counter: TokenCounter, report: VocabReport,
                progress: ProgressReporter, max_length: int | None) -> None:
    with open(path, encoding="utf-8") as f:
        progress.total = sum(1 for line in f if line.strip())
    stats = JsonlStats()
    for number, record in read_jsonl(path, stats):
        try:  # `messages`, or ShareGPT-style `conversations`
            messages = record_messages(record)
            tokenized = tokenize_conversation(tokenizer, messages, max_length=max_length)
        except (ValueError, TypeError) as exc:
            log.warning("%s: skipping line %d: %s", path, number, exc)
            stats.malformed.append(number)
            continue
        report.truncated_samples += tokenized.truncated
        _count_sample(counter, report, torch.tensor(tokenized.input_ids, dtype=torch.int64),
                      torch.tensor(tokenized.loss_mask), f"{path}:{number}")
        progress.update(stats.lines)
    report.skipped_lines = sorted(stats.malformed)


def _count_sample(counter: TokenCounter, report: VocabReport, ids: torch.Tensor,
                  mask: torch.Tensor, where: str) -> None:
    counted = counter.add(ids, mask, where)
    report.samples += 1
    report.tokens_counted += counted
    report.samples_without_counted_tokens += counted == 0


def load_tokenizer(path: Path) -> tuple[Any, int]:
    """(tokenizer, target vocab size): len(tokenizer), or the model config's vocab_size
    when a config.json beside the tokenizer says more (padded embedding rows)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_file():
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises many types for an unusable directory
        raise VocabError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
    size = len(tokenizer)
    config = (path.parent if path.is_file() else path) / "config.json"
    if config.is_file():
        try:
            configured = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, ValueError, AttributeError) as exc:
            raise VocabError(f"{config}: unreadable: {exc}") from exc
        if isinstance(configured, int):
            size = max(size, configured)
    return tokenizer, size


# -- CLI --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    description = (__doc__ or "").split("\n\nTiming")[0]
    parser = argparse.ArgumentParser(prog="python -m workers.vocab", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="conversations JSONL, or a directory "
                        "written by workers.extract (reads only input_ids and loss_mask)")
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="the target's tokenizer directory (or tokenizer.json)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help=f"draft vocabulary size (default {DEFAULT_DRAFT_VOCAB_SIZE}; with "
                        "--from-checkpoint, the checkpoint's, which it must match if given)")
    parser.add_argument("--out", type=Path, required=True,
                        help="safetensors file to write (d2t, t2d); <out>.json beside it")
    parser.add_argument("--from-checkpoint", type=Path, default=None,
                        help="reuse the d2t/t2d of this draft checkpoint directory or vocab "
                        "file instead of counting (required when finetuning a pre-trained "
                        "draft); --data then only measures coverage")
    parser.add_argument("--max-length", type=int, default=None,
                        help="count at most this many tokens per sample")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> VocabReport:
    if args.data is None and args.from_checkpoint is None:
        raise VocabError("--data is required (unless --from-checkpoint is given)")
    if args.max_length is not None and args.max_length <= 0:
        raise VocabError("--max-length must be positive")
    if args.out.is_dir():
        raise VocabError(f"--out {str(args.out)!r} is a directory; give a file name")
    require_file(args.tokenizer, "tokenizer")
    if args.data is not None:
        require_file(args.data, "data")
    if args.from_checkpoint is not None:
        require_file(args.from_checkpoint, "checkpoint")
    tokenizer, target_size = load_tokenizer(args.tokenizer)

    d2t = t2d = None
    if args.from_checkpoint is not None:
        if (args.from_checkpoint / "config.json").is_file():  # a saved draft directory
            from workers.eagle3.draft.model import DraftFileError, read_draft_mapping
            try:  # its own tensors, or identity when it has the target's whole vocabulary
                d2t, t2d = read_draft_mapping(args.from_checkpoint)
            except DraftFileError as exc:
                raise VocabError(str(exc)) from exc
        else:
            d2t, t2d, _ = load_mapping(args.from_checkpoint)
        if t2d.numel() != target_size:
            raise VocabError(f"{args.from_checkpoint}: its mapping is for a target vocab of "
                             f"{t2d.numel()} ids, but the tokenizer has {target_size}; put the "
                             "target model's config.json beside the tokenizer if its "
                             "vocab_size differs from len(tokenizer)")
        if args.draft_vocab_size not in (None, d2t.numel()):
            raise VocabError(f"--draft-vocab-size {args.draft_vocab_size} differs from the "
                             f"checkpoint's draft vocab of {d2t.numel()}")
    draft_size = d2t.numel() if d2t is not None else args.draft_vocab_size
    if draft_size is None:
        draft_size = DEFAULT_DRAFT_VOCAB_SIZE
    if not 0 < draft_size <= target_size:
        raise VocabError(f"--draft-vocab-size {draft_size} must be between 1 and the target "
                         f"vocab size {target_size}")

    report = VocabReport(draft_vocab_size=draft_size, target_vocab_size=target_size,
                         coverage=None, tokens_counted=0, distinct_tokens=0, samples=0,
                         source="checkpoint" if d2t is not None else "counted",
                         data=str(args.data) if args.data else None,
                         checkpoint=str(args.from_checkpoint) if args.from_checkpoint else None)
    progress = ProgressReporter(total=0, unit="sample")
    counter = TokenCounter(target_size)
    if args.data is not None:
        if args.data.is_dir():
            count_extracted(args.data, counter, report, progress, args.max_length)
        else:
            count_jsonl(args.data, tokenizer, counter, report, progress, args.max_length)
    counts = counter.counts()
    report.distinct_tokens = int((counts > 0).sum())
    if d2t is None:
        if report.samples == 0:
            raise VocabError(f"{args.data}: no usable samples in it")
        if report.tokens_counted == 0:
            raise VocabError(f"{args.data}: no assistant tokens to count (loss_mask is 0 "
                             f"everywhere in {report.samples} samples): the data needs "
                             "assistant replies, e.g. from workers.generate")
        d2t, t2d = build_mapping(select_draft_vocab(counts, draft_size), target_size)
    assert t2d is not None
    report.coverage = coverage_of(counts, t2d)
    write_vocab(args.out, d2t, t2d, report)
    metrics = {"coverage": report.coverage} if report.coverage is not None else {}
    progress.update(progress.total or 0, metrics, force=True)
    return report


def summary(report: VocabReport, out: Path) -> str:
    covered = ("coverage n/a (no data)" if report.coverage is None else
               f"coverage {100 * report.coverage:.2f}% of {report.tokens_counted:,} "
               f"counted tokens")
    lines = [f"{out}: draft vocab {report.draft_vocab_size:,} of {report.target_vocab_size:,} "
             f"target ids ({report.source}), {covered}, {report.distinct_tokens:,} distinct "
             f"ids in {report.samples:,} samples"]
    for what, skipped in (("malformed lines", report.skipped_lines),
                          ("files", report.skipped_files)):
        if skipped:
            named = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
            lines.append(f"skipped {len(skipped)} {what}: {named} (see {out}.json)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.verbose)
    try:
        report = run(args)
    except VocabError as exc:
        fail(str(exc))
        return
    print(summary(report, args.out))
    if report.samples_without_counted_tokens:
        log.warning("%d samples had no assistant tokens", report.samples_without_counted_tokens)


if __name__ == "__main__":
    main()
