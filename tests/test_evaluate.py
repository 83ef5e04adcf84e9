"""workers.evaluate on CPU: the accept/bonus bookkeeping, the draft at inference against
training's TTT unroll, speculative decoding with scripted proposers (exact tau and
per-position rates), the CLI end to end on a tiny random Llama (lossless, eval.json,
progress metrics), the layer check, prompt selection, bad arguments, and the teacher-forced
chains of bench/acceptance_by_confidence.py replayed against the decoder."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import REPO, make_model
from workers import evaluate
from workers.eagle3.draft.model import DraftConfig, Eagle3Draft, load_draft, write_draft
from workers.eagle3.draft.serving import default_layer_ids
from workers.eagle3.evaluation import heldout, speculative
from workers.eagle3.evaluation.handwritten import CATEGORIES, read_handwritten
from workers.eagle3.evaluation.speculative import (
    Acceptance,
    DraftState,
    Target,
    accept,
    greedy_decode,
    speculative_decode,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Llama and a random draft for it, saved as workers.train saves one
    (a 64-id draft vocabulary: every other target id)."""
    root = tmp_path_factory.mktemp("evaluate")
    model = make_model(root / "tiny")
    hf = json.loads((model / "config.json").read_text())
    config = DraftConfig.from_hf(hf, draft_vocab_size=DRAFT_VOCAB,
                                 aux_layer_ids=default_layer_ids(hf["num_hidden_layers"]))
    torch.manual_seed(1)
    draft = Eagle3Draft(config, embed_weight=torch.zeros(config.vocab_size, config.hidden_size))
    used = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, used, True)
    draft.set_vocab(used - torch.arange(DRAFT_VOCAB), t2d)
    write_draft(root / "train", draft, torch.float32)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "messages": [{"role": "user", "content": "Explain binary search."}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Why is the sky blue?"},
                                      {"from": "gpt", "value": "Rayleigh scattering."}]},
        {"id": "c", "messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Name three primes."}]},
    ]))
    return {"root": root, "model": model, "draft": root / "train" / "draft",
            "prompts": prompts}


def cli(tiny: dict[str, Path], out: Path, *extra: str, handwritten: bool = False
        ) -> list[str]:
    """The fixture's prompts only, unless `handwritten` (then `extra` should limit it)."""
    return ["--target", str(tiny["model"]), "--draft", str(tiny["draft"]), "--prompts",
            str(tiny["prompts"]), "--out", str(out), "--device", "cpu",
            *([] if handwritten else ["--no-handwritten"]), *extra]


# -- 1. bookkeeping ------------------------------------------------------------------------

def test_accept_takes_the_matching_prefix_then_the_targets_token() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]) == (3, [5, 6, 7, 8])  # all + bonus
    assert accept([5, 6, 7], [5, 9, 7, 8]) == (1, [5, 9])  # stops at the first miss
    assert accept([5, 6, 7], [1, 6, 7, 8]) == (0, [1])  # the target's own token
    assert accept([], [4]) == (0, [4])
    with pytest.raises(ValueError, match="3 proposals need 4"):
        accept([5, 6, 7], [5, 6, 7])


def test_acceptance_length_and_per_position_rates() -> None:
    counts = Acceptance(3)
    for accepted in (3, 1, 0, 2):  # emitted 4 + 2 + 1 + 3 over 4 passes
        counts.add(accepted)
    assert counts.acceptance_length == 10 / 4
    # position 0: tried 4, accepted 3; 1: tried 3 (those with 0 accepted), accepted 2;
    # 2: tried 2, accepted 1
    assert counts.tried == [4, 3, 2] and counts.accepted == [3, 2, 1]
    assert counts.rates == [3 / 4, 2 / 3, 1 / 2]
    other = Acceptance(3)
    other.add(0)
    counts.merge(other)
    assert (counts.passes, counts.emitted, counts.rates[0]) == (5, 11, 3 / 5)
    assert Acceptance(2).acceptance_length is None and Acceptance(2).rates == [None, None]
    with pytest.raises(ValueError):
        counts.add(4)


# -- 2. the draft at inference is the draft of training ------------------------------------

