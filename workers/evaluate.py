"""Acceptance of an EAGLE-3 draft, measured: `python -m workers.evaluate --help`.

Greedy speculative decoding of the target (HF transformers, KV cache, batch 1) with the
draft proposing a chain of k tokens per target pass (workers/eagle3/evaluation/speculative.py: the
draft runs as training's TTT unroll does, fed the target's captured layer inputs), on
held-out prompts. Reports, per k:

- acceptance length tau: tokens emitted per target verification pass, the bonus token
  included (1.0 means the draft never helps; k + 1 is the most);
- the acceptance rate at each draft position i: the share of passes that accepted
  proposal i among those that accepted proposals 0..i-1;

and the same for an untrained draft of the same shape (same config and d2t, random
init, `--seed`) as the baseline that tells what tau a draft gets for free (repetitive
text, a tiny draft vocabulary). Every run is checked against plain greedy decoding of
the target, token for token: speculative decoding must not change the output. In
bf16 a (k+1)-token verification pass and a 1-token decoding step round differently, so
a logit near-tie can flip (on an H200 most 256-token runs meet one); a divergence where
both passes rank the same two tokens on top, swapped, within `--tie-tolerance`, is
reported as a near-tie and compared up to there; any other divergence is a verification
bug and fails the run (exit 1), as does any divergence with `--strict`.

Before loading the target it checks which layers vLLM and SGLang would feed the draft,
as they read its config.json (workers/eagle3/draft/serving.py), against the layers it was trained on
(`--data`'s extract_config.json, else the draft's config.json).

Prompts, two sets: the hand-written questions shipped with the workers (80, ten in
each of MT-Bench's eight categories, workers/eagle3/evaluation/handwritten.py; `--handwritten-limit
N` takes N spread over the categories, `--no-handwritten` none), and `--prompts`: JSONL
records with `messages` (as `workers.generate` reads them) or `conversations`
(`role`/`content` or ShareGPT `from`/`value`); trailing assistant turns are dropped, so a
conversations file serves too. Use prompts the draft never saw: a held-out file, `--skip
N` (the first N prompts went to training), and `--exclude CONVERSATIONS` (drops any
prompt, of either set, whose id or text is in the training conversations).
`jobsup pipeline run eagle3` holds the last `eval_prompts` prompts out of generation and
passes them here with both.

Output: OUT/eval.json, each set's figures under `sets` (the hand-written set's also per
category); the top-level figures and the progress file's are the headline set's: the
hand-written one when it is evaluated (what users ask; the same questions for every
draft), else `--prompts`. Metrics through $JOBSUP_PROGRESS_FILE (`acceptance_length`,
`acceptance_length_k<k>`, `acceptance_rate_pos<i>`, `baseline_acceptance_length`: the
headline set's; `handwritten_acceptance_length`, `prompts_acceptance_length`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.common import ProgressReporter, setup_logging, write_json
from workers.eagle3.evaluation.eval_checks import Lossless, layer_error, layer_report
from workers.eagle3.evaluation.handwritten import (
    CATEGORIES,
    HANDWRITTEN_PROMPTS,
    HandwrittenError,
    select_handwritten,
)
from workers.eagle3.evaluation.heldout import Prompt, TrainingPrompts, select_prompts
from workers.eagle3.target.loading import DTYPE_NAMES, EXPERTS

log = logging.getLogger("workers.evaluate")

EXIT_CODES = """exit codes:
  0  evaluated; every output equals plain greedy decoding (up to a logit near-tie)
  1  an output differs from plain greedy decoding (eval.json lists where; with
     --strict, at a near-tie too)
  2  usage error (bad flag, missing file, a draft that does not fit the target)
  3  vLLM or SGLang would feed the draft other layers than it was trained on"""
EXIT_LOSSY, EXIT_USAGE, EXIT_LAYERS = 1, 2, 3
DTYPES = ("auto", *DTYPE_NAMES)
TIE_TOLERANCE = {"bf16": 2.0**-5, "fp16": 2.0**-8, "fp32": 2.0**-14}
"""Relative logit spread under which a divergence from greedy decoding counts as a
numerical near-tie, by dtype: 8 units in the last place for bf16 and fp16; fp32 leaves
room for accumulation-order differences only. Measured on an H200 in bf16 (random 8- and
16-layer Llamas, lm_head sharpened x30, random drafts, 256 new tokens): 30 of 32 runs
met a near-tie, spreads 0.004-0.013 (1-3 units); a verification bug (rejected tokens
left in the KV cache) diverged with spreads 0.12-0.14."""


class EvalError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


# -- layers ------------------------------------------------------------------------------

def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EvalError(f"{what}: cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise EvalError(f"{what}: {path} is not a JSON object")
    return value


def target_num_layers(target_config: Mapping[str, Any]) -> int:
    text = target_config.get("text_config") or target_config
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise EvalError("--target: config.json has no num_hidden_layers")
    return layers


# -- models ------------------------------------------------------------------------------

def load_target_model(path: Path, device: str, dtype: str, experts: str = "auto"
                      ) -> tuple[Any, Any]:
    from workers.eagle3.target.loading import load_target, load_tokenizer, torch_dtype
    from workers.eagle3.target.model import TargetError

    try:
        tokenizer = load_tokenizer(path)
        model = load_target(path, device=device, dtype=torch_dtype(dtype),
                            experts=experts).model
    except (OSError, ValueError, TargetError) as exc:
        raise EvalError(f"--target: cannot load a model from {path}: {exc}") from None
    if not tokenizer.chat_template:
        raise EvalError(f"--target: the tokenizer in {path} has no chat template")
    return model, tokenizer


def load_trained_draft(path: Path, embedding: Any, num_layers: int) -> Any:
    """The saved draft, with the target's embedding (the only place a draft is loaded)."""
    from workers.eagle3.draft.model import DraftFileError, load_draft

    try:
        return load_draft(path, embedding, target_num_layers=num_layers)
    except DraftFileError as exc:
        raise EvalError(f"--draft: {exc}") from None


