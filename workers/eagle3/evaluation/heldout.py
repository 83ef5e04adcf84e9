"""Held-out prompts for `workers.evaluate`: JSONL records with `messages` or
`conversations` (`role`/`content`, or ShareGPT's `from`/`value`), read as
`workers.generate` reads them (`workers.common.record_messages`), cut before their
trailing assistant turns (so a conversations file serves too); `--skip`/`--limit`; and
the exclusion of every prompt whose id or text is in the training conversations, so no
prompt the draft was trained on is scored."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.common import JsonlStats, chat_messages, read_jsonl, record_messages

log = logging.getLogger("workers.evaluate")


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]

    @property
    def key(self) -> str:
        return json.dumps(self.messages, sort_keys=True)


def prompt_messages(record: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The record's turns up to its last non-assistant one, or None if it has none."""
    try:
        normalized = list(record_messages(record))
    except ValueError:
        return None
    if not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in normalized):
        return None
    while normalized and normalized[-1]["role"] == "assistant":
        normalized.pop()
    return chat_messages(normalized) if normalized else None


def read_prompts(path: Path) -> Iterator[Prompt]:
    """Usable prompts in file order; a repeated id keeps its first line."""
    seen: set[str] = set()
    stats = JsonlStats()
    for number, record in read_jsonl(path, stats):
        messages = prompt_messages(record)
        prompt_id = str(record.get("id", f"line-{number}"))
        if messages is None:
            log.warning("%s: line %d: no messages/conversations with a user turn; skipped",
                        path, number)
        elif prompt_id not in seen:
            seen.add(prompt_id)
            yield Prompt(prompt_id, messages)


@dataclass
class Selection:
    prompts: list[Prompt]
    skipped: int = 0
    excluded: list[str] = field(default_factory=list)
    """Ids dropped because the training conversations hold their id or their text."""


class TrainingPrompts:
    """The prompts of the training conversations, by id and by text: what must not be
    scored. Built from `--exclude` (None: nothing excluded)."""

    def __init__(self, conversations: Path | None) -> None:
        self.ids: set[str] = set()
        self.texts: set[str] = set()
        if conversations is not None:
            for prompt in read_prompts(conversations):
                self.ids.add(prompt.id)
                self.texts.add(prompt.key)

    def __contains__(self, prompt: Prompt) -> bool:
        return prompt.id in self.ids or prompt.key in self.texts


def select_prompts(path: Path, *, skip: int, limit: int | None,
                   exclude: Path | TrainingPrompts | None) -> Selection:
    training = exclude if isinstance(exclude, TrainingPrompts) else TrainingPrompts(exclude)
    selection = Selection([])
    for index, prompt in enumerate(read_prompts(path)):
        if index < skip:
            selection.skipped += 1
        elif prompt in training:
            selection.excluded.append(prompt.id)
        else:
            selection.prompts.append(prompt)
            if limit is not None and len(selection.prompts) >= limit:
                break
    return selection
