"""Where a draft's proposals fail, and whether it is the draft or the questions: the
draft's chain acceptance, teacher-forced, on the target's own greedy answers, with each
proposal binned by how sure the target itself was of the token (its top-1 probability).

For each prompt the target answers greedily (`greedy_decode`, as `workers.evaluate`
does), then runs once over prompt + answer capturing the draft's layer inputs; the draft
unrolls k steps over it as training's TTT does (`Eagle3Draft.unroll`: step i at position
t is fed the embedding of the answer's token t + 1 + i, which is what a pass decodes
when proposals 0..i-1 were accepted). At every answer position a pass could start from,
proposal i counts as tried when proposals 0..i-1 matched the target's choices, and as
accepted when it matches too. The rates are `workers.evaluate`'s per-position rates
taken over every start instead of the starts a decode happens to reach, and
tau = 1 + sum_i prod_{j<=i} rate_j.

Two prompt sets are compared: the hand-written questions and `--prompts` (for example
held-out prompts the target wrote itself, like the draft's training data). If the
draft's acceptance of the first proposal is alike in each confidence bin of both sets,
the gap between the sets is in how sure the target is of its answers (what the
questions ask), not in what the draft learnt; the reweighted line says what the
hand-written set would reach with the other set's acceptance in each bin.

    python bench/acceptance_by_confidence.py --target /tmp/smol --draft DIR/draft \\
        --prompts held_out_self_prompts.jsonl --max-new-tokens 96 --out report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from workers.eagle3.evaluation.handwritten import read_handwritten, stratified  # noqa: E402
from workers.eagle3.evaluation.heldout import Prompt, read_prompts  # noqa: E402
from workers.eagle3.training.train_heldout import simulated_tau  # noqa: E402
from workers.evaluate import (  # noqa: E402
    EvalError,
    load_target_model,
    load_trained_draft,
    prompt_ids,
    read_json,
    stop_token_ids,
    target_num_layers,
)

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)
"""Bins of the target's top-1 probability at the proposed position."""


def bin_of(probability: float) -> int:
    for index, upper in enumerate(EDGES[1:-1]):
        if probability < upper:
            return index
    return len(EDGES) - 2


@dataclass
class Tally:
    k: int
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    bin_tokens: list[int] = field(default_factory=lambda: [0] * (len(EDGES) - 1))
    bin_hits: list[int] = field(default_factory=lambda: [0] * (len(EDGES) - 1))
    out_of_vocab: int = 0
    confidence: float = 0.0
    prompts: int = 0
    answer_tokens: int = 0

    def __post_init__(self) -> None:
        self.tried = self.tried or [0] * self.k
        self.accepted = self.accepted or [0] * self.k

    def merge(self, other: Tally) -> None:
        for mine, theirs in ((self.tried, other.tried), (self.accepted, other.accepted),
                             (self.bin_tokens, other.bin_tokens),
                             (self.bin_hits, other.bin_hits)):
            for index, value in enumerate(theirs):
                mine[index] += value
        self.out_of_vocab += other.out_of_vocab
        self.confidence += other.confidence
        self.prompts += other.prompts
        self.answer_tokens += other.answer_tokens

    def rates(self) -> list[float | None]:
        return [a / t if t else None for a, t in zip(self.accepted, self.tried, strict=True)]

    def tau(self) -> float:
        """1 + sum_i prod_{j<=i} rate_j (a position never tried counts as 0)."""
        return simulated_tau([rate or 0.0 for rate in self.rates()], self.k)

    def first_proposals(self) -> int:
        return sum(self.bin_tokens)

    def bin_rates(self) -> list[float | None]:
        return [h / n if n else None for h, n in zip(self.bin_hits, self.bin_tokens, strict=True)]

    def as_dict(self) -> dict[str, Any]:
        first = self.first_proposals()
        return {"prompts": self.prompts, "answer_tokens": self.answer_tokens,
                "first_proposals": first, "tau": self.tau(), "rates": self.rates(),
                "tried": self.tried, "accepted": self.accepted,
                "mean_target_top1": self.confidence / first if first else None,
                "target_choice_outside_draft_vocab": self.out_of_vocab / first if first else None,
                "bins": [{"from": lo, "to": hi, "share": n / first if first else None,
                          "first_proposal_acceptance": h / n if n else None}
                         for lo, hi, n, h in zip(EDGES, EDGES[1:], self.bin_tokens,
                                                 self.bin_hits, strict=False)]}