def untrained_draft(trained: Any, seed: int) -> Any:
    """A draft of the same config and d2t/t2d, randomly initialized (seeded)."""
    import torch

    from workers.eagle3.draft.model import Eagle3Draft

    embedding = trained.embed_tokens.weight
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Eagle3Draft(trained.config, embed_weight=embedding)
    torch.random.set_rng_state(generator_state)
    model.set_vocab(trained.d2t, trained.t2d)
    model.to(embedding.device)
    for param in model.trainable().values():
        param.data = param.data.to(embedding.dtype)
    return model.eval()


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The token ids the target is prompted with: its chat template up to the start of
    the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}


# -- the run -----------------------------------------------------------------------------

def evaluate(args: argparse.Namespace, progress: ProgressReporter) -> dict[str, Any]:
    from workers.eagle3.evaluation.speculative import (
        Acceptance,
        DraftState,
        Target,
        compare,
        greedy_decode,
        speculative_decode,
    )

    target_config = read_json(args.target / "config.json", "--target")
    draft_config = read_json(args.draft / "config.json", "--draft")
    num_layers = target_num_layers(target_config)
    extracted = read_json(args.data / "extract_config.json", "--data") if args.data else None
    layers = layer_report(draft_config, num_layers, extracted)
    report: dict[str, Any] = {"target": str(args.target), "draft": str(args.draft),
                              "layers": layers}
    if not layers["ok"]:
        report["error"] = layer_error(layers)
        write_report(args.out, report)
        raise EvalError(report["error"], EXIT_LAYERS)
    sets = prompt_sets(args)
    report["prompts"] = next((s.source for s in sets if s.name == PROMPTS), None)
    report["handwritten"] = next((s.source for s in sets if s.name == HANDWRITTEN), None)
    log.info("loading %s on %s", args.target, args.device)
    started = time.monotonic()
    model, tokenizer = load_target_model(args.target, args.device, args.dtype, args.experts)
    embedding = model.get_input_embeddings().weight.detach()
    draft = load_trained_draft(args.draft, embedding, num_layers)
    baseline = None if args.no_baseline else untrained_draft(draft, args.seed)
    target = Target(model, layers["trained_on"])
    stops = stop_token_ids(model, tokenizer)
    total = sum(len(s.prompts) for s in sets)
    log.info("loaded in %.1f s; %d prompts (%s), k %s, up to %d new tokens, layers %s",
             time.monotonic() - started, total,
             ", ".join(f"{s.name} {len(s.prompts)}" for s in sets), args.k,
             args.max_new_tokens, layers["trained_on"])
    for prompt_set in sets:
        prompt_set.runs = {f"k{k}": Run(draft, Acceptance(k)) for k in args.k}
        if baseline is not None:
            prompt_set.runs["baseline"] = Run(baseline, Acceptance(args.k[0]))
        prompt_set.checks = Lossless(strict=args.strict)
    per_prompt: list[dict[str, Any]] = []
    progress.total = total
    progress.update(0, force=True)
    done = 0
    for prompt_set in sets:  # the headline set first: the running metrics are its own
        runs, checks = prompt_set.runs, prompt_set.checks
        for prompt in prompt_set.prompts:
            ids = prompt_ids(tokenizer, prompt.messages)
            clock = time.monotonic()
            reference = greedy_decode(target, ids, args.max_new_tokens, stops)
            prompt_set.reference_s += time.monotonic() - clock
            category = prompt_set.categories.get(prompt.id)
            row: dict[str, Any] = {"id": prompt.id, "set": prompt_set.name,
                                   **({"category": category} if category else {}),
                                   "prompt_tokens": len(ids),
                                   "new_tokens": len(reference.tokens)}
            for name, run in runs.items():
                clock = time.monotonic()
                decoded = speculative_decode(target, DraftState(run.draft), ids,
                                             run.total.k, args.max_new_tokens, stops)
                run.seconds += time.monotonic() - clock
                assert decoded.acceptance is not None
                run.total.merge(decoded.acceptance)
                if category:
                    prompt_set.by_category.setdefault(category, {}).setdefault(
                        name, Acceptance(run.total.k)).merge(decoded.acceptance)
                row[f"acceptance_length_{name}"] = decoded.acceptance.acceptance_length
                difference = compare(reference, decoded, args.tie_tolerance)
                if difference is not None:
                    checks.add(prompt.id, name, difference)
                checks.tokens += difference["position"] if difference \
                    else len(reference.tokens)
            prompt_set.rows.append(row)
            per_prompt.append(row)
            done += 1
            progress.update(done, metrics(sets), force=done == total)
            log.info("prompt %d/%d %s: %d new tokens, tau %s", done, total, prompt.id,
                     len(reference.tokens), ", ".join(
                         f"{name} {row[f'acceptance_length_{name}'] or 0:.2f}"
                         for name in runs))
    headline = sets[0].as_dict(args.k[0], args.seed)
    checks = Lossless(strict=args.strict,
                      failures=[f for s in sets for f in s.checks.failures],
                      near_ties=[t for s in sets for t in s.checks.near_ties],
                      tokens=sum(s.checks.tokens for s in sets))
    report.update({
        "settings": {"k": args.k, "max_new_tokens": args.max_new_tokens,
                     "device": args.device, "dtype": args.dtype, "seed": args.seed,
                     "tie_tolerance": args.tie_tolerance, "strict": args.strict,
                     "stop_token_ids": sorted(stops)},
        "headline_set": sets[0].name,
        **{key: headline[key] for key in ("acceptance_length", "acceptance_rate", "runs",
                                          "baseline")},
        "lossless": checks.as_dict(runs=sum(len(s.prompts) * len(s.runs) for s in sets)),
        "reference": {"new_tokens": sum(row["new_tokens"] for row in per_prompt),
                      "seconds_per_prompt": sum(s.reference_s for s in sets) / total},
        "sets": {s.name: s.as_dict(args.k[0], args.seed) for s in sets},
        "per_prompt": per_prompt,
    })
    write_report(args.out, report)
    return report


