"""workers.evaluate over a prompts file in parallel shards, summed into one table.

`workers.evaluate` decodes one prompt at a time: on SmolLM2-135M the GPU idles between
small kernels and 80 hand-written questions at k = 3 and 5 take ~11 minutes on an H200
(~2.8 s per prompt per decode). The prompts do not depend on each other, so N processes
each take a slice (`--skip`/`--limit`) and the totals are summed afterwards: draft passes,
emitted tokens and tries/acceptances per draft position, per k and for the untrained
baseline, plus the lossless comparison's counts. The sums are exactly what one process
over the whole file would report (each prompt's decode is the same either way); the
rows per category, by opener and by length (answers cut at `--max-new-tokens` against
answers that end before it) weight each prompt by its generated tokens.

    python bench/eval_shards.py --target /tmp/smollm2 --draft /tmp/w/M/train/draft \
        --out /tmp/w/M/eval_hw --shards 8 -- -k3 -k5 --max-new-tokens 96 --dtype fp32

Without `--prompts` the repository's hand-written questions are split (file order is
by category, so 8 shards of 80 are one category each). Arguments after `--` go to every
`workers.evaluate`. Prints a markdown table and writes `summary.json` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.eagle3.evaluation.heldout import read_prompts  # noqa: E402
from workers.eagle3.generation.openers import BUILTIN, starts_with_opener  # noqa: E402

HANDWRITTEN = REPO / "workers" / "eagle3" / "evaluation" / "data" / "heldout_handwritten.jsonl"


def count_prompts(path: Path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def run_shards(args: argparse.Namespace, extra: list[str]) -> list[Path]:
    total = min(count_prompts(args.prompts), args.limit or math.inf)
    size = math.ceil(total / args.shards)
    procs, reports = [], []
    for i in range(args.shards):
        skip = i * size
        if skip >= total:
            break
        out = args.out / f"shard-{i}"
        out.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "workers.evaluate", "--target", str(args.target),
                "--draft", str(args.draft), "--out", str(out), "--prompts", str(args.prompts),
                "--skip", str(skip), "--limit", str(min(size, total - skip)),
                "--no-handwritten", *extra]
        log = open(out / "evaluate.log", "w")  # noqa: SIM115 (closed when it ends)
        procs.append((subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT),
                      log, out))
    failed = []
    for proc, log, out in procs:
        code = proc.wait()
        log.close()
        if code != 0:
            failed.append(f"{out}: exit {code}\n{(out / 'evaluate.log').read_text()[-2000:]}")
        else:
            reports.append(out / "eval.json")
    if failed:
        raise SystemExit("\n".join(failed))
    return reports


def add(total: dict[str, Any], run: dict[str, Any]) -> None:
    total["passes"] = total.get("passes", 0) + run["passes"]
    total["emitted"] = total.get("emitted", 0) + run["emitted"]
    for key in ("tried_by_position", "accepted_by_position"):
        mine = total.setdefault(key, [])
        for i, value in enumerate(run[key]):
            if i < len(mine):
                mine[i] += value
            else:
                mine.append(value)


def finish(total: dict[str, Any]) -> dict[str, Any]:
    tried, accepted = total["tried_by_position"], total["accepted_by_position"]
    return {**total, "acceptance_length": total["emitted"] / total["passes"],
            "acceptance_rate": [a / t if t else None for a, t in zip(accepted, tried,
                                                                      strict=True)]}


def opening_questions(path: Path) -> dict[str, str]:
    """{prompt id: the builtin opener its first user turn starts with} for the prompts
    that start with one (`workers.generate --prompt-openers builtin` wrote training
    prompts from those words, so those questions are reported apart)."""
    found = {}
    for prompt in read_prompts(path):
        text = next(m["content"] for m in prompt.messages if m["role"] == "user")
        if (opener := starts_with_opener(text, BUILTIN)) is not None:
            found[prompt.id] = opener
    return found


REACH, END = "reach the token budget", "end on their own"
"""`summary.json`'s `by_length` groups: answers cut at `--max-new-tokens` (a small target
fills a long budget mostly by repeating itself, which a draft predicts well) and answers
that stop before it."""


def group_taus(pairs_by_k: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """tau per k of a group of prompts: their tokens over their passes."""
    return {k: sum(t for t, _ in pairs) / sum(p for _, p in pairs)
            for k, pairs in pairs_by_k.items()}


def summarize(reports: list[Path], opening: dict[str, str] | None = None) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = defaultdict(dict)
    lossless = {"runs_compared": 0, "identical": 0, "failures": 0, "near_ties": 0}
    categories: dict[str, dict[str, list[tuple[int, float]]]] = \
        defaultdict(lambda: defaultdict(list))
    by_opener: dict[str, dict[str, list[tuple[int, float]]]] = \
        defaultdict(lambda: defaultdict(list))
    by_length: dict[str, dict[str, list[tuple[int, float]]]] = \
        defaultdict(lambda: defaultdict(list))
    counts: dict[str, int] = defaultdict(int)
    prompts = 0
    for path in reports:
        report = json.loads(path.read_text())
        budget = (report.get("settings") or {}).get("max_new_tokens")
        figures = report["sets"]["prompts"]
        prompts += figures["prompts"]
        for k, run in figures["runs"].items():
            add(runs[k], run)
        if isinstance(figures.get("baseline"), dict) and "passes" in figures["baseline"]:
            add(runs["baseline"], figures["baseline"])
        check = figures.get("lossless") or {}
        for key in ("runs_compared", "identical"):
            lossless[key] += int(check.get(key, 0))
        lossless["failures"] += len(check.get("failures", []))
        lossless["near_ties"] += len(check.get("near_ties", []))
        for row in report.get("per_prompt", []):
            parts = str(row["id"]).split("-")  # hw-<category>-NN
            category = row.get("category") or (parts[1] if parts[0] == "hw" and len(parts) > 2
                                               else "all")
            group = "starts with an opener" if str(row["id"]) in (opening or {}) else "other"
            counts[group] += 1
            length = REACH if budget and row["new_tokens"] >= budget else END
            counts[length] += 1
            for key, value in row.items():
                if key.startswith("acceptance_length_k") and value:
                    # tokens and passes of this prompt: emitted / tau = passes
                    pair = (row["new_tokens"], row["new_tokens"] / value)
                    k = key[len("acceptance_length_k"):]
                    categories[category][k].append(pair)
                    by_opener[group][k].append(pair)
                    by_length[length][k].append(pair)
    summary = {"prompts": prompts, "runs": {k: finish(v) for k, v in runs.items()},
               "lossless": lossless,
               "categories": {name: group_taus(ks) for name, ks in categories.items()},
               "by_length": {name: {"prompts": counts[name], **group_taus(by_length[name])}
                             for name in (REACH, END) if counts[name]}}
    if opening is not None:
        summary["by_opener"] = {name: {"prompts": counts[name], **group_taus(ks)}
                                for name, ks in by_opener.items()}
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    runs = summary["runs"]
    width = max(len(r["acceptance_rate"]) for r in runs.values())
    print(f"\n{summary['prompts']} prompts\n\n| run | tau | passes | " + " | ".join(
        f"pos {i}" for i in range(width)) + " |\n| --- | ---: | ---: |" + " ---: |" * width)
    for name, run in runs.items():
        rates = [f"{r:.3f}" if r is not None else "-" for r in run["acceptance_rate"]]
        label = "untrained baseline" if name == "baseline" else f"k = {name}"
        print(f"| {label} | {run['acceptance_length']:.3f} | {run['passes']} | "
              + " | ".join(rates + [""] * (width - len(rates))) + " |")
    ks = [k for k in runs if k != "baseline"]
    print("\n| category | " + " | ".join(f"tau k={k}" for k in ks) + " |\n| --- |"
          + " ---: |" * len(ks))
    for name, figures in summary["categories"].items():
        print(f"| {name} | " + " | ".join(
            f"{figures[k]:.3f}" if k in figures else "-" for k in ks) + " |")
    for key, heading in (("by_opener", "questions"), ("by_length", "answers")):
        if not summary.get(key):
            continue
        print(f"\n| {heading} | prompts | " + " | ".join(f"tau k={k}" for k in ks)
              + " |\n| --- | ---: |" + " ---: |" * len(ks))
        for name, figures in summary[key].items():
            print(f"| {name} | {figures['prompts']} | " + " | ".join(
                f"{figures[k]:.3f}" if k in figures else "-" for k in ks) + " |")
    check = summary["lossless"]
    print(f"\nlossless: {check['identical']} of {check['runs_compared']} decodes identical to "
          f"the target's own, {check['failures']} failures, {check['near_ties']} near ties")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, default=HANDWRITTEN,
                        help="a prompts/conversations JSONL (default: the hand-written set)")
    parser.add_argument("--limit", type=int, help="the first M prompts only")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--summarize-only", action="store_true",
                        help="sum the shards already in --out, run nothing")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    if not args.prompts.is_file():
        parser.error(f"--prompts {args.prompts} does not exist")
    reports = sorted(args.out.glob("shard-*/eval.json")) if args.summarize_only \
        else run_shards(args, extra)
    if not reports:
        raise SystemExit(f"no shard reports in {args.out}")
    summary = summarize(reports, opening_questions(args.prompts))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
