"""Prompts the target writes itself (Magpie, 2024): for a user with no dataset.

An aligned chat model given its own chat template up to the start of a user turn's
content (the *pre-query template*) writes a realistic user request and closes the turn
with the template's end-of-turn token. `workers.generate --self-prompts N` samples such
requests, throws away what is unusable (`rejection_reason`) and what repeats
(`Deduplicator`: exact after normalising case and whitespace, near through MinHash/LSH
over character shingles), appends the accepted ones to a prompts file beside its output,
and then answers them as it answers any prompts file. With `--prompt-openers`, most
turns start with a request's first words (`openers.py`) and the target writes the rest.

The sampling is seeded per batch from `--seed` and the number of samples drawn before
it (across runs: the summary file keeps the count), so a run is reproducible and a
rerun resumes: it keeps the accepted prompts, de-duplicates against them, and samples
only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workers.common import JsonlStats, ProgressReporter, read_jsonl, write_json
from workers.eagle3.generation.generate_output import OutputFile

log = logging.getLogger("workers.generate")  # one log for the whole generate worker

SENTINEL = "\x00SELF-PROMPT-SENTINEL\x00"
"""A user message no template changes; the rendered text is cut where it starts."""
REJECTION_REASONS = ("empty", "truncated", "template_debris", "other_language", "too_short",
                     "exact_duplicate", "near_duplicate")
"""Every reason a sample is rejected for, in the order they are checked."""
ROLE_NAMES = ("user", "assistant", "system", "human", "gpt", "bot", "ai", "model")
NEAR_DUPLICATE_JACCARD = 0.7
"""Two prompts whose character-shingle sets overlap at least this much are one prompt
asked twice (a changed word or punctuation mark); Magpie's own filter sits near it."""
SHINGLE_CHARS = 5
"""Character n-grams of the normalised text: robust for prompts of a few words, where a
changed word removes most of a sentence's word 3-grams."""
LSH_BANDS, LSH_ROWS = 25, 5
"""125 MinHash values in 25 bands of 5: a pair shares a band with probability
1-(1-J^5)^25: 0.99 at Jaccard J = 0.7, 0.99995 at 0.8, 0.55 at 0.5, 0.06 at 0.3. Every
candidate is then checked against the exact Jaccard, so a false candidate costs a set
intersection, never a wrong rejection."""
MERSENNE_PRIME = (1 << 61) - 1
MAX_SEED = (1 << 63) - 1


# -- the template ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PreQueryTemplate:
    text: str
    """The rendered template up to the start of the user's content (a default system
    prompt the template inserts included): what the model continues."""
    end_of_turn: str
    """The special token that closes a user turn (`<|im_end|>`, `<|eot_id|>`)."""
    end_of_turn_id: int


def pre_query_template(tokenizer: Any) -> PreQueryTemplate:
    """The tokenizer's chat template rendered for one user message, cut at its content.
    Raises ValueError when the template has none or does not show the message verbatim,
    or when no special token follows the message."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}],
                                             tokenize=False)
    start = rendered.find(SENTINEL)
    if start < 0:
        raise ValueError("the chat template does not render a user message verbatim")
    after = rendered[start + len(SENTINEL):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special}
    if not ids or ids[0] not in special:
        raise ValueError(f"no special token ends a user turn in the chat template (after "
                         f"the message it renders {after[:40]!r})")
    return PreQueryTemplate(rendered[:start], tokenizer.convert_ids_to_tokens(ids[0]), ids[0])


def template_markers(tokenizer: Any) -> list[str]:
    """Text that never belongs inside a user's request: every special and added token
    of the tokenizer (`<|im_start|>`, `<|user|>`, `</s>`)."""
    tokens = set(tokenizer.all_special_tokens)
    tokens |= {str(token) for token in tokenizer.added_tokens_decoder.values()}
    return sorted(token for token in tokens if token.strip())


# -- filters --------------------------------------------------------------------------------

GENERIC_MARKERS = ("<|", "|>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "<s>", "</s>",
                   "### Instruction", "### Response", "<start_of_turn>", "<end_of_turn>")
"""Role markers of common templates, caught whatever this tokenizer's own tokens are."""
ROLE_ALTERNATIVES = "|".join(ROLE_NAMES)
ROLE_AT_START = re.compile(rf"^\s*(?:{ROLE_ALTERNATIVES})\s*(?::|\n|$)", re.IGNORECASE)
ROLE_LINE = re.compile(rf"\n\s*(?:{ROLE_ALTERNATIVES})\s*:", re.IGNORECASE)
"""A later line naming a speaker: the model wrote a dialogue, not a request."""