PROMPTS, HANDWRITTEN = "prompts", "handwritten"
"""The two sets: `--prompts` (the pipeline's held-out split of its own prompts file) and
the hand-written questions shipped in workers/eagle3/evaluation/data/."""


@dataclass
class PromptSet:
    """One set of prompts and what was measured on it."""

    name: str
    prompts: list[Prompt]
    source: dict[str, Any]
    """eval.json's description of the selection (`prompts` / `handwritten`)."""
    categories: dict[str, str] = field(default_factory=dict)
    """Prompt id -> category (the hand-written set)."""
    runs: dict[str, Run] = field(default_factory=dict)
    checks: Lossless = field(default_factory=lambda: Lossless(strict=False))
    by_category: dict[str, dict[str, Any]] = field(default_factory=dict)
    """category -> run name -> `Acceptance` over that category's prompts."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    reference_s: float = 0.0

    def as_dict(self, first_k: int, seed: int) -> dict[str, Any]:
        count = len(self.prompts)
        first = self.runs[f"k{first_k}"].total
        baseline = self.runs.get("baseline")
        report: dict[str, Any] = {
            "prompts": count,
            "acceptance_length": first.acceptance_length,
            "acceptance_rate": first.rates,
            "runs": {str(run.total.k): run.as_dict(count) for name, run in self.runs.items()
                     if name != "baseline"},
            "baseline": None if baseline is None else {
                **baseline.as_dict(count), "init": "random", "seed": seed},
            "lossless": self.checks.as_dict(runs=count * len(self.runs)),
            "reference": {"new_tokens": sum(row["new_tokens"] for row in self.rows),
                          "seconds_per_prompt": self.reference_s / count},
        }
        if self.categories:
            report["categories"] = {category: category_report(
                sum(1 for c in self.categories.values() if c == category), runs, first_k)
                for category, runs in sorted(self.by_category.items(),
                                             key=lambda item: CATEGORIES.index(item[0]))}
        return report


def category_report(prompts: int, runs: Mapping[str, Any], first_k: int) -> dict[str, Any]:
    """tau of one category: the first k's (the headline), every k's, the baseline's."""
    baseline = runs.get("baseline")
    return {"prompts": prompts, "acceptance_length": runs[f"k{first_k}"].acceptance_length,
            "acceptance_length_by_k": {name.removeprefix("k"): acceptance.acceptance_length
                                       for name, acceptance in runs.items()
                                       if name != "baseline"},
            "baseline_acceptance_length": None if baseline is None
            else baseline.acceptance_length}


