"""The whole EAGLE-3 pipeline on a real target, SmolLM2-135M-Instruct, and what its draft
is worth: acceptance length tau at k = 3 and 5 on the hand-written held-out questions and
on synthetic held-out prompts, trained vs an untrained draft of the same shape,
acceptance per draft position, the training curve and workers.train's held-out measure.

    python -m workers.fixtures.smollm2 /models/smollm2          # once: the HF checkpoint
    python bench/eagle3_smollm2.py --model /models/smollm2 --work /tmp/e3 \
        --prompts self:20000 --batch-size 2048 --device cuda

One whole arm of the recipe the later runs use, on one GPU:

    python bench/eagle3_smollm2.py --model /models/smollm2 --work /tmp/e3 \
        --prompts self:20000 --batch-size 4096 --store fp8 --epochs 4 \
        --batch-tokens 32768 --draft-intermediate-size 6144 --target-temperature 0

`--prompts self:N` has the target write its own prompts (workers.generate
--self-prompts), `synthetic:N` takes topics x tasks (workers.fixtures.prompts, at most 2,926).
`--conversations FILE` reuses another run's generate output, so arms that differ only
later (`--store fp8`, training flags) share one generation; `--features DIR` reuses an
extraction the same way. Each step is the worker's
own CLI, run as a subprocess with JOBSUP_PROGRESS_FILE set and that file polled (as the
daemon would), so the curve is what jobsup shows. The held-out prompts never reach
generation, extraction or training. `--steps` runs a subset (the work dir keeps what
earlier steps made), to fit a time limit per call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.common import read_jsonl  # noqa: E402
from workers.fixtures.prompts import TASKS, TOPICS, prompt_texts, write_prompts  # noqa: E402

STEPS = ("prompts", "generate", "extract", "vocab", "train", "evaluate")

def make_prompts(work: Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Training prompts (the first of the seeded order) and held-out ones (its last: the
    same for every arm whatever its size), disjoint."""
    texts = prompt_texts(len(TOPICS) * len(TASKS), seed)
    if n_train + n_eval > len(texts):
        raise SystemExit(f"synthetic prompts: {n_train} + {n_eval} held out, but only "
                         f"{len(texts)} distinct ones exist")
    return (write_prompts(work / "prompts.jsonl", texts[:n_train], "p"),
            write_prompts(work / "held_out.jsonl", texts[len(texts) - n_eval:], "h"))


class Curve(threading.Thread):
    """Polls a progress file every `every_s` seconds while a step runs."""

    def __init__(self, path: Path, every_s: float = 2.0):
        super().__init__(daemon=True)
        self.path, self.every_s, self.points = path, every_s, []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                report = json.loads(self.path.read_text())
            except (OSError, ValueError):
                continue
            if not self.points or self.points[-1]["done"] != report.get("done"):
                self.points.append({"t": time.time(), **report})


def run_step(name: str, argv: list[str], work: Path) -> dict[str, object]:
    progress = work / f"{name}.progress.json"
    progress.unlink(missing_ok=True)
    curve = Curve(progress)
    curve.start()
    started = time.monotonic()
    log = work / f"{name}.log"
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", *argv], cwd=REPO, stdout=out,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "JOBSUP_PROGRESS_FILE": str(progress)})
    curve.done.set()
    curve.join()
    took = time.monotonic() - started
    print(f"{name}: exit {code} in {took:.0f} s (log {log})", flush=True)
    if code != 0:
        print(log.read_text()[-3000:], file=sys.stderr)
        raise SystemExit(f"{name} failed")
    (work / f"{name}.curve.json").write_text(json.dumps(curve.points))
    return {"step": name, "seconds": round(took, 1)}


