"""The hand-written held-out set (workers/eagle3/evaluation/handwritten.py): balanced over the eight
categories, unique ids, single user turns; unlike every training prompt the repository
can generate; shipped as package data; a limit spreads over the categories; questions
seen in training are not scored."""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from workers.eagle3.evaluation.handwritten import (
    CATEGORIES,
    HANDWRITTEN_PROMPTS,
    HandwrittenError,
    read_handwritten,
    select_handwritten,
    stratified,
)
from workers.eagle3.evaluation.heldout import TrainingPrompts, read_prompts
from workers.fixtures import prompts as synthetic

ROOT = Path(__file__).resolve().parents[1]
DEMO_PROMPTS = ROOT / "workers" / "fixtures" / "data" / "demo_prompts.jsonl"
QUESTIONS = read_handwritten()
SHINGLE_WORDS = 5


def user_text(messages: list[dict[str, str]]) -> str:
    return " ".join(m["content"] for m in messages if m["role"] == "user")


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """Word n-grams of the lower-cased text, punctuation dropped."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def training_prompt_texts() -> list[str]:
    """Every prompt the repository can train on: all topic x task combinations of
    workers/fixtures/prompts.py (what the demo and the benchmark draw from) and the demo prompts."""
    texts = [task.format(t=topic) for topic in synthetic.TOPICS for task in synthetic.TASKS]
    return texts + [user_text(p.messages) for p in read_prompts(DEMO_PROMPTS)]


def test_ten_questions_in_each_category_with_unique_ids() -> None:
    assert len(QUESTIONS) == 80
    assert Counter(q.category for q in QUESTIONS) == dict.fromkeys(CATEGORIES, 10)
    ids = [q.prompt.id for q in QUESTIONS]
    assert len(set(ids)) == len(ids)
    for question in QUESTIONS:
        assert re.fullmatch(rf"hw-{question.category}-(0[1-9]|10)", question.prompt.id)
        [turn] = question.prompt.messages  # one user turn, no system prompt
        assert turn["role"] == "user" and len(turn["content"].split()) >= 3
        assert turn["content"].isascii()  # English, written here
    texts = [q.prompt.messages[0]["content"] for q in QUESTIONS]
    assert len(set(texts)) == len(texts)
    words = sorted(len(text.split()) for text in texts)
    assert words[0] <= 6 and words[-1] >= 40  # short questions and passages to work on


def test_no_question_resembles_a_training_prompt() -> None:
    """No hand-written question shares a single word 5-gram with any of the 2,958
    prompts the repository trains on (the 2,926 topic x task prompts of workers/fixtures/prompts.py,
    the 32 demo prompts). Why 5 words and zero: the templates' fixed parts are 3-9 words ("Explain
    {t} to a ten-year-old.", "What are the pros and cons of {t}?"), so a question built on
    one, or on a demo prompt, carries at least one of its 5-grams (the control below),
    while shorter n-grams are plain English: "what is the" is a shared 3-gram, and the
    set's one shared 4-gram is "what should I read" (a librarian role-play against "What
    should I read to learn more about {t}?"), a phrase and not the same request."""
    training: set[tuple[str, ...]] = set()
    for text in training_prompt_texts():
        training |= shingles(text)
    assert len(training) > 6000
    shared = {q.prompt.id: sorted(shingles(user_text(q.prompt.messages)) & training)
              for q in QUESTIONS}
    assert {qid: grams for qid, grams in shared.items() if grams} == {}
    # the control: light rewrites of training prompts are caught
    for near_copy in ("Could you explain photosynthesis to a ten-year-old, please?",
                      "My son asks: what are the pros and cons of solar panels?",
                      "Give three facts about the water cycle and its stages."):
        assert shingles(near_copy) & training, near_copy


def test_the_set_ships_as_package_data() -> None:
    """pyproject's package-data globs name both prompt files the workers read at run
    time (a wheel built from the checkout held neither before)."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]
    shipped = {path for package, globs in package_data.items() for pattern in globs
               for path in (ROOT / package.replace(".", "/")).glob(pattern)}
    assert HANDWRITTEN_PROMPTS in shipped and DEMO_PROMPTS in shipped


@pytest.mark.parametrize(("limit", "per_category"), [
    (8, [1] * 8), (16, [2] * 8), (20, [3, 3, 3, 3, 2, 2, 2, 2]), (3, [1, 1, 1, 0, 0, 0, 0, 0]),
    (80, [10] * 8), (500, [10] * 8), (None, [10] * 8)])
def test_a_limit_spreads_over_the_categories(limit: int | None,
                                             per_category: list[int]) -> None:
    chosen = stratified(QUESTIONS, limit)
    counts = Counter(q.category for q in chosen)
    assert [counts[c] for c in CATEGORIES] == per_category
    # each category's first questions, in file order: the same subset every run
    assert [q.prompt.id for q in chosen] == [
        q.prompt.id for q in QUESTIONS
        if int(q.prompt.id.rsplit("-", 1)[1]) <= per_category[CATEGORIES.index(q.category)]]


def test_questions_seen_in_training_are_not_scored(tmp_path: Path) -> None:
    """workers/eagle3/evaluation/heldout.py's rule: a question whose id or text is in the training
    conversations is dropped, and the limit takes the next one of its category."""
    by_id = {q.prompt.id: q for q in QUESTIONS}
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "p00007", "messages": [*by_id["hw-math-01"].prompt.messages,
                                      {"role": "assistant", "content": "$21"}]},
        {"id": "hw-stem-01", "messages": [{"role": "user", "content": "other text"}]},
    ]))
    chosen = select_handwritten(TrainingPrompts(conversations), 8)
    assert chosen.excluded == ["hw-math-01", "hw-stem-01"]
    assert [p.id for p in chosen.prompts] == [
        "hw-writing-01", "hw-roleplay-01", "hw-reasoning-01", "hw-math-02", "hw-coding-01",
        "hw-extraction-01", "hw-stem-02", "hw-humanities-01"]
    assert chosen.categories["hw-math-02"] == "math"
    assert len(select_handwritten(TrainingPrompts(None), None).prompts) == 80


def test_a_broken_file_is_an_error_not_a_smaller_set(tmp_path: Path) -> None:
    broken = tmp_path / "set.jsonl"
    broken.write_text(json.dumps({"id": "hw-x-01", "category": "poetry", "messages": [
        {"role": "user", "content": "A question."}]}) + "\n")
    with pytest.raises(HandwrittenError, match="set.jsonl:1: not an id, a category"):
        read_handwritten(broken)
    line = HANDWRITTEN_PROMPTS.read_text().splitlines()[0]
    broken.write_text(line + "\n" + line + "\n")
    with pytest.raises(HandwrittenError, match="id hw-writing-01 repeated"):
        read_handwritten(broken)