def prompt_sets(args: argparse.Namespace) -> list[PromptSet]:
    """The sets to evaluate, the headline set first: the hand-written questions when
    they are evaluated (what users ask, and the same questions for every run, so two
    drafts' figures compare), else `--prompts`. Prompts in the training conversations
    (`--exclude`) are dropped from both."""
    training = TrainingPrompts(args.exclude)
    sets: list[PromptSet] = []
    if not args.no_handwritten:
        try:
            chosen = select_handwritten(training, args.handwritten_limit)
        except HandwrittenError as exc:
            raise EvalError(str(exc)) from None
        source = {"file": str(HANDWRITTEN_PROMPTS), "limit": args.handwritten_limit,
                  "excluded_seen_in_training": chosen.excluded,
                  "evaluated": [p.id for p in chosen.prompts]}
        if chosen.questions:
            sets.append(PromptSet(HANDWRITTEN, chosen.prompts, source, chosen.categories))
        else:
            log.warning("every hand-written question is in the training conversations: "
                        "the hand-written set is not evaluated")
    if args.prompts is not None:
        selection = select_prompts(args.prompts, skip=args.skip, limit=args.limit,
                                   exclude=training)
        if not selection.prompts:
            raise EvalError(f"--prompts: no prompt left to evaluate in {args.prompts} (after "
                            f"--skip {args.skip} and {len(selection.excluded)} seen in "
                            "training)")
        sets.append(PromptSet(PROMPTS, selection.prompts, {
            "file": str(args.prompts), "skipped": selection.skipped,
            "excluded_seen_in_training": selection.excluded,
            "evaluated": [p.id for p in selection.prompts]}))
    if not sets:
        raise EvalError("no prompt left to evaluate: every hand-written question is in the "
                        "training conversations and no --prompts was given")
    return sets


