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
from workers.common import read_jsonl, record_messages, tokenize_conversation  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the target's tokenizer")
    parser.add_argument("--data", type=Path, required=True, help="conversations JSONL")
    parser.add_argument("vocabs", type=Path, nargs="+", help="workers.vocab outputs")
    args = parser.parse_args()
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    answer_ids: list[int] = []
    for _, record in read_jsonl(args.data):
        tokens = tokenize_conversation(tokenizer, list(record_messages(record)))
        answer_ids += [t for t, m in zip(tokens.input_ids, tokens.loss_mask, strict=True) if m]
    if not answer_ids:
        raise SystemExit(f"{args.data}: no answer tokens")
    print(f"{len(answer_ids)} answer tokens in {args.data}\n\n| vocabulary | draft ids | "
          "coverage |\n| --- | ---: | ---: |")
    for path in args.vocabs:
        t2d = load_file(str(path))["t2d"].bool()
        if max(answer_ids) >= t2d.numel():
            raise SystemExit(f"{path}: t2d has {t2d.numel()} target ids, the tokenizer "
                             f"gave id {max(answer_ids)}: another target's vocabulary?")
        covered = int(t2d[answer_ids].sum())
        print(f"| {path.name} | {int(t2d.sum())} | {covered / len(answer_ids):.2%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
