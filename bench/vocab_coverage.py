"""How much of the target's answers a draft vocabulary covers: the share of the answer
tokens (the assistant spans, as extraction's loss mask marks them) of a conversations
JSONL whose target id is in each vocabulary's t2d. A token outside it can never be
drafted, so 1 - coverage is a ceiling on what a larger draft vocabulary can add.

    python -m workers.vocab --data generate/conversations.jsonl --tokenizer M \\
        --draft-vocab-size 16384 --out v16k.safetensors          # (and 32768)
    python -m workers.generate --prompts \\
        workers/eagle3/evaluation/data/heldout_handwritten.jsonl --out hw.jsonl \\
        --backend transformers --model M --max-tokens 96 --batch-size 80 --device cpu
    python bench/vocab_coverage.py --model M --data hw.jsonl v16k.safetensors v32k.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.common import ProgressReporter  # noqa: E402
from workers.eagle3.draft.vocab_mapping import VocabReport  # noqa: E402
from workers.vocab import TokenCounter, count_jsonl, load_tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the target's tokenizer")
    parser.add_argument("--data", type=Path, required=True, help="conversations JSONL")
    parser.add_argument("vocabs", type=Path, nargs="+", help="workers.vocab outputs")
    args = parser.parse_args()
    from safetensors.torch import load_file

    tokenizer, target_size = load_tokenizer(args.model)
    counter = TokenCounter(target_size)  # the answer tokens, counted as workers.vocab does
    report = VocabReport(draft_vocab_size=0, target_vocab_size=target_size, coverage=None,
                         tokens_counted=0, distinct_tokens=0, samples=0)
    count_jsonl(args.data, tokenizer, counter, report, ProgressReporter(total=0, unit="sample"),
                max_length=None)
    counts = counter.counts()
    if report.tokens_counted == 0:
        raise SystemExit(f"{args.data}: no answer tokens")
    print(f"{report.tokens_counted} answer tokens in {args.data}\n\n| vocabulary | draft ids | "
          "coverage |\n| --- | ---: | ---: |")
    for path in args.vocabs:
        t2d = load_file(str(path))["t2d"].bool()
        if t2d.numel() != target_size:
            raise SystemExit(f"{path}: t2d has {t2d.numel()} target ids, the tokenizer "
                             f"{target_size}: another target's vocabulary?")
        covered = int(counts[t2d].sum())
        print(f"| {path.name} | {int(t2d.sum())} | {covered / report.tokens_counted:.2%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