@dataclass
class Run:
    draft: Any
    total: Any
    """`Acceptance` over the prompts so far."""
    seconds: float = 0.0

    def as_dict(self, prompts: int) -> dict[str, Any]:
        return {**self.total.as_dict(), "seconds_per_prompt": self.seconds / prompts}


def metrics(sets: Sequence[PromptSet]) -> dict[str, float]:
    """The progress file's metrics: the headline set's (the first) tau and per-position
    rates at the first k, its every k's tau and its baseline's (what the `low_acceptance`
    rule reads); each set's tau at the first k as `<set>_acceptance_length`; the lossless
    counts over all sets."""
    runs = sets[0].runs
    headline = next(iter(runs.values())).total
    values: dict[str, float | None] = {"acceptance_length": headline.acceptance_length}
    for name, run in runs.items():
        key = "baseline_acceptance_length" if name == "baseline" \
            else f"acceptance_length_{name}"
        values[key] = run.total.acceptance_length
    for i, rate in enumerate(headline.rates):
        values[f"acceptance_rate_pos{i}"] = rate
    for prompt_set in sets:
        if prompt_set.runs:
            values[f"{prompt_set.name}_acceptance_length"] = next(
                iter(prompt_set.runs.values())).total.acceptance_length
    values["lossless_failures"] = sum(len(s.checks.failures) for s in sets)
    values["lossless_near_ties"] = sum(len(s.checks.near_ties) for s in sets)
    return {name: value for name, value in values.items() if value is not None}


def write_report(out: Path, report: Mapping[str, Any]) -> Path:
    return write_json(out / "eval.json", report)


# -- command line ------------------------------------------------------------------------