@dataclass(frozen=True)
class FilterSettings:
    min_words: int = 3
    min_latin_share: float = 0.5
    """Of the letters: below it the prompt is in another script (Cyrillic, CJK, ...)."""
    markers: tuple[str, ...] = GENERIC_MARKERS


def latin_share(text: str) -> float | None:
    """Share of the letters that are Latin script; None for a text with no letters."""
    letters = latin = 0
    for char in text:
        if not char.isalpha():
            continue
        letters += 1
        if char.isascii() or unicodedata.name(char, "").startswith("LATIN"):
            latin += 1
    return latin / letters if letters else None


def rejection_reason(text: str, *, ended: bool, settings: FilterSettings) -> str | None:
    """Why a sampled user turn is unusable, or None. `ended`: the model closed the turn
    within the token limit (else it is truncated)."""
    stripped = text.strip()
    if not stripped:
        return "empty"
    if not ended:
        return "truncated"
    if (any(marker in stripped for marker in settings.markers)
            or ROLE_AT_START.match(stripped) or ROLE_LINE.search(stripped)):
        return "template_debris"
    share = latin_share(stripped)
    if share is not None and share < settings.min_latin_share:
        return "other_language"
    if len(stripped.split()) < settings.min_words:
        return "too_short"
    return None


# -- de-duplication -------------------------------------------------------------------------

def normalize(text: str) -> str:
    """Case folded, whitespace runs as one space: what an exact duplicate compares."""
    return " ".join(text.casefold().split())


def shingles(normalized: str) -> set[int]:
    """32-bit hashes of the character n-grams (the whole text when shorter)."""
    grams = {normalized[i:i + SHINGLE_CHARS]
             for i in range(max(1, len(normalized) - SHINGLE_CHARS + 1))}
    return {zlib.crc32(gram.encode()) for gram in grams}


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


@dataclass(frozen=True)
class Fingerprint:
    normalized: str
    shingles: set[int]
    signature: np.ndarray
    band_keys: list[bytes]


class Deduplicator:
    """Keeps the first of each group of equal or near-equal texts, in the order seen.

    Exact: the normalised text in a set. Near: a MinHash signature (LSH_BANDS x LSH_ROWS
    hash functions ((a*x + b) mod 2^61-1) mod 2^32 over the shingle hashes, drawn from a fixed seed,
    so a run is deterministic) put in one bucket per band. A text sharing a bucket with
    a kept one is compared with it: first by the signatures (the share of equal values
    estimates the Jaccard; far below the threshold ends it), then by the exact Jaccard
    of the shingle sets, which decides."""

    ESTIMATE_MARGIN = 0.15
    """An estimate from 125 values has a standard deviation of ~0.04 near 0.7: a pair
    estimated 0.15 below the threshold is not checked exactly."""

    def __init__(self, threshold: float = NEAR_DUPLICATE_JACCARD):
        self.threshold = threshold
        rng = np.random.default_rng(0x5E1F)
        size = LSH_BANDS * LSH_ROWS
        # a, b drawn below the prime, as datasketch's MinHash does: a*x + b wraps in
        # uint64, which keeps it a good permutation; a, b < 2^32 instead (no wrap) bias
        # the estimate low (0.59 for a pair at Jaccard 0.74, measured)
        self._a = rng.integers(1, MERSENNE_PRIME, size=size, dtype=np.uint64)
        self._b = rng.integers(0, MERSENNE_PRIME, size=size, dtype=np.uint64)
        self._exact: set[str] = set()
        self._shingles: list[set[int]] = []
        self._signatures = np.zeros((1024, size), dtype=np.uint64)  # grown by doubling
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(LSH_BANDS)]

    def __len__(self) -> int:
        return len(self._shingles)

    def fingerprint(self, text: str) -> Fingerprint:
        normalized = normalize(text)
        hashes = shingles(normalized)
        values = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))[:, None]
        permuted = (values * self._a + self._b) % np.uint64(MERSENNE_PRIME)
        signature = (permuted & np.uint64(0xFFFFFFFF)).min(axis=0)
        bands = signature.reshape(LSH_BANDS, LSH_ROWS)
        return Fingerprint(normalized, hashes, signature, [band.tobytes() for band in bands])

    def check(self, text: str | Fingerprint) -> str | None:
        """"exact_duplicate" or "near_duplicate" of a kept text, or None."""
        fp = text if isinstance(text, Fingerprint) else self.fingerprint(text)
        if fp.normalized in self._exact:
            return "exact_duplicate"
        candidates: set[int] = set()
        for key, buckets in zip(fp.band_keys, self._buckets, strict=True):
            candidates.update(buckets.get(key, ()))
        if not candidates:
            return None
        indices = np.fromiter(candidates, dtype=np.int64, count=len(candidates))
        estimates = (self._signatures[indices] == fp.signature).mean(axis=1)
        likely = indices[estimates >= self.threshold - self.ESTIMATE_MARGIN]
        if any(jaccard(fp.shingles, self._shingles[i]) >= self.threshold for i in likely):
            return "near_duplicate"
        return None

    def add(self, text: str | Fingerprint) -> None:
        fp = text if isinstance(text, Fingerprint) else self.fingerprint(text)
        index = len(self._shingles)
        if index == len(self._signatures):
            self._signatures = np.concatenate([self._signatures,
                                               np.zeros_like(self._signatures)])
        self._exact.add(fp.normalized)
        self._shingles.append(fp.shingles)
        self._signatures[index] = fp.signature
        for key, buckets in zip(fp.band_keys, self._buckets, strict=True):
            buckets.setdefault(key, []).append(index)

    def offer(self, text: str) -> str | None:
        """`check`, and keep the text when it is no duplicate."""
        fp = self.fingerprint(text)
        reason = self.check(fp)
        if reason is None:
            self.add(fp)
        return reason