def test_draft_inference_matches_the_ttt_unroll() -> None:
    """DraftState (step-0 cache extended in chunks, chained steps) gives, at the last
    context position, the hidden states `Eagle3Draft.unroll` trains, when the chain is
    fed the ground-truth tokens."""
    config = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=40,
                         draft_vocab_size=40, rope={"rope_type": "default",
                                                    "rope_theta": 500.0})
    torch.manual_seed(0)
    draft = Eagle3Draft(config, embed_weight=torch.randn(40, 32), init_std=0.2).double()
    length, steps = 12, 4
    aux = torch.randn(1, length, 96, dtype=torch.float64)
    ids = torch.randint(0, 40, (1, length))
    with torch.no_grad():
        trained = list(draft.unroll(aux, ids, steps))
        last = length - steps - 1  # the chain at `last` sees tokens up to last + steps
        state = DraftState(draft)
        state.extend(aux[:, :5], ids[0, 1:6].tolist())  # the prompt, then a pass's tokens
        state.extend(aux[:, 5:last + 1], ids[0, 6:last + 2].tolist())
        hidden: list[torch.Tensor] = []
        truth = iter(ids[0, last + 2:].tolist())

        def ground_truth(h: torch.Tensor) -> int:
            hidden.append(h)
            return next(truth, 0)  # the last proposal feeds no step

        state._propose_token = ground_truth  # type: ignore[method-assign]
        state.propose(steps)
    for step in range(steps):
        torch.testing.assert_close(hidden[step][0, 0], trained[step][0, last], rtol=0,
                                   atol=1e-12, msg=f"step {step}")


# -- 3. speculative decoding with scripted proposers ---------------------------------------

class Scripted:
    """Proposes the target's own greedy continuation, wrong at chain position
    `wrong_at` (never, when None)."""

    def __init__(self, continuation: Sequence[int], prompt_length: int,
                 wrong_at: int | None = None):
        self.continuation = list(continuation)
        self.known = 1 - prompt_length  # output tokens passed to extend so far
        self.wrong_at = wrong_at

    def extend(self, aux: torch.Tensor, next_tokens: Sequence[int]) -> None:
        assert aux.shape[1] == len(next_tokens)
        self.known += len(next_tokens)

    def propose(self, k: int) -> list[int]:
        tokens = self.continuation[self.known:self.known + k]
        if self.wrong_at is not None:
            tokens[self.wrong_at] = (tokens[self.wrong_at] + 1) % 100
        return tokens


@pytest.fixture(scope="module")
def target(tiny: dict[str, Path]) -> Target:
    model = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32).eval()
    return Target(model, default_layer_ids(8))


PROMPT = [1, 5, 40, 41, 42, 6]


@pytest.mark.parametrize("k", [1, 3])
def test_a_perfect_proposer_gets_k_plus_one_tokens_per_pass(target: Target, k: int) -> None:
    budget = 1 + 4 * (k + 1)  # the prefill's token, then 4 full passes
    long = greedy_decode(target, PROMPT, budget + k + 1, stop_ids=()).tokens
    decoded = speculative_decode(target, Scripted(long, len(PROMPT)), PROMPT, k, budget, ())
    assert decoded.tokens == long[:budget]
    assert decoded.acceptance.passes == 4
    assert decoded.acceptance.acceptance_length == k + 1
    assert decoded.acceptance.rates == [1.0] * k


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_a_proposer_wrong_at_position_j_gets_j_plus_one(target: Target, wrong_at: int) -> None:
    """Rejections crop the target's cache; the output stays greedy decoding's."""
    budget = 25
    long = greedy_decode(target, PROMPT, budget + 4, stop_ids=()).tokens
    proposer = Scripted(long, len(PROMPT), wrong_at)
    decoded = speculative_decode(target, proposer, PROMPT, 3, budget, ())
    assert decoded.tokens == long[:budget]
    assert [top.ids[0] for top in decoded.top2] == decoded.tokens  # each token's own pass
    assert decoded.acceptance.acceptance_length == wrong_at + 1
    assert decoded.acceptance.rates == [1.0] * wrong_at + [0.0] + [None] * (2 - wrong_at)


def test_stop_token_ends_both_decoders_alike(target: Target) -> None:
    long = greedy_decode(target, PROMPT, 20, stop_ids=()).tokens
    stop = long[7]
    reference = greedy_decode(target, PROMPT, 20, stop_ids={stop}).tokens
    assert reference == long[:long.index(stop) + 1]
    decoded = speculative_decode(target, Scripted(long + [0] * 8, len(PROMPT)), PROMPT, 3,
                                 20, {stop})
    assert decoded.tokens == reference