def parse_source(text: str) -> tuple[str, int]:
    """`synthetic:N` (topics x tasks, workers.fixtures.prompts), `self:N` (the target writes its
    own prompts: workers.generate --self-prompts) or a bare N (synthetic)."""
    kind, _, count = text.rpartition(":")
    kind = kind or "synthetic"
    if kind not in ("synthetic", "self") or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"--prompts: synthetic:N or self:N, not {text!r}")
    return kind, int(count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, required=True, help="HF dir (workers.fixtures.smollm2)")
    add("--work", type=Path, required=True)
    add("--prompts", type=parse_source, default=("synthetic", 2000),
        help="synthetic:N or self:N (default synthetic:2000)")
    add("--conversations", type=Path, help="reuse this generate output (no generate step)")
    add("--limit", type=int, help="extract only the first N conversations")
    add("--features", type=Path, help="reuse this extract output (no extract step): arms "
        "that differ only in training share one extraction")
    add("--online", action="store_true", help="train online (workers.train --online): no "
        "extract step, the vocabulary counted from the conversations, nothing on disk")
    add("--eval-prompts", type=int, default=16, help="synthetic held-out prompts")
    add("--eval-handwritten", type=int, default=80, help="hand-written questions (0: none)")
    add("--max-tokens", type=int, default=256, help="per generated answer")
    add("--prompt-max-tokens", type=int, default=128, help="per self-written prompt")
    add("--prompt-openers", help="self:N: workers.generate --prompt-openers (default its)")
    add("--prompt-top-p", type=float, help="self:N: workers.generate --prompt-top-p")
    add("--eval-tokens", type=int, default=96, help="per evaluated prompt")
    add("--batch-size", type=int, default=64, help="generation batch")
    add("--store", choices=("dtype", "fp8"),
        help="extracted features (default: workers.extract's, fp8, or a resume's own)")
    add("--epochs", type=int, help="default: workers.train's")
    add("--lr", type=float, help="default: workers.train's")
    add("--batch-tokens", type=int, help="default: workers.train's")
    add("--head-init", choices=("target", "random"), help="default: workers.train's")
    add("--draft-intermediate-size", type=int, help="default: workers.train's")
    add("--target-temperature", type=float, help="default: workers.train's")
    add("--eval-every", type=int, help="workers.train's held-out measure (default its)")
    add("--decoder", help="workers.generate --decoder (default its: auto)")
    add("--eval-dtype", default="auto", help="workers.evaluate --dtype (fp32: no bf16 "
        "near-ties in the lossless check)")
    add("-k", dest="ks", type=int, action="append", help="draft tokens (default 3 and 5)")
    add("--no-baseline", action="store_true", help="no untrained-draft baseline")
    add("--draft-vocab-size", type=int, default=16384)
    add("--device", default="cuda")
    add("--seed", type=int, default=0)
    add("--steps", default=",".join(STEPS))
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    times = json.loads((work / "times.json").read_text()) if (work / "times.json").exists() \
        else {}
    kind, count = args.prompts
    train_prompts, held_out = work / "prompts.jsonl", work / "held_out.jsonl"
    conversations = args.conversations or work / "generate" / "conversations.jsonl"
    hidden, vocab, train_out = (args.features or work / "hidden_states",
                                work / "vocab.safetensors", work / "train")
    device = ["--device", args.device]
    if "prompts" in steps:
        make_prompts(work, count if kind == "synthetic" else 0, args.eval_prompts, args.seed)
    source = (["--self-prompts", str(count), "--seed", str(args.seed),
               "--prompt-max-tokens", str(args.prompt_max_tokens),
               *(["--prompt-openers", args.prompt_openers] if args.prompt_openers else []),
               *(["--prompt-top-p", str(args.prompt_top_p)] if args.prompt_top_p else [])]
              if kind == "self"
              else ["--prompts", str(train_prompts)])
    train_flags = [f"--{name.replace('_', '-')}={value}" for name in
                   ("epochs", "lr", "batch_tokens", "head_init", "draft_intermediate_size",
                    "target_temperature", "eval_every")
                   if (value := getattr(args, name)) is not None]
    evaluation = ["--no-handwritten"] if not args.eval_handwritten else \
        ["--handwritten-limit", str(args.eval_handwritten)]
    if args.eval_prompts:
        evaluation += ["--prompts", str(held_out)]
    commands = {
        "generate": ["workers.generate", *source, "--out", str(conversations), "--backend",
                     "transformers", "--model", str(args.model), "--max-tokens",
                     str(args.max_tokens), "--batch-size", str(args.batch_size),
                     *(["--decoder", args.decoder] if args.decoder else []), *device],
        "extract": ["workers.extract", "--model", str(args.model), "--data",
                    str(conversations), "--out", str(hidden),
                    *(["--store", args.store] if args.store else []),
                    *(["--limit", str(args.limit)] if args.limit else []), *device],
        "vocab": ["workers.vocab", "--data", str(conversations if args.online else hidden),
                  "--tokenizer", str(args.model),
                  "--draft-vocab-size", str(args.draft_vocab_size), "--out", str(vocab)],
        "train": ["workers.train",
                  *(["--online", "--conversations", str(conversations)] if args.online
                    else ["--data", str(hidden)]), "--target", str(args.model),
                  "--vocab", str(vocab), "--out", str(train_out), *train_flags,
                  "--log-every", "10", *device],
        "evaluate": ["workers.evaluate", "--target", str(args.model), "--draft",
                     str(train_out / "draft"), "--out", str(work / "eval"), *evaluation,
                     *[f"-k{k}" for k in args.ks or (3, 5)], "--max-new-tokens",
                     str(args.eval_tokens),
                     *([] if args.online else ["--data", str(hidden)]), "--exclude",
                     str(conversations), *(["--no-baseline"] if args.no_baseline else []),
                     "--dtype", args.eval_dtype, *device],
    }
    conversations.parent.mkdir(parents=True, exist_ok=True)
    for name in STEPS[1:]:
        if name in steps and not (name == "generate" and args.conversations) \
                and not (name == "extract" and (args.features or args.online)):
            times[name] = run_step(name, commands[name], work)["seconds"]
            (work / "times.json").write_text(json.dumps(times))
    print("\n| step | seconds |\n| --- | ---: |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.0f} |")
    print_rates(conversations, hidden, times)
    report = work / "eval" / "eval.json"
    if report.exists():
        print_eval(json.loads(report.read_text()))
    curve = work / "train.curve.json"
    if curve.exists():
        print_curve(json.loads(curve.read_text()))
    held = train_out / "heldout.jsonl"
    if held.exists():
        print_heldout(records(held))
    return 0