def chain_length(proposed: list[list[int]], choice: list[int], t: int, k: int) -> int:
    """How many of the k proposals of a pass whose last verified position is t match the
    target's choices (`proposed[i][t]` against `choice[t + 1 + i]`), stopping at the end
    of `choice`."""
    accepted = 0
    while accepted < k and t + 1 + accepted < len(choice) \
            and proposed[accepted][t] == choice[t + 1 + accepted]:
        accepted += 1
    return accepted


def count_chains(proposed: list[list[int]], choice: list[int], top1: list[float],
                 in_vocab: list[bool], start: int, k: int) -> Tally:
    """The tally of one answer. `choice[p]`: the target's choice after position p, its
    probability `top1[p]`; `proposed[i][t]`: the draft's proposal i from a pass whose last
    verified position is t; `start`: the prompt's length, so the answer's tokens are the
    choices at start - 1 .. len - 2, and a pass can start at start - 1 (after the
    prefill) up to len - 3."""
    tally = Tally(k)
    within = choice[:-1]  # the last position's choice is past the answer
    tally.prompts = 1
    tally.answer_tokens = len(within) - start + 1
    for t in range(start - 1, len(within) - 1):
        accepted = chain_length(proposed, within, t, k)
        for i in range(min(accepted + 1, k, len(within) - 1 - t)):
            tally.tried[i] += 1
            tally.accepted[i] += i < accepted
        p = t + 1
        tally.bin_tokens[bin_of(top1[p])] += 1
        tally.bin_hits[bin_of(top1[p])] += accepted > 0
        tally.confidence += top1[p]
        tally.out_of_vocab += not in_vocab[within[p]]
    return tally


def teacher_forced(model: Any, draft: Any, layers: list[int], tokens: list[int],
                   k: int) -> tuple[list[list[int]], list[int], list[float]]:
    """(proposed, choice, top1) over `tokens` (prompt + answer): the target run once
    over them, the draft unrolled k steps on its captured layer inputs."""
    import torch

    sequence = torch.tensor([tokens], device=model.device)
    with torch.inference_mode():
        out = model(input_ids=sequence, output_hidden_states=True)
        top1, choice = out.logits[0].float().softmax(-1).max(-1)
        aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1).to(
            draft.fc.weight.dtype)
        proposed = []
        for hidden in draft.unroll(aux, sequence, k):
            drafted = draft.logits(hidden)[0].argmax(-1)
            proposed.append((drafted + draft.d2t[drafted]).tolist())
    return proposed, choice.tolist(), top1.tolist()


def measure(model: Any, tokenizer: Any, draft: Any, layers: list[int], prompt: Prompt,
            k: int, max_new_tokens: int, stops: set[int]) -> Tally:
    """Answers `prompt` greedily, then tallies the draft's chains over the answer."""
    from workers.eagle3.evaluation.speculative import Target, greedy_decode

    ids = prompt_ids(tokenizer, prompt.messages)
    answer = greedy_decode(Target(model, layers), ids, max_new_tokens, stops).tokens
    proposed, choice, top1 = teacher_forced(model, draft, layers, ids + answer, k)
    return count_chains(proposed, choice, top1, draft.t2d.tolist(), len(ids), k)


