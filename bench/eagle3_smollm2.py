"""The whole EAGLE-3 pipeline on a real target, SmolLM2-135M-Instruct, and what its draft
is worth: acceptance length tau at k = 3 and 5, trained vs an untrained draft of the
same shape, acceptance per draft position, and the training curve.

    python -m workers.smollm2 /models/smollm2          # once: the HF checkpoint
    python bench/eagle3_smollm2.py --model /models/smollm2 --work /tmp/e3 \
        --prompts 3000 --eval-prompts 64 --device cuda --epochs 4

Each step is the worker's own CLI, run as a subprocess with JOBSUP_PROGRESS_FILE set
and that file polled (as the daemon would), so the curve is what jobsup shows. The
prompts are synthetic (topics x tasks, seeded): there is no dataset download here. The
held-out prompts never reach generation, extraction or training. `--steps` runs a
subset (the work dir keeps what earlier steps made), to fit a time limit per call.
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
from workers.prompts import prompt_texts, write_prompts  # noqa: E402

STEPS = ("prompts", "generate", "extract", "vocab", "train", "evaluate")

def make_prompts(work: Path, n_train: int, n_eval: int, seed: int) -> tuple[Path, Path]:
    """Training prompts and held-out ones, disjoint."""
    texts = prompt_texts(n_train + n_eval, seed)
    return (write_prompts(work / "prompts.jsonl", texts[:n_train], "p"),
            write_prompts(work / "held_out.jsonl", texts[n_train:], "h"))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF dir (workers.smollm2)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256, help="per generated answer")
    parser.add_argument("--eval-tokens", type=int, default=128, help="per evaluated prompt")
    parser.add_argument("--batch-size", type=int, default=64, help="generation batch")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", default=",".join(STEPS))
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    times = json.loads((work / "times.json").read_text()) if (work / "times.json").exists() \
        else {}
    train_prompts, held_out = work / "prompts.jsonl", work / "held_out.jsonl"
    conversations = work / "generate" / "conversations.jsonl"
    hidden, vocab, train_out = work / "hidden_states", work / "vocab.safetensors", work / "train"
    device = ["--device", args.device]
    if "prompts" in steps:
        make_prompts(work, args.prompts, args.eval_prompts, args.seed)
    commands = {
        "generate": ["workers.generate", "--prompts", str(train_prompts), "--out",
                     str(conversations), "--backend", "transformers", "--model",
                     str(args.model), "--max-tokens", str(args.max_tokens), "--batch-size",
                     str(args.batch_size), *device],
        "extract": ["workers.extract", "--model", str(args.model), "--data",
                    str(conversations), "--out", str(hidden), *device],
        "vocab": ["workers.vocab", "--data", str(hidden), "--tokenizer", str(args.model),
                  "--draft-vocab-size", str(args.draft_vocab_size), "--out", str(vocab)],
        "train": ["workers.train", "--data", str(hidden), "--target", str(args.model),
                  "--vocab", str(vocab), "--out", str(train_out), "--epochs",
                  str(args.epochs), "--log-every", "10", *device],
        "evaluate": ["workers.evaluate", "--target", str(args.model), "--draft",
                     str(train_out / "draft"), "--prompts", str(held_out), "--out",
                     str(work / "eval"), "-k", "3", "-k", "5", "--max-new-tokens",
                     str(args.eval_tokens), "--data", str(hidden), *device],
    }
    conversations.parent.mkdir(parents=True, exist_ok=True)
    for name in STEPS[1:]:
        if name in steps:
            times[name] = run_step(name, commands[name], work)["seconds"]
            (work / "times.json").write_text(json.dumps(times))
    print("\n| step | seconds |\n| --- | ---: |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.0f} |")
    report = work / "eval" / "eval.json"
    if report.exists():
        print_eval(json.loads(report.read_text()))
    curve = work / "train.curve.json"
    if curve.exists():
        print_curve(json.loads(curve.read_text()))
    return 0


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
