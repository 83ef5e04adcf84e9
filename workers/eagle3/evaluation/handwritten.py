"""The hand-written held-out set: 80 single-turn questions written for this repository,
10 in each of MT-Bench's eight categories, that no training data the repository can
generate resembles (tests/test_handwritten.py checks them against every synthetic prompt
of workers/fixtures/prompts.py and the demo prompts).

Why it exists: the pipeline's own held-out prompts are the last lines of the prompts
file, drawn from the same generator as the training prompts (for the demo and the
benchmark: the same topics x task templates), so a draft that learnt the templates'
answers scores well on them without having learnt what users ask. These questions are
the other kind: writing, role-play, reasoning, maths, code, extraction from a passage,
science, humanities, in varied lengths and styles, answerable by a small chat model.
`workers.evaluate` scores them besides `--prompts` unless `--no-handwritten`, and reports
tau per category.

Records: `{"id": "hw-<category>-NN", "category", "messages": [{"role": "user", ...}]}`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workers.eagle3.evaluation.heldout import Prompt, TrainingPrompts, prompt_messages

log = logging.getLogger("workers.evaluate")

HANDWRITTEN_PROMPTS = Path(__file__).parent / "data" / "heldout_handwritten.jsonl"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")
"""MT-Bench's eight categories, in the order a limited selection takes them."""


class HandwrittenError(ValueError):
    """The shipped file is not what this module expects (a packaging or editing error)."""


@dataclass(frozen=True)
class Question:
    category: str
    prompt: Prompt


def read_handwritten(path: Path = HANDWRITTEN_PROMPTS) -> list[Question]:
    """Every question in file order. Unlike a user's prompts file, a bad line here is an
    error: the file ships with the code."""
    questions: list[Question] = []
    seen: set[str] = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise HandwrittenError(f"cannot read the hand-written set {path}: {exc}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise HandwrittenError(f"{path}:{number}: not JSON: {exc}") from None
        messages = prompt_messages(record) if isinstance(record, dict) else None
        category = record.get("category") if isinstance(record, dict) else None
        question_id = record.get("id") if isinstance(record, dict) else None
        if messages is None or category not in CATEGORIES or not isinstance(question_id, str):
            raise HandwrittenError(f"{path}:{number}: not an id, a category of "
                                   f"{', '.join(CATEGORIES)} and messages with a user turn")
        if question_id in seen:
            raise HandwrittenError(f"{path}:{number}: id {question_id} repeated")
        seen.add(question_id)
        questions.append(Question(category, Prompt(question_id, messages)))
    return questions


def stratified(questions: Sequence[Question], limit: int | None) -> list[Question]:
    """At most `limit` questions spread over the categories: the first question of each
    category (in `CATEGORIES` order), then the second of each, and so on, so that any
    limit takes every category's count within one of the others' (8: one each; 20: three
    in the first four categories, two in the rest). Returned in file order; None: all."""
    if limit is None or limit >= len(questions):
        return list(questions)
    by_category: dict[str, list[Question]] = {c: [] for c in CATEGORIES}
    for question in questions:
        by_category[question.category].append(question)
    chosen: set[str] = set()
    rank = 0
    while len(chosen) < limit:
        for category in CATEGORIES:
            if rank < len(by_category[category]) and len(chosen) < limit:
                chosen.add(by_category[category][rank].prompt.id)
        rank += 1
    return [q for q in questions if q.prompt.id in chosen]


@dataclass
class HandwrittenSelection:
    questions: list[Question]
    excluded: list[str] = field(default_factory=list)
    """Ids dropped because the training conversations hold their id or their text."""

    @property
    def prompts(self) -> list[Prompt]:
        return [q.prompt for q in self.questions]

    @property
    def categories(self) -> dict[str, str]:
        """Prompt id -> category."""
        return {q.prompt.id: q.category for q in self.questions}


def select_handwritten(training: TrainingPrompts, limit: int | None,
                       path: Path = HANDWRITTEN_PROMPTS) -> HandwrittenSelection:
    """The questions not seen in training (workers/eagle3/evaluation/heldout.py's rule: same id or
    text), then at most `limit` of them, stratified over the categories."""
    questions = read_handwritten(path)
    kept = [q for q in questions if q.prompt not in training]
    excluded = [q.prompt.id for q in questions if q.prompt in training]
    if excluded:
        log.warning("%d hand-written questions are in the training conversations and are "
                    "not scored: %s", len(excluded), ", ".join(excluded))
    return HandwrittenSelection(stratified(kept, limit), excluded)