def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: an integer >= `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    return parse


positive_int, non_negative_int = int_at_least(1), int_at_least(0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.evaluate", description=__doc__,
                                     epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--target", required=True, type=Path, help="target model directory (HF format)")
    add("--draft", required=True, type=Path, help="draft directory (workers.train's draft/)")
    add("--prompts", type=Path,
        help="JSONL with messages or conversations per line; use held-out prompts "
             "(optional while the hand-written set is evaluated)")
    add("--out", required=True, type=Path, help="directory for eval.json")
    add("-k", "--num-draft-tokens", dest="k", type=positive_int, action="append",
        metavar="K", help="proposals per target pass (a chain); repeat for several "
                          "(-k 3 -k 5); default 3. The first is the headline and baseline's")
    add("--max-new-tokens", type=positive_int, default=256,
        help="tokens generated per prompt (default 256)")
    add("--skip", type=non_negative_int, default=0, metavar="N",
        help="skip the first N prompts of the file (those that went to training)")
    add("--limit", type=positive_int, metavar="M",
        help="evaluate at most M prompts of --prompts")
    add("--no-handwritten", action="store_true",
        help="skip the hand-written questions (workers/eagle3/evaluation/data/"
             "heldout_handwritten.jsonl: 80, 10 in each of 8 categories), evaluated "
             "besides --prompts and first by default")
    add("--handwritten-limit", type=positive_int, metavar="N",
        help="evaluate N of the hand-written questions, spread over the categories "
             "(8: one each, 16: two each); default all 80")
    add("--exclude", type=Path, metavar="CONVERSATIONS",
        help="the training conversations (JSONL): prompts with their ids or texts are "
             "skipped")
    add("--data", type=Path, help="workers.extract output the draft was trained on: its "
                                  "extract_config.json names the layers (default: the "
                                  "draft's config.json)")
    add("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add("--dtype", choices=DTYPES, default="auto",
        help="target and draft dtype (auto: bf16 on CUDA, fp32 on CPU)")
    add("--experts", choices=EXPERTS, default="auto",
        help="a pack-quantized INT4 target's routed experts kept packed or dequantized "
             "to bf16 (auto: packed)")
    add("--seed", type=int, default=0, help="the untrained baseline's init (default 0)")
    add("--no-baseline", action="store_true", help="skip the untrained-draft baseline")
    add("--tie-tolerance", type=float, metavar="R",
        help="a divergence from greedy decoding is a numerical near-tie when both passes "
             "rank the same two tokens on top, swapped, all four logits within R of each "
             "other relative to their size (default by dtype: "
             + ", ".join(f"{k} {v:.2g}" for k, v in TIE_TOLERANCE.items()) + ")")
    add("--strict", action="store_true",
        help="fail on any difference from greedy decoding, near-ties included")
    add("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.k = list(dict.fromkeys(args.k or [3]))
    if args.prompts is None:
        if args.no_handwritten:
            parser.error("nothing to evaluate: give --prompts, or drop --no-handwritten")
        for value, flag in ((args.skip, "--skip"), (args.limit, "--limit")):
            if value:
                parser.error(f"{flag} applies to --prompts, which was not given")
    if args.no_handwritten and args.handwritten_limit is not None:
        parser.error("--handwritten-limit with --no-handwritten: choose one")
    for path, flag in ((args.target, "--target"), (args.draft, "--draft"),
                       (args.prompts, "--prompts"), (args.exclude, "--exclude"),
                       (args.data, "--data")):
        if path is not None and not path.exists():
            parser.error(f"{flag} {str(path)!r} does not exist")
    for path, flag in ((args.target, "--target"), (args.draft, "--draft")):
        if not (path / "config.json").is_file():
            parser.error(f"{flag} {str(path)!r} has no config.json")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.tie_tolerance is None:
        args.tie_tolerance = TIE_TOLERANCE[args.dtype]
    elif not 0 <= args.tie_tolerance < 1:
        parser.error(f"--tie-tolerance must be in [0, 1), got {args.tie_tolerance}")
    return args


def tau(run: Mapping[str, Any]) -> str:
    value = run["acceptance_length"]
    return "n/a (no target pass)" if value is None else f"{value:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    progress = ProgressReporter(None, "prompt")
    progress.update(0, force=True)  # loading the target can take a while: say we are alive
    try:
        report = evaluate(args, progress)
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    runs = report["runs"]
    summary = ", ".join(f"k={k} tau {tau(r)}" for k, r in runs.items())
    if report["baseline"] is not None:
        summary += f"; untrained baseline tau {tau(report['baseline'])}"
    sets = report["sets"]
    if len(sets) > 1:
        summary += "; " + ", ".join(f"{name} set tau {tau(s)}" for name, s in sets.items())
    log.info("done: %d prompts (headline: the %s set), %s; %s",
             sum(s["prompts"] for s in sets.values()), report["headline_set"], summary,
             args.out / "eval.json")
    lossless = report["lossless"]
    ties = len(lossless["near_ties"])
    if ties:
        log.warning("%d of %d runs diverged from plain greedy decoding at a logit near-tie "
                    "(%s rounds a 1-token and a (k+1)-token pass differently); they were "
                    "compared up to there%s", ties, lossless["runs_compared"], args.dtype,
                    ": failing (--strict)" if args.strict else "")
    if lossless["failures"]:
        first = lossless["failures"][0]
        print(f"error: speculative decoding changed the output in {len(lossless['failures'])} "
              f"of {lossless['runs_compared']} runs where no logit near-tie explains it: "
              f"first prompt {first['prompt']}, run {first['run']}, new token "
              f"{first['position']}: greedy decoding gives {first['expected']}, speculative "
              f"{first['got']}. A verification bug; details in {args.out / 'eval.json'}",
              file=sys.stderr)
        return EXIT_LOSSY
    if not lossless["ok"]:
        print(f"error: --strict: {ties} runs differ from plain greedy decoding at logit "
              f"near-ties; with --dtype fp32 they should not. Details in "
              f"{args.out / 'eval.json'}", file=sys.stderr)
        return EXIT_LOSSY
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
