"""Several `workers.generate` outputs as one conversations file.

Each part is `workers.generate --self-prompts` with its own `--seed` (and share of the
count). Parallel parts are not faster on one GPU: four of batch 1,024 on an H100 answered
at ~4,300 new tokens/s each, ~17,000 together, with the GPU at 100 %, where one process of
batch 4,096 answered at 22,400 on an H200 (docs/benchmarks.md, #29's first and seventh
runs). What parts give is a set made of several seeds, and parts made apart (one per GPU
or machine) joined into one. Each part de-duplicates its own prompts; this joins the parts
in the order given and drops a conversation whose user prompt is an exact or near
duplicate (`self_prompts.Deduplicator`, as generate uses) of one kept from an earlier
part. Ids get their part's stem in front (`g1-self-000001`), so those of different parts
stay distinct.

    python bench/merge_generated.py --out /tmp/e3/generate/conversations.jsonl \
        /tmp/e3/g1/conversations.jsonl /tmp/e3/g2/conversations.jsonl

Prints what each part gave and the merged prompts' diversity, and writes the same as
`OUT_STEM.merge.json` beside the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.common import JsonlStats, read_jsonl  # noqa: E402
from workers.eagle3.generation.self_prompts import Deduplicator, distinct_n  # noqa: E402


def part_name(path: Path) -> str:
    """`g1` for .../g1/conversations.jsonl, the file's stem for any other name."""
    return path.parent.name if path.stem == "conversations" else path.stem


def user_prompt(record: dict[str, Any]) -> str:
    users = [m.get("content") or "" for m in record["messages"] if m.get("role") == "user"]
    return "\n".join(users)


def merge(parts: list[Path], out: Path) -> dict[str, Any]:
    names = [part_name(path) for path in parts]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: two parts would give their ids one prefix: {names}")
    dedup = Deduplicator()
    prompts: list[str] = []
    per_part = []
    tmp = out.with_name(f".{out.name}.part")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as file:
        for name, path in zip(names, parts, strict=True):
            counts = {"part": name, "read": 0, "kept": 0, "exact_duplicate": 0,
                      "near_duplicate": 0, "new_tokens": 0}
            for _, record in read_jsonl(path, JsonlStats(), required=("id", "messages")):
                counts["read"] += 1
                prompt = user_prompt(record)
                reason = dedup.offer(prompt)
                if reason is not None:
                    counts[reason] += 1
                    continue
                counts["kept"] += 1
                counts["new_tokens"] += int((record.get("usage") or {})
                                            .get("completion_tokens", 0))
                prompts.append(prompt)
                file.write(json.dumps({**record, "id": f"{name}-{record['id']}"},
                                      ensure_ascii=False) + "\n")
            per_part.append(counts)
    tmp.replace(out)
    summary = {"out": str(out), "parts": per_part, "conversations": len(prompts),
               "new_tokens": sum(p["new_tokens"] for p in per_part),
               "distinct_1": distinct_n(prompts, 1), "distinct_2": distinct_n(prompts, 2),
               "distinct_3": distinct_n(prompts, 3)}
    out.with_name(f"{out.stem}.merge.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", type=Path, nargs="+", help="workers.generate outputs")
    parser.add_argument("--out", type=Path, required=True, help="the merged conversations")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.parts if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    if any(p.resolve() == args.out.resolve() for p in args.parts):
        parser.error("--out is one of the parts")
    summary = merge(args.parts, args.out)
    print("| part | read | kept | exact duplicates | near duplicates | new tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for p in summary["parts"]:
        print(f"| {p['part']} | {p['read']:,} | {p['kept']:,} | {p['exact_duplicate']:,} | "
              f"{p['near_duplicate']:,} | {p['new_tokens']:,} |")
    print(f"\n{summary['conversations']:,} conversations, {summary['new_tokens']:,} new tokens; "
          f"prompts' distinct-1/2/3 {summary['distinct_1']:.3f} / {summary['distinct_2']:.3f}"
          f" / {summary['distinct_3']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