def decoded(tokens: list[int], ties: dict[int, tuple[tuple[int, int], tuple[float, float]]]
            ) -> speculative.Decoded:
    top2 = [ties.get(i, ((t, 0), (9.0, 1.0))) for i, t in enumerate(tokens)]
    return speculative.Decoded(tokens, [speculative.Top2(*t) for t in top2])


def test_a_divergence_is_a_near_tie_only_if_the_reference_nearly_tied_the_pick() -> None:
    reference = decoded([4, 5, 6, 7], {2: ((6, 8), (10.0, 9.99))})
    assert speculative.compare(reference, decoded([4, 5, 6, 7], {}), 0.01) is None
    flipped = decoded([4, 5, 8, 2], {2: ((8, 6), (10.002, 10.0))})
    tie = speculative.compare(reference, flipped, tie_tolerance=0.01)
    assert tie is not None and tie["near_tie"] and tie["position"] == 2
    assert (tie["expected"], tie["got"]) == (6, 8)
    assert tie["relative_spread"] == pytest.approx(0.012 / 10.002)
    assert not speculative.compare(reference, flipped, tie_tolerance=0.001)["near_tie"]
    # other logits at that position (a stale cache): not a tie, however close the top two
    stale = decoded([4, 5, 8, 2], {2: ((8, 6), (3.0, 2.999))})
    assert not speculative.compare(reference, stale, 0.01)["near_tie"]
    # a three-way tie: the speculative pass's runner-up is a third token. Seen on
    # SmolLM2-135M in bf16 on an H200: the reference ranked 9019 and 5530 both at
    # 18.25, the speculative pass 5530 at 18.25 and 469 at 18.125
    three_way = decoded([4, 5, 8, 2], {2: ((8, 1), (10.0, 9.995))})
    assert speculative.compare(reference, three_way, 0.01)["near_tie"]
    # a pick the reference did not have in its top two: not a tie
    unknown = decoded([4, 5, 3, 2], {2: ((3, 8), (10.0, 9.995))})
    assert not speculative.compare(reference, unknown, 0.01)["near_tie"]
    shorter = speculative.compare(reference, decoded([4, 5, 6], {}), 0.01)
    assert shorter is not None and not shorter["near_tie"] and shorter["got"] is None


# -- 4. the command line -------------------------------------------------------------------