def reweighted(shares_from: Tally, rates_from: Tally) -> float | None:
    """First-proposal acceptance of `shares_from`'s bins at `rates_from`'s rate per bin."""
    first = shares_from.first_proposals()
    rates = rates_from.bin_rates()
    if not first or any(r is None for n, r in zip(shares_from.bin_tokens, rates, strict=True)
                        if n):
        return None
    return sum(n / first * (r or 0.0) for n, r in zip(shares_from.bin_tokens, rates,
                                                       strict=True))


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, help="a second prompt set (JSONL)")
    parser.add_argument("--limit", type=int, help="the first N prompts of --prompts")
    parser.add_argument("--handwritten-limit", type=int,
                        help="N hand-written questions spread over the categories")
    parser.add_argument("-k", type=int, default=5, help="proposals per pass")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, help="a JSON report")
    args = parser.parse_args()
    if args.k < 1 or args.max_new_tokens < 2:
        parser.error("-k must be >= 1 and --max-new-tokens >= 2")
    if (args.limit is not None and args.limit < 1) or (
            args.handwritten_limit is not None and args.handwritten_limit < 1):
        parser.error("--limit and --handwritten-limit must be >= 1")
    if args.prompts and not args.prompts.is_file():
        parser.error(f"--prompts {args.prompts}: no such file")

    sets: dict[str, list[tuple[str, Prompt]]] = {
        "handwritten": [(q.category, q.prompt)
                        for q in stratified(read_handwritten(), args.handwritten_limit)]}
    if args.prompts:
        chosen = list(read_prompts(args.prompts))[:args.limit]
        if not chosen:
            parser.error(f"--prompts {args.prompts}: no usable prompt")
        sets["prompts"] = [("", p) for p in chosen]
    try:
        num_layers = target_num_layers(read_json(args.target / "config.json", "--target"))
        model, tokenizer = load_target_model(args.target, args.device, args.dtype)
        draft = load_trained_draft(args.draft, model.get_input_embeddings().weight.detach(),
                                   num_layers)
    except EvalError as exc:
        parser.error(str(exc))
    layers = list(draft.config.aux_layer_ids)
    stops = stop_token_ids(model, tokenizer)
    tallies: dict[str, Tally] = {}
    for name, prompts in sets.items():
        tally = tallies[name] = Tally(args.k)
        started = time.monotonic()
        for category, prompt in prompts:
            one = measure(model, tokenizer, draft, layers, prompt, args.k,
                          args.max_new_tokens, stops)
            tally.merge(one)
            if category:
                tallies.setdefault(f"{name}:{category}", Tally(args.k)).merge(one)
        print(f"{name}: {len(prompts)} prompts in {time.monotonic() - started:.0f} s",
              file=sys.stderr)

    print(f"Draft {args.draft}, k = {args.k}, answers of up to {args.max_new_tokens} tokens, "
          f"layers {layers}, {args.dtype} on {args.device}.\n")
    print("| set | prompts | answer tokens | tau (all starts) | per position | target top-1, "
          "mean | target choice outside draft vocab |\n| --- | ---: | ---: | ---: | --- "
          "| ---: | ---: |")
    for name, tally in tallies.items():
        figures = tally.as_dict()
        print(f"| {name} | {tally.prompts} | {tally.answer_tokens} | {figures['tau']:.3f} | "
              f"{', '.join(fmt(r) for r in figures['rates'])} | "
              f"{fmt(figures['mean_target_top1'])} | "
              f"{fmt(figures['target_choice_outside_draft_vocab'])} |")
    main_sets = [n for n in tallies if ":" not in n]
    print("\nFirst proposal by the target's top-1 probability (share of proposals / "
          "acceptance):\n")
    print("| target top-1 | " + " | ".join(main_sets) + " |\n| --- | "
          + " | ".join("---:" for _ in main_sets) + " |")
    for b, (lo, hi) in enumerate(zip(EDGES, EDGES[1:], strict=False)):
        cells = []
        for name in main_sets:
            tally = tallies[name]
            first = tally.first_proposals()
            cells.append(f"{fmt(tally.bin_tokens[b] / first if first else None, 2)} / "
                         f"{fmt(tally.bin_rates()[b])}")
        print(f"| {lo:.1f}-{hi:.1f} | " + " | ".join(cells) + " |")
    report: dict[str, Any] = {"draft": str(args.draft), "k": args.k,
                              "max_new_tokens": args.max_new_tokens, "layers": layers,
                              "sets": {n: t.as_dict() for n, t in tallies.items()}}
    if "prompts" in tallies:
        hw, other = tallies["handwritten"], tallies["prompts"]
        own = sum(hw.bin_hits) / max(hw.first_proposals(), 1)
        swapped = reweighted(hw, other)
        report["handwritten_first_acceptance"] = own
        report["handwritten_bins_at_prompts_rates"] = swapped
        print(f"\nFirst-proposal acceptance on the hand-written set: {fmt(own)}; with the "
              f"other set's acceptance in each bin: {fmt(swapped)}; the other set's own: "
              f"{fmt(sum(other.bin_hits) / max(other.first_proposals(), 1))}.")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
