"""The draft vocabulary's mapping and its file: `d2t` (int64 [N]: draft id i is target id
i + d2t[i]) and `t2d` (bool [V]: true at the chosen target ids), chosen from token counts,
checked for consistency, read back from a draft checkpoint or a vocab file and written
with its `<out>.json` report. Pure tensor and file functions, no counting or CLI: the
vocab worker writes the mapping and the trainer reads it back, and neither should pull
in the other's code to agree on the format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from workers.common import replace_file


class VocabError(Exception):
    """A user mistake or unusable input; the CLI prints it as `error: ...`, exit 2."""


@dataclass
class VocabReport:
    """What `<out>.json` holds."""

    draft_vocab_size: int
    target_vocab_size: int
    coverage: float | None
    """Share of counted tokens whose id is in the draft vocabulary; None if none counted."""
    tokens_counted: int
    distinct_tokens: int
    samples: int
    skipped_lines: list[int] = field(default_factory=list)
    """JSONL line numbers (1-based) skipped as malformed."""
    skipped_files: list[str] = field(default_factory=list)
    """Extracted files (relative to --data) skipped as unreadable or malformed."""
    truncated_samples: int = 0
    samples_without_counted_tokens: int = 0
    source: str = "counted"
    data: str | None = None
    checkpoint: str | None = None


# -- the mapping (pure tensor functions) ------------------------------------------------

def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` ids with the highest counts, ties by lower id, sorted
    ascending. Ids never seen sort after every seen one in id order, so fewer distinct
    ids than asked are filled with the smallest unused ids."""
    if not 0 < draft_vocab_size <= counts.numel():
        raise VocabError(f"draft vocab size {draft_vocab_size} must be between 1 and the "
                         f"target vocab size {counts.numel()}")
    # a stable sort keeps equal counts in ascending id order (topk guarantees no order)
    order = torch.sort(counts, descending=True, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def build_mapping(used: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
    """(d2t, t2d) for the ascending target ids `used`: target id = i + d2t[i]."""
    d2t = used.to(torch.int64) - torch.arange(used.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def validate_mapping(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    if d2t.dim() != 1 or t2d.dim() != 1:
        raise VocabError(f"{where}: d2t and t2d must be 1-D, got shapes "
                         f"{list(d2t.shape)} and {list(t2d.shape)}")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or t2d.dtype != torch.bool:
        raise VocabError(f"{where}: d2t must be integer and t2d bool, got {d2t.dtype} and "
                         f"{t2d.dtype}")
    chosen = int(t2d.sum())
    if chosen != d2t.numel():
        raise VocabError(f"{where}: inconsistent mapping: t2d marks {chosen} target ids but "
                         f"d2t has {d2t.numel()} entries")
    used = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    if not torch.equal(used, torch.nonzero(t2d).reshape(-1)):
        raise VocabError(f"{where}: inconsistent mapping: the target ids i + d2t[i] are not "
                         "the ids where t2d is true (in ascending order)")


def coverage_of(counts: torch.Tensor, t2d: torch.Tensor) -> float | None:
    total = int(counts.sum())
    return int(counts[t2d].sum()) / total if total else None


# -- files ------------------------------------------------------------------------------

def _find_tensor(path: Path, keys: list[str], name: str) -> str | None:
    exact = [k for k in keys if k == name]
    suffixed = [k for k in keys if k.endswith(f".{name}")]
    if exact or len(suffixed) == 1:
        return (exact or suffixed)[0]
    if len(suffixed) > 1:
        raise VocabError(f"{path}: several tensors could be {name!r}: {', '.join(suffixed)}")
    return None


def load_mapping(path: Path) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(d2t, t2d, lm_head rows or None) from a draft checkpoint directory or a vocab file
    written by this worker; validated for internal consistency."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    found: dict[str, torch.Tensor] = {}
    lm_head_rows = None
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                for name in ("d2t", "t2d"):
                    key = _find_tensor(file, keys, name)
                    if key is not None and name not in found:
                        found[name] = f.get_tensor(key)
                head = _find_tensor(file, keys, "lm_head.weight")
                if head is not None:
                    lm_head_rows = int(f.get_slice(head).get_shape()[0])
        except VocabError:
            raise
        except Exception as exc:
            raise VocabError(f"{file}: not a readable safetensors file: {exc}") from exc
    if len(found) < 2:
        hint = (" (pickled .bin checkpoints are not read: save the draft as safetensors)"
                if path.is_dir() and any(path.glob("*.bin")) else "")
        missing = " and ".join(n for n in ("d2t", "t2d") if n not in found)
        raise VocabError(f"{path}: no {missing} tensor in its safetensors files{hint}")
    d2t, t2d = found["d2t"], found["t2d"]
    if t2d.dtype != torch.bool and not t2d.dtype.is_floating_point and t2d.dim() == 1 \
            and bool(((t2d == 0) | (t2d == 1)).all()):
        t2d = t2d.bool()
    validate_mapping(d2t, t2d, str(path))
    if lm_head_rows is not None and lm_head_rows != d2t.numel():
        raise VocabError(f"{path}: lm_head has {lm_head_rows} rows but d2t has "
                         f"{d2t.numel()} entries")
    return d2t.to(torch.int64), t2d, lm_head_rows


def write_vocab(out: Path, d2t: torch.Tensor, t2d: torch.Tensor, report: VocabReport) -> Path:
    """Writes `out` (d2t, t2d) and `<out>.json` (the report), each temp + rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}
    replace_file(out, save(tensors, metadata={"format": "pt"}), fsync=True)
    report_path = out.with_name(out.name + ".json")
    text = json.dumps(asdict(report), indent=2) + "\n"
    replace_file(report_path, text.encode("utf-8"), fsync=True)
    return report_path