def test_cli_reports_acceptance_and_checks_losslessness(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    progress = tmp_path / "progress.json"
    monkeypatch.setenv("JOBSUP_PROGRESS_FILE", str(progress))
    out = tmp_path / "out"
    assert evaluate.main(cli(tiny, out, "-k", "2", "-k", "3", "--max-new-tokens", "12")) == 0
    report = json.loads((out / "eval.json").read_text())
    lossless = report["lossless"]
    assert (lossless["ok"], lossless["runs_compared"], lossless["failures"]) == (True, 9, [])
    assert lossless["identical"] == 9 - len(lossless["near_ties"])
    assert report["prompts"]["evaluated"] == ["a", "b", "c"]
    assert set(report["runs"]) == {"2", "3"}
    for k, run in report["runs"].items():
        assert run["k"] == int(k) and len(run["acceptance_rate"]) == int(k)
        assert 1.0 <= run["acceptance_length"] <= int(k) + 1
        assert run["emitted"] == run["passes"] + sum(run["accepted_by_position"])
    assert report["acceptance_length"] == report["runs"]["2"]["acceptance_length"]
    assert report["baseline"]["k"] == 2 and report["baseline"]["init"] == "random"
    assert report["layers"] == {"trained_on": [2, 4, 5],
                                "trained_on_source": "the draft's config.json",
                                "vllm": [2, 4, 5], "sglang": [2, 4, 5], "target_num_layers": 8,
                                "ok": True, "problems": []}
    assert report["reference"]["new_tokens"] == sum(r["new_tokens"]
                                                    for r in report["per_prompt"])
    written = json.loads(progress.read_text())
    assert (written["done"], written["total"], written["unit"]) == (3, 3, "prompt")
    metrics = written["metrics"]
    assert metrics["acceptance_length"] == report["acceptance_length"]
    assert metrics["acceptance_length_k3"] == report["runs"]["3"]["acceptance_length"]
    assert metrics["baseline_acceptance_length"] == report["baseline"]["acceptance_length"]
    assert "acceptance_rate_pos0" in metrics and metrics["lossless_failures"] == 0
    assert report["settings"]["dtype"] == "fp32"  # auto on CPU


def test_cli_scores_the_handwritten_set_first_and_reports_each_set(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sets: the hand-written one (8: one per category; a question seen in training
    replaced by the next of its category) first and the headline, `--prompts` after;
    eval.json's top-level figures are the hand-written set's, each set's are under
    `sets`, the hand-written set's also per category; lossless counts per set and over
    both."""
    progress = tmp_path / "progress.json"
    monkeypatch.setenv("JOBSUP_PROGRESS_FILE", str(progress))
    math_01 = next(q for q in read_handwritten() if q.prompt.id == "hw-math-01")
    training = tmp_path / "conversations.jsonl"
    training.write_text(json.dumps({"id": "p00003", "messages": [
        *math_01.prompt.messages, {"role": "assistant", "content": "$21"}]}) + "\n")
    out = tmp_path / "out"
    assert evaluate.main(cli(tiny, out, "-k", "2", "--max-new-tokens", "6",
                             "--handwritten-limit", "8", "--exclude", str(training),
                             handwritten=True)) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["headline_set"] == "handwritten" and list(report["sets"]) == [
        "handwritten", "prompts"]
    written = report["handwritten"]
    assert written["limit"] == 8 and written["excluded_seen_in_training"] == ["hw-math-01"]
    assert written["evaluated"] == [f"hw-{c}-{'02' if c == 'math' else '01'}"
                                    for c in CATEGORIES]
    assert report["prompts"]["evaluated"] == ["a", "b", "c"]
    handwritten, prompts = report["sets"]["handwritten"], report["sets"]["prompts"]
    for key in ("acceptance_length", "acceptance_rate", "runs", "baseline"):
        assert report[key] == handwritten[key], key
    assert (handwritten["prompts"], prompts["prompts"]) == (8, 3)
    assert "categories" not in prompts
    rows = report["per_prompt"]
    assert [r["set"] for r in rows] == ["handwritten"] * 8 + ["prompts"] * 3
    categories = handwritten["categories"]
    assert list(categories) == list(CATEGORIES)
    for row in rows[:8]:  # one question per category: its tau is the question's
        category = categories[row["category"]]
        assert category["prompts"] == 1
        assert category["acceptance_length"] == row["acceptance_length_k2"]
        assert category["acceptance_length_by_k"] == {"2": row["acceptance_length_k2"]}
        assert category["baseline_acceptance_length"] == row["acceptance_length_baseline"]
    for prompt_set, count in ((handwritten, 8), (prompts, 3)):
        assert 1.0 <= prompt_set["acceptance_length"] <= 3
        assert prompt_set["lossless"]["runs_compared"] == count * 2  # k 2 and the baseline
        assert prompt_set["lossless"]["ok"]
        assert prompt_set["runs"]["2"]["passes"] == prompt_set["runs"]["2"]["emitted"] - sum(
            prompt_set["runs"]["2"]["accepted_by_position"])
    assert report["lossless"]["runs_compared"] == 22 and report["lossless"]["ok"]
    assert report["lossless"]["tokens_equal"] == (
        handwritten["lossless"]["tokens_equal"] + prompts["lossless"]["tokens_equal"])
    assert report["reference"]["new_tokens"] == sum(r["new_tokens"] for r in rows)
    metrics = json.loads(progress.read_text())["metrics"]
    assert metrics["acceptance_length"] == handwritten["acceptance_length"]
    assert metrics["baseline_acceptance_length"] == handwritten["baseline"][
        "acceptance_length"]
    assert metrics["handwritten_acceptance_length"] == handwritten["acceptance_length"]
    assert metrics["prompts_acceptance_length"] == prompts["acceptance_length"]
    # the hand-written set alone: --prompts is optional then
    argv = cli(tiny, out, "--no-baseline", "--max-new-tokens", "4", "--handwritten-limit",
               "2", handwritten=True)
    del argv[argv.index("--prompts"):argv.index("--prompts") + 2]
    assert evaluate.main(argv) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] is None and list(report["sets"]) == ["handwritten"]
    assert report["handwritten"]["evaluated"] == ["hw-writing-01", "hw-roleplay-01"]
    assert report["acceptance_length"] == report["sets"]["handwritten"]["acceptance_length"]


def test_cli_fails_loudly_when_the_output_changes(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A verification bug (rejected tokens left in the target's cache) is caught."""
    monkeypatch.setattr(speculative, "crop", lambda cache, tokens_to_remove: None)
    out = tmp_path / "out"
    assert evaluate.main(cli(tiny, out, "--max-new-tokens", "12", "--limit", "1",
                             "--no-baseline")) == evaluate.EXIT_LOSSY
    assert "where no logit near-tie explains it" in capsys.readouterr().err
    report = json.loads((out / "eval.json").read_text())
    assert report["lossless"]["ok"] is False and report["baseline"] is None
    failure = report["lossless"]["failures"][0]
    assert failure["prompt"] == "a" and failure["near_tie"] is False
    assert failure["relative_spread"] > report["settings"]["tie_tolerance"]


def write_config(draft: Path, dest: Path, **changes: Any) -> Path:
    dest.mkdir()
    config = json.loads((draft / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "model.safetensors").symlink_to(draft / "model.safetensors")
    return dest


def test_cli_fails_when_an_engine_would_feed_other_layers(
        tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the nested (SGLang) key written as layer inputs, as workers.train once did
    draft = write_config(tiny["draft"], tmp_path / "draft",
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})
    out = tmp_path / "out"
    argv = cli(tiny, out)
    argv[argv.index("--draft") + 1] = str(draft)
    assert evaluate.main(argv) == evaluate.EXIT_LAYERS
    err = capsys.readouterr().err
    assert "vLLM [2, 4, 5], SGLang [3, 5, 6], trained on [2, 4, 5]" in err
    report = json.loads((out / "eval.json").read_text())
    assert report["layers"]["ok"] is False and len(report["layers"]["problems"]) == 1
    # a consistent config, but --data says the draft was trained on other layers
    data = tmp_path / "hidden_states"
    data.mkdir()
    (data / "extract_config.json").write_text(json.dumps({"aux_layer_ids": [1, 4, 6]}))
    assert evaluate.main([*cli(tiny, out), "--data", str(data)]) == evaluate.EXIT_LAYERS
    err = capsys.readouterr().err
    assert "vLLM [2, 4, 5], SGLang [2, 4, 5], trained on [1, 4, 6]" in err
    assert len(json.loads((out / "eval.json").read_text())["layers"]["problems"]) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["-k", "0"], "argument -k/--num-draft-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "many"], "argument --max-new-tokens: not an integer: 'many'"),
    (["--skip", "-1"], "argument --skip: must be >= 0, got -1"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--tie-tolerance", "2"], "--tie-tolerance must be in [0, 1), got 2.0"),
    (["--handwritten-limit", "0"], "argument --handwritten-limit: must be >= 1, got 0"),
    (["--handwritten-limit", "4"], "--handwritten-limit with --no-handwritten: choose one"),
])
def test_cli_bad_arguments_are_named(tiny: dict[str, Path], tmp_path: Path, argv: list[str],
                                     message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        evaluate.main([*cli(tiny, tmp_path / "out"), *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-handwritten"], "nothing to evaluate: give --prompts, or drop --no-handwritten"),
    (["--skip", "3"], "--skip applies to --prompts, which was not given"),
    (["--limit", "3"], "--limit applies to --prompts, which was not given"),
])
def test_cli_without_prompts(tiny: dict[str, Path], tmp_path: Path, argv: list[str],
                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        evaluate.main(["--target", str(tiny["model"]), "--draft", str(tiny["draft"]),
                       "--out", str(tmp_path / "out"), "--device", "cpu", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_missing_files_are_named(tiny: dict[str, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = cli(tiny, tmp_path / "out")
    argv[argv.index("--draft") + 1] = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert f"--draft '{tmp_path / 'nowhere'}' does not exist" in capsys.readouterr().err


# -- 5. held-out prompts -------------------------------------------------------------------

def test_prompt_selection_skips_limits_and_excludes_training(tmp_path: Path) -> None:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "p0", "messages": user("zero")},
        {"id": "p1", "messages": user("one")},
        "not an object",
        {"id": "p1", "messages": user("one again")},  # a repeated id: the first counts
        {"id": "p2", "messages": user("two")},
        {"id": "p3", "messages": user("three")},  # its text is in the training data
        {"id": "p4", "conversations": [{"from": "human", "value": "four"},
                                       {"from": "gpt", "value": "4"}]},
        {"id": "p5", "messages": [{"role": "assistant", "content": "no user turn"}]},
        {"id": "p6", "messages": user("six")},
    ]) + "\n")
    training = tmp_path / "conversations.jsonl"
    training.write_text(json.dumps({"id": "other", "messages": [
        *user("three"), {"role": "assistant", "content": "3", "reasoning_content": None}]}))
    selected = heldout.select_prompts(prompts, skip=2, limit=2, exclude=training)
    assert selected.skipped == 2 and selected.excluded == ["p3"]
    assert [p.id for p in selected.prompts] == ["p2", "p4"]
    assert selected.prompts[1].messages == [{"role": "user", "content": "four"}]
    everything = heldout.select_prompts(prompts, skip=0, limit=None, exclude=None)
    assert [p.id for p in everything.prompts] == ["p0", "p1", "p2", "p3", "p4", "p6"]


def test_sharded_evaluation_sums_to_one_process(tiny: dict[str, Path], tmp_path: Path) -> None:
    """bench/eval_shards.py: 3 prompts in 2 processes (2 + 1) report the passes, emitted
    tokens and per-position tries/acceptances one process reports, baseline included."""
    flags = ["--device", "cpu", "-k", "2", "-k", "3", "--max-new-tokens", "6"]
    whole = tmp_path / "whole"
    assert evaluate.main(cli(tiny, whole, *flags)) == 0
    report = json.loads((whole / "eval.json").read_text())
    sharded = tmp_path / "sharded"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "eval_shards.py"), "--target", str(tiny["model"]),
         "--draft", str(tiny["draft"]), "--prompts", str(tiny["prompts"]), "--out",
         str(sharded), "--shards", "2", "--", *flags],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in sharded.glob("shard-*")) == ["shard-0", "shard-1"]
    summary = json.loads((sharded / "summary.json").read_text())
    assert summary["prompts"] == 3
    expected = {**report["runs"], "baseline": report["baseline"]}
    assert set(summary["runs"]) == set(expected)
    for name, run in expected.items():
        mine = summary["runs"][name]
        for key in ("passes", "emitted", "tried_by_position", "accepted_by_position",
                    "acceptance_length", "acceptance_rate"):
            assert mine[key] == run[key], (name, key)
    assert summary["lossless"]["runs_compared"] == report["lossless"]["runs_compared"]
    assert "| k = 2 |" in done.stdout and "untrained baseline" in done.stdout
    # "Explain binary search." and "Why is the sky blue?" start with builtin openers
    groups = summary["by_opener"]
    assert {name: g["prompts"] for name, g in groups.items()} == \
        {"starts with an opener": 2, "other": 1}
    assert set(groups["other"]) == {"prompts", "2", "3"}
    assert "| starts with an opener | 2 |" in done.stdout
    reports = [json.loads(path.read_text()) for path in sharded.glob("shard-*/eval.json")]
    cut = sum(row["new_tokens"] == 6 for r in reports for row in r["per_prompt"])
    lengths = {name: g["prompts"] for name, g in summary["by_length"].items()}
    assert lengths == {name: n for name, n in (("reach the token budget", cut),
                                               ("end on their own", 3 - cut)) if n}
    assert "| answers | prompts |" in done.stdout


# -- 5. bench/acceptance_by_confidence.py: teacher-forced chains --------------------------

def load_bench(name: str) -> Any:
    """A script of bench/ as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_chains_are_counted_from_every_answer_position() -> None:
    """Prompt of 2 tokens, k = 2: the answer is the choices at positions 1..5; passes
    start at 1..4; the last start has one proposal inside the answer."""
    bench = load_bench("acceptance_by_confidence")
    choice = [9, 9, 5, 6, 7, 8, 0]
    proposed = [[0, 5, 0, 7, 8, 0, 0],   # from t: right at 1, 3, 4
                [0, 6, 0, 0, 0, 0, 0]]   # right at 1 (6 is the choice at 3)
    top1 = [0.1, 0.2, 0.95, 0.4, 0.6, 0.8, 0.99]
    in_vocab = [token != 6 for token in range(10)]
    tally = bench.count_chains(proposed, choice, top1, in_vocab, start=2, k=2)
    assert tally.answer_tokens == 5 and tally.prompts == 1
    assert (tally.tried, tally.accepted) == ([4, 2], [3, 1])
    assert tally.rates() == [0.75, 0.5] and tally.tau() == pytest.approx(2.125)
    # first proposals at p = 2, 3, 4, 5 (top-1 0.95, 0.4, 0.6, 0.8): hit, miss, hit, hit
    assert (tally.bin_tokens, tally.bin_hits) == ([0, 1, 1, 1, 1], [0, 0, 1, 1, 1])
    assert tally.out_of_vocab == 1  # the choice 6 at p = 3
    assert tally.confidence == pytest.approx(0.95 + 0.4 + 0.6 + 0.8)
    other = bench.count_chains(proposed, choice, top1, in_vocab, start=2, k=2)
    tally.merge(other)
    assert (tally.tried, tally.accepted, tally.prompts) == ([8, 4], [6, 2], 2)


def test_teacher_forced_chains_replay_the_speculative_decode(
        tiny: dict[str, Path], target: Target) -> None:
    """Walking the teacher-forced chains as a decode does (a pass that accepts a moves on
    a + 1 tokens) gives `speculative_decode`'s tries and acceptances per position with
    the same draft, token for token."""
    bench = load_bench("acceptance_by_confidence")
    embedding = target.model.get_input_embeddings().weight.detach()
    draft = load_draft(tiny["draft"], embedding, target_num_layers=8)
    k, budget = 3, 40
    answer = greedy_decode(target, PROMPT, budget + k + 1, ()).tokens
    # a draft whose logits all tie proposes draft id 0 every time: map it to the
    # answer's most common token, so that some chains are accepted and some are not
    common = Counter(answer).most_common(1)[0][0]
    with torch.no_grad():
        draft.lm_head.weight.zero_()
        draft.d2t[0] = common
    proposed, choice, _ = bench.teacher_forced(target.model, draft, target.layers,
                                               PROMPT + answer, k)
    assert choice[len(PROMPT) - 1:-1] == answer  # the run over the answer picks it again
    tried, accepted = [0] * k, [0] * k
    t, emitted = len(PROMPT) - 1, 1
    while emitted < budget:
        length = bench.chain_length(proposed, choice[:-1], t, k)
        for i in range(min(length + 1, k)):
            tried[i] += 1
            accepted[i] += i < length
        t, emitted = t + length + 1, emitted + length + 1
    decoded = speculative_decode(target, DraftState(draft), PROMPT, k, budget, ())
    assert decoded.acceptance is not None
    assert (decoded.acceptance.tried, decoded.acceptance.accepted) == (tried, accepted)
    assert 0 < sum(accepted) < sum(tried)  # the replay has hits and misses to get right


def test_acceptance_by_confidence_cli_reports_both_sets(tiny: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "acceptance_by_confidence.py"), "--target",
         str(tiny["model"]), "--draft", str(tiny["draft"]), "--prompts", str(tiny["prompts"]),
         "--handwritten-limit", "2", "-k", "2", "--max-new-tokens", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert set(report["sets"]) == {"handwritten", "handwritten:writing",
                                   "handwritten:roleplay", "prompts"}
    for name in ("handwritten", "prompts"):
        figures = report["sets"][name]
        # every answer of n tokens has n - 1 first proposals, one per pass start
        assert figures["first_proposals"] == figures["tried"][0] == \
            figures["answer_tokens"] - figures["prompts"]
        assert sum(b["share"] for b in figures["bins"]) == pytest.approx(1.0)
    assert report["sets"]["prompts"]["prompts"] == 3
    assert "| handwritten | 2 |" in done.stdout and "| prompts | 3 |" in done.stdout
    bad = subprocess.run(
        [sys.executable, str(REPO / "bench" / "acceptance_by_confidence.py"), "--target",
         str(tiny["model"]), "--draft", str(tiny["draft"]), "-k", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "-k must be >= 1" in bad.stderr
    missing = subprocess.run(
        [sys.executable, str(REPO / "bench" / "acceptance_by_confidence.py"), "--target",
         str(tmp_path / "nowhere"), "--draft", str(tiny["draft"])],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert missing.returncode == 2 and "nowhere/config.json" in missing.stderr