def print_rates(conversations: Path, hidden: Path, times: dict[str, float]) -> None:
    """Generation and extraction tokens/s (step wall time, model loading included) and
    the features' bytes per token on disk."""
    if conversations.exists() and times.get("generate"):
        usage = [record.get("usage") or {} for record in records(conversations)]
        new = sum(u.get("completion_tokens", 0) for u in usage)
        print(f"\ngenerate: {len(usage)} conversations, {new} new tokens, "
              f"{new / times['generate']:,.0f} new tokens/s")
    manifest = hidden / "manifest.jsonl"
    if manifest.exists() and times.get("extract"):
        samples = records(manifest)
        tokens = sum(int(r.get("seq_len", 0)) for r in samples)
        size = sum(f.stat().st_size for f in hidden.rglob("*.safetensors"))
        print(f"extract: {len(samples)} samples, {tokens} tokens, "
              f"{tokens / times['extract']:,.0f} tokens/s, {size / max(tokens, 1):,.0f} "
              "bytes/token")


def records(path: Path) -> list[dict[str, Any]]:
    """The JSONL file's records (workers.common.read_jsonl reads by "\n", never at the
    U+2028 inside a conversation that str.splitlines split at)."""
    return [record for _, record in read_jsonl(path)]


def print_heldout(lines: list[dict[str, Any]]) -> None:
    """workers.train's held-out measure at each evaluation (the draft chosen by it)."""
    if not lines:
        return
    ks = [k for k in ("3", "5") if k in lines[0].get("tau_sim", {})]
    print("\n| step | epoch | held-out loss | acc_0 | acc_2 | acc_6 | " + " | ".join(
        f"tau_sim k={k}" for k in ks) + " |\n| ---: | ---: | ---: | ---: | ---: | ---: |"
        + " ---: |" * len(ks))
    for line in lines:
        acc = line.get("acc") or []
        print(f"| {line.get('step')} | {line.get('epoch')} | {cell(line.get('loss'))} | "
              + " | ".join(cell(acc[i] if i < len(acc) else None) for i in (0, 2, 6))
              + " | " + " | ".join(cell(line["tau_sim"][k]) for k in ks) + " |")


def print_eval(report: dict[str, Any]) -> None:
    """Tau per set (the headline first) and per hand-written category, then eval.json
    without its per-prompt rows."""
    sets = report.get("sets") or {}
    if sets:
        ks = list(next(iter(sets.values()))["runs"])
        print(f"\nheadline: the {report.get('headline_set')} set\n\n| set | prompts | "
              + " | ".join(f"tau k={k}" for k in ks) + " | untrained |\n| --- | ---: |"
              + " ---: |" * (len(ks) + 1))
        for name, figures in sets.items():
            baseline = (figures.get("baseline") or {}).get("acceptance_length")
            print(f"| {name} | {figures['prompts']} | " + " | ".join(
                cell(figures["runs"][k]["acceptance_length"]) for k in ks)
                + f" | {cell(baseline)} |")
        categories = (sets.get("handwritten") or {}).get("categories") or {}
        if categories:
            print("\n| category | prompts | " + " | ".join(f"tau k={k}" for k in ks)
                  + " | untrained |\n| --- | ---: |" + " ---: |" * (len(ks) + 1))
            for name, figures in categories.items():
                print(f"| {name} | {figures['prompts']} | " + " | ".join(
                    cell(figures["acceptance_length_by_k"].get(k)) for k in ks)
                    + f" | {cell(figures['baseline_acceptance_length'])} |")
    shown = {key: value for key, value in report.items() if key != "per_prompt"}
    print("\n```\n" + json.dumps(shown, indent=1)[:6000] + "\n```")


def cell(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


def print_curve(points: list[dict[str, object]]) -> None:
    print("\n| step | loss_0 | acc_0 | acc_2 | acc_6 |\n| ---: | ---: | ---: | ---: | ---: |")
    shown = points[:: max(1, len(points) // 12)] + points[-1:]
    for p in shown:
        m = p.get("metrics") or {}
        if not isinstance(m, dict):
            continue
        cells = [m.get(k) for k in ("loss_0", "acc_0", "acc_2", "acc_6")]
        print(f"| {p.get('done')} | " + " | ".join(
            f"{c:.3f}" if isinstance(c, int | float) else "-" for c in cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