# -- the summary ----------------------------------------------------------------------------

def distinct_n(texts: Iterable[str], n: int) -> float:
    """Distinct word n-grams / all word n-grams over the texts (0 when there are none)."""
    grams: Counter[tuple[str, ...]] = Counter()
    for text in texts:
        words = normalize(text).split()
        grams.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0


@dataclass
class SelfPromptStats:
    """Counters across runs (a rerun starts from the last summary's). Samples a batch
    drew beyond the prompts still missing are not looked at, nor counted."""

    sampled: int = 0
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def summary(self, prompts: Sequence[str], **context: Any) -> dict[str, Any]:
        sampled = max(self.sampled, 1)
        return {
            "sampled": self.sampled, "accepted": self.accepted,
            "rejected": {reason: self.rejected[reason] for reason in REJECTION_REASONS},
            "exact_duplicate_share": self.rejected["exact_duplicate"] / sampled,
            "near_duplicate_share": self.rejected["near_duplicate"] / sampled,
            "prompts_in_file": len(prompts),
            "distinct_1": distinct_n(prompts, 1), "distinct_2": distinct_n(prompts, 2),
            "distinct_3": distinct_n(prompts, 3),
            "mean_prompt_words": (sum(len(p.split()) for p in prompts) / len(prompts)
                                  if prompts else 0.0),
            "mean_prompt_chars": (sum(len(p) for p in prompts) / len(prompts)
                                  if prompts else 0.0),
            **context}


def read_stats(summary_path: Path) -> SelfPromptStats:
    try:
        data = json.loads(summary_path.read_text(encoding="utf-8"))
        return SelfPromptStats(int(data["sampled"]), int(data["accepted"]),
                               Counter({k: int(v) for k, v in data["rejected"].items()}))
    except FileNotFoundError:
        return SelfPromptStats()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("%s is unreadable (%s); counting from zero", summary_path, exc)
        return SelfPromptStats()


# -- collecting -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    text: str
    ended: bool
    """The model closed the turn (end-of-turn or end-of-sequence) within the limit."""


Sampler = Callable[[int, int], list[Sample]]
"""(how many, seed) -> that many samples; the same seed gives the same samples."""


class SelfPromptsIncomplete(Exception):
    """The sampling bound was reached with fewer prompts accepted than asked for."""


def prompts_path(out: Path) -> Path:
    """`conv.jsonl` -> `conv.self_prompts.jsonl`, beside it."""
    return out.with_name(f"{out.stem}.self_prompts.jsonl")


def summary_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}.self_prompts.summary.json")


def batch_seed(seed: int, sampled_before: int) -> int:
    """The seed of the batch that starts after `sampled_before` samples."""
    digest = hashlib.sha256(f"{seed}:{sampled_before}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


def round_size(missing: int, stats: SelfPromptStats) -> int:
    """Samples a round draws for `missing` prompts: by the acceptance seen so far (a half
    before any), with a tenth to spare."""
    rate = stats.accepted / stats.sampled if stats.sampled and stats.accepted else 0.5
    return math.ceil(missing / max(rate, 0.02) * 1.1)


@dataclass(frozen=True)
class CollectSettings:
    target: int
    batch_size: int
    seed: int
    max_rounds: int
    filters: FilterSettings = FilterSettings()


def read_accepted(path: Path) -> list[tuple[str, str]]:
    """(id, user text) of each prompt already in the file, in file order."""
    if not path.exists():
        return []
    accepted = []
    for number, record in read_jsonl(path, JsonlStats(), required=("id", "messages")):
        messages = record["messages"]
        if (isinstance(messages, list) and messages and isinstance(messages[-1], dict)
                and isinstance(messages[-1].get("content"), str)):
            accepted.append((str(record["id"]), messages[-1]["content"]))
        else:
            log.warning("%s: line %d is not a prompt; ignored", path, number)
    return accepted


def collect(out: Path, sampler: Sampler, settings: CollectSettings,
            reporter: ProgressReporter, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """Sample until `settings.target` prompts are in `prompts_path(out)` (or the round
    bound is reached: SelfPromptsIncomplete); returns the summary, also written to
    `summary_path(out)` after every batch (what a rerun resumes its counts from)."""
    path, summary_file = prompts_path(out), summary_path(out)
    file = OutputFile(path)  # locked; a torn last line cut away
    try:
        accepted = read_accepted(path)
        stats = read_stats(summary_file)
        stats.accepted = len(accepted)
        dedup = Deduplicator()
        for _, text in accepted:
            dedup.offer(text)
        texts = [text for _, text in accepted]
        ids = {prompt_id for prompt_id, _ in accepted}
        extra = {"settings": context or {}, "target": settings.target}

        def report(force: bool = False) -> None:
            reporter.update(len(texts), {
                "sampled": stats.sampled, "rejected": sum(stats.rejected.values()),
                "acceptance_rate": stats.accepted / max(stats.sampled, 1)}, force=force)

        if len(texts) >= settings.target:
            log.info("%d self prompts already in %s; none to sample", len(texts), path)
        rounds = 0
        while len(texts) < settings.target:
            if rounds == settings.max_rounds:
                write_json(summary_file, stats.summary(texts, **extra))
                rejected = ", ".join(f"{reason} {count}" for reason, count
                                     in stats.rejected.most_common() if count) or "none"
                raise SelfPromptsIncomplete(
                    f"{len(texts)} of {settings.target} self prompts accepted after "
                    f"{rounds} rounds ({stats.sampled} sampled; rejected: {rejected}); "
                    "rerun to go on, or raise --max-rounds")
            rounds += 1
            budget = round_size(settings.target - len(texts), stats)
            log.info("self prompts round %d: %d accepted of %d, sampling up to %d", rounds,
                     len(texts), settings.target, budget)
            while budget > 0 and len(texts) < settings.target:
                count = min(settings.batch_size, budget)
                batch = sampler(count, batch_seed(settings.seed, stats.sampled))
                budget -= count
                for sample in batch:
                    if len(texts) >= settings.target:  # the batch's surplus: not counted
                        break
                    stats.sampled += 1
                    reason = rejection_reason(sample.text, ended=sample.ended,
                                              settings=settings.filters)
                    if reason is None:
                        reason = dedup.offer(sample.text)
                    if reason is not None:
                        stats.rejected[reason] += 1
                        continue
                    text = sample.text.strip()
                    prompt_id = f"self-{len(texts):06d}"
                    while prompt_id in ids:
                        prompt_id += "+"
                    ids.add(prompt_id)
                    file.append({"id": prompt_id,
                                 "messages": [{"role": "user", "content": text}]})
                    texts.append(text)
                    stats.accepted += 1
                write_json(summary_file, stats.summary(texts, **extra))
                report()
        summary = stats.summary(texts, **extra)
        write_json(summary_file, summary)
        report(force=True)
        return summary
    finally:
        file.close()


# -- the transformers sampler ---------------------------------------------------------------

@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    openers: tuple[str, ...] = ()
    """First words of the user turn the target goes on from (`openers.read_openers`);
    none: every turn from the bare pre-query template."""
    free_prompt_share: float = 1.0
    """The share of samples with no opener (1.0 where there are none)."""


def pick_openers(count: int, seed: int, settings: SamplingSettings) -> list[str]:
    """The opener of each of a batch's `count` samples ("" for none), drawn from the
    batch's seed: a rerun draws the same."""
    if not settings.openers:
        return [""] * count
    rng = np.random.default_rng(seed)
    free = rng.random(count) < settings.free_prompt_share
    chosen = rng.integers(len(settings.openers), size=count)
    return ["" if f else settings.openers[i] for f, i in zip(free, chosen, strict=True)]


def written_text(tokenizer: Any, prefix: list[int], opener: str, continued: list[int]) -> str:
    """The user turn of a sample: its opener and what the model wrote after it
    (`continued`, the tokens after `prefix`, the template and opener's tokens), decoded
    with special tokens. The continuation is decoded after its prefix and cut from it:
    decoded alone, a SentencePiece (Metaspace) tokenizer drops the space it starts with
    ("Write a poem" + "about the sea"). Empty when the model added nothing to the
    opener: no prompt of its own."""
    if not opener:
        return str(tokenizer.decode(continued, skip_special_tokens=False))
    before = tokenizer.decode(prefix, skip_special_tokens=False)
    whole = tokenizer.decode(prefix + continued, skip_special_tokens=False)
    written = (whole[len(before):] if whole.startswith(before)
               else tokenizer.decode(continued, skip_special_tokens=False))
    return opener + written if written.strip() else ""


def transformers_sampler(model: Any, tokenizer: Any, template: PreQueryTemplate,
                         settings: SamplingSettings, device: Any, decoder: Any = None,
                         ) -> Sampler:
    """Continuations of the pre-query template (and of each sample's opener) by a loaded
    HF causal LM, decoded with their special tokens (so the filters see template debris);
    a sample's text is its opener and the continuation (empty where the continuation is).
    Samples of different openers are left-padded into one batch. Decoded by `decoder`
    (a `static_decode.StaticDecoder`) where given, else by transformers' `generate`."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stop_ids = {template.end_of_turn_id} | (set(eos) if isinstance(eos, list) else {eos})
    stop_ids.discard(None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_ids)
    options: dict[str, Any] = {"max_new_tokens": settings.max_new_tokens,
                               "eos_token_id": sorted(stop_ids), "pad_token_id": pad,
                               "do_sample": settings.temperature > 0}
    if settings.temperature > 0:
        options.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
    options["repetition_penalty"] = 1.0  # the flags alone, not the model's own settings
    encoded: dict[str, list[int]] = {}

    def tokens_of(opener: str) -> list[int]:
        if opener not in encoded:
            encoded[opener] = tokenizer(template.text + opener,
                                        add_special_tokens=False)["input_ids"]
        return encoded[opener]

    def continuations(rows: list[list[int]], seed: int) -> list[list[int]]:
        if decoder is not None:
            from workers.eagle3.generation.static_decode import Sampling

            sampling = (Sampling(settings.temperature, settings.top_p, seed)
                        if settings.temperature > 0 else None)
            tokens: list[list[int]] = decoder.generate(
                rows, max_new_tokens=settings.max_new_tokens, stop_ids=stop_ids,
                sampling=sampling)
            return tokens
        width = max(map(len, rows))
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows],
                            device=device)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, **options)
        continued: list[list[int]] = out[:, width:].tolist()
        return continued

    def sample(count: int, seed: int) -> list[Sample]:
        openers = pick_openers(count, seed, settings)
        rows = [tokens_of(opener) for opener in openers]
        samples = []
        for opener, tokens in zip(openers, continuations(rows, seed), strict=True):
            stop = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
            kept = tokens if stop is None else tokens[:stop]
            samples.append(Sample(written_text(tokenizer, tokens_of(opener), opener, kept),
                                  stop is not None))
        return samples

    return sample
