"""workers.train on CPU: the draft's forward and TTT objective against a hand-written
reference, learning on real extracted data, kill -9 and resume, --init, the saved draft."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers import make_conversations, make_model, wait_for, worker_env
from workers import extract, vocab
from workers.common import ProgressReporter
from workers.eagle3.draft.model import (
    DraftConfig,
    Eagle3Draft,
    TargetHead,
    head_loss,
    load_draft,
    load_draft_weights,
    ttt_losses,
)
from workers.eagle3.training import fused_loss
from workers.eagle3.training.fused_loss import ScoredRows, ttt_losses_fused
from workers.eagle3.training.train_data import Batch, ExtractedData, TrainError, load_batch
from workers.eagle3.training.train_heldout import (
    HeldoutMeasure,
    default_eval_every,
    heldout_count,
    measure_heldout,
    pack_heldout,
    reported_ks,
    simulated_tau,
)
from workers.train import (
    build_model,
    build_optimizer,
    build_scheduler,
    new_scaler,
    parse_args,
    train_step,
)

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
ENV = worker_env()
LM_HEAD_SHARPENING = 30.0
"""A random tiny Llama's lm_head gives near-uniform distributions (entropy ~ ln 64 over
the draft vocabulary), which no draft can beat by much; scaled x30 the target's
entropy is ~0.23 nats, so there is something to learn."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    model = make_model(root / "tiny")
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * LM_HEAD_SHARPENING
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    conversations = make_conversations(root / "conv.jsonl")
    data = root / "extracted"
    assert extract.main(["--model", str(model), "--data", str(conversations), "--out",
                         str(data), "--dtype", "fp32", "--device", "cpu"]) == 0
    vocab.main(["--data", str(data), "--tokenizer", str(model), "--draft-vocab-size", "64",
                "--out", str(root / "vocab.safetensors")])
    return {"root": root, "model": model, "data": data, "vocab": root / "vocab.safetensors"}


def train_cli(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "workers.train", "--data", str(tiny["data"]), "--target",
            str(tiny["model"]), "--vocab", str(tiny["vocab"]), "--out", str(out), *extra]


# -- 1. the forward pass and the objective, by hand --------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, position: float, theta: float) -> torch.Tensor:
    """RoPE of one head vector [D] at one position, HF's half-split convention."""
    half = x.shape[-1] // 2
    angles = position * theta ** (-2.0 * torch.arange(half, dtype=x.dtype) / x.shape[-1])
    first, second = x[:half], x[half:]
    return torch.cat([first * angles.cos() - second * angles.sin(),
                      second * angles.cos() + first * angles.sin()])


def reference_unroll(w: dict[str, torch.Tensor], c: DraftConfig, aux: torch.Tensor,
                     ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """One sample, float64, loops: step i at position t attends to the step-0 keys at
    positions 0..t and the keys of steps 1..i at position t; RoPE position t + i."""
    length, eps, dim = ids.shape[0], c.rms_norm_eps, c.head_dim
    group = c.num_attention_heads // c.num_key_value_heads
    theta = c.rope["rope_theta"]
    h = aux @ w["fc.weight"].T
    keys: list[torch.Tensor] = []  # per step [L, Hkv, D]
    values: list[torch.Tensor] = []
    outputs = []
    for i in range(steps):
        tokens = torch.stack([w["embed_tokens.weight"][ids[t + 1 + i]] if t + 1 + i < length
                              else torch.zeros(c.hidden_size, dtype=h.dtype)
                              for t in range(length)])
        x = torch.cat([rms_norm(tokens, w["midlayer.input_layernorm.weight"], eps),
                       rms_norm(h, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(length, -1, dim)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(length, -1, dim)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(length, -1, dim)
        q = torch.stack([torch.stack([rotate(q[t, n], t + i, theta) for n in range(q.shape[1])])
                         for t in range(length)])
        k = torch.stack([torch.stack([rotate(k[t, n], t + i, theta) for n in range(k.shape[1])])
                         for t in range(length)])
        keys.append(k)
        values.append(v)
        attended = torch.zeros_like(q)
        for t in range(length):
            for head in range(q.shape[1]):
                g = head // group
                ks = [keys[0][s, g] for s in range(t + 1)] + [keys[j][t, g]
                                                              for j in range(1, i + 1)]
                vs = [values[0][s, g] for s in range(t + 1)] + [values[j][t, g]
                                                                for j in range(1, i + 1)]
                scores = torch.stack([q[t, head] @ key for key in ks]) / math.sqrt(dim)
                attended[t, head] = (scores.softmax(0)[:, None] * torch.stack(vs)).sum(0)
        h = h + attended.reshape(length, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms_norm(h, w["midlayer.post_attention_layernorm.weight"], eps)
        gate = m @ w["midlayer.mlp.gate_proj.weight"].T
        up = m @ w["midlayer.mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        outputs.append(h)
    return outputs


def tiny_draft() -> tuple[Eagle3Draft, DraftConfig]:
    config = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=40, draft_vocab_size=16,
                         rope={"rope_type": "default", "rope_theta": 500.0})
    torch.manual_seed(0)
    model = Eagle3Draft(config, embed_weight=torch.randn(40, 32), init_std=0.2)
    with torch.no_grad():  # norms away from 1 so a missing norm weight shows
        for name, param in model.trainable().items():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model, config


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_forward_matches_a_hand_written_reference(steps: int) -> None:
    model, config = tiny_draft()
    aux = torch.randn(2, 7, 96)
    ids = torch.randint(0, 40, (2, 7))
    ours = [h.detach() for h in model.unroll(aux, ids, steps)]
    weights = {n: t.detach().double() for n, t in model.state_dict().items()}
    for b in range(2):
        expected = reference_unroll(weights, config, aux[b].double(), ids[b], steps)
        for i in range(steps):
            torch.testing.assert_close(ours[i][b].double(), expected[i], atol=2e-5, rtol=1e-4)
            logits = rms_norm(expected[i], weights["norm.weight"], config.rms_norm_eps) \
                @ weights["lm_head.weight"].T
            torch.testing.assert_close(model.logits(ours[i][b]).detach().double(), logits,
                                       atol=2e-5, rtol=1e-4)


def test_each_ttt_step_is_scored_against_the_target_t_plus_1_plus_i() -> None:
    model, config = tiny_draft()
    steps, length = 3, 9
    aux, ids = torch.randn(2, length, 96), torch.randint(0, 40, (2, length))
    target_logits = torch.randn(2, length, 16) * 3
    valid = torch.rand(2, length) > 0.3
    losses, correct, counts = ttt_losses(model, aux, ids, target_logits, valid, steps)
    hidden = [h.detach() for h in model.unroll(aux, ids, steps)]
    for i in range(steps):
        terms, hits = [], 0
        for b in range(2):
            for t in range(length - 1 - i):
                if not valid[b, t + 1 + i]:
                    continue
                draft = model.logits(hidden[i][b, t]).detach()
                target = target_logits[b, t + 1 + i].softmax(-1)
                terms.append(-(target * F.log_softmax(draft, -1)).sum())
                hits += int(draft.argmax() == target.argmax())
        assert int(counts[i]) == len(terms) > 0
        torch.testing.assert_close(losses[i].detach(), torch.stack(terms).mean())
        assert int(correct[i]) == hits


# -- 2. learning ----------------------------------------------------------------------

@pytest.mark.slow
def test_loss_decreases_on_extracted_data(tiny: dict[str, Path], tmp_path: Path) -> None:
    args = parse_args(["--data", str(tiny["data"]), "--target", str(tiny["model"]),
                       "--vocab", str(tiny["vocab"]), "--out", str(tmp_path), "--ttt-steps",
                       "3"])
    data = ExtractedData(args.data)
    model, head = build_model(args, data, torch.device("cpu"))
    optimizer = build_optimizer(model, 3e-3)
    scheduler = build_scheduler(optimizer, 0, 10_000)
    batch = load_batch(data.root, data.samples[:8], 64, 4096)
    history = [train_step(model, head, batch, optimizer, scheduler, ttt_steps=3).read()
               for _ in range(30)]
    losses = [m["loss"] for m in history]
    # measured (seeds 0-2): the last five average 0.11x the first step's loss (~10 -> ~1.1;
    # the target's own entropy is the floor), acc_0 goes from 0-0.1 to 1.0
    assert sum(losses[-5:]) / 5 < 0.25 * losses[0], losses
    assert history[-1]["acc_0"] >= 0.9 > history[0]["acc_0"]
    assert all(math.isfinite(x) for x in losses)
    assert {"loss_0", "loss_2", "acc_0", "acc_2", "lr", "grad_norm"} <= set(history[-1])


def test_head_starts_as_the_targets_rows_and_norm(tiny: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """--head-init target: the draft's logits before any step are the target's lm_head
    over the draft vocabulary after the target's final norm; random (the default)
    leaves neither."""
    target = tmp_path / "target"  # the tiny model with a final norm away from ones
    shutil.copytree(tiny["model"], target)
    weights = load_file(target / "model.safetensors")
    weights["model.norm.weight"] = torch.linspace(0.5, 1.5, weights["model.norm.weight"]
                                                  .numel()).to(weights["model.norm.weight"])
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    base = ["--data", str(tiny["data"]), "--target", str(target), "--vocab",
            str(tiny["vocab"]), "--out", str(tmp_path / "out")]
    data = ExtractedData(tiny["data"])
    model, _ = build_model(parse_args([*base, "--head-init", "target"]), data,
                           torch.device("cpu"))
    rows = weights["lm_head.weight"][model.t2d]
    assert rows.shape[0] == model.config.draft_vocab_size
    assert torch.equal(model.lm_head.weight, rows.float())
    assert torch.equal(model.norm.weight, weights["model.norm.weight"].float())
    random, _ = build_model(parse_args(base), data, torch.device("cpu"))
    assert not torch.equal(random.lm_head.weight, rows.float())
    assert torch.equal(random.norm.weight, torch.ones_like(random.norm.weight))


def test_recomputed_head_gives_the_same_losses_and_gradients() -> None:
    """The head and loss of each TTT step are recomputed in backward (checkpoint), not
    kept: the same losses, hits and gradients as keeping them."""
    model, config = tiny_draft()
    generator = torch.Generator().manual_seed(1)
    aux = torch.randn(2, 9, 3 * config.hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=generator)
    target = torch.randn(2, 9, config.draft_vocab_size, generator=generator)
    valid = torch.rand(2, 9, generator=generator) > 0.3

    def recomputed() -> tuple[list[float], list[int], dict[str, torch.Tensor]]:
        model.zero_grad()
        losses, hits, _ = ttt_losses(model, aux, ids, target, valid, 3)
        sum(losses).backward()
        return ([x.item() for x in losses], [int(h) for h in hits],
                {n: p.grad.clone() for n, p in model.trainable().items()})

    def kept() -> tuple[list[float], list[int], dict[str, torch.Tensor]]:
        """The same sums with every step's logits kept for backward."""
        model.zero_grad()
        losses, hits = [], []
        for i, hidden in enumerate(model.unroll(aux, ids, 3)):
            mask = valid[:, 1 + i:]
            total, hit = head_loss(model, hidden[:, :9 - 1 - i][mask], target[:, 1 + i:][mask])
            losses.append(total / mask.sum().clamp(min=1))
            hits.append(int(hit))
        sum(losses).backward()
        return ([x.item() for x in losses], hits,
                {n: p.grad.clone() for n, p in model.trainable().items()})

    kept, recomputed = kept(), recomputed()
    assert kept[0] == pytest.approx(recomputed[0], rel=1e-6)
    assert kept[1] == recomputed[1]
    for name, grad in kept[2].items():
        assert torch.allclose(grad, recomputed[2][name], atol=1e-7), name
    assert any(g.abs().sum() > 0 for g in kept[2].values())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_the_fused_head_gives_the_reference_losses_and_gradients(temperature: float) -> None:
    """`ttt_losses_fused` (rows from the loss mask on the host, the target's argmax a
    weight, the head and loss fused in chunks with their gradients made at once) against
    the reference `ttt_losses` in fp32: the same losses, hits, counts and gradients,
    with chunks smaller than a step's rows so that several are summed."""
    model, config = tiny_draft()
    generator = torch.Generator().manual_seed(3)
    steps, length = 3, 11
    aux = torch.randn(3, length, 3 * config.hidden_size, generator=generator)
    ids = torch.randint(0, config.vocab_size, (3, length), generator=generator)
    target = 3 * torch.randn(3, length, config.draft_vocab_size, generator=generator)
    loss_mask = torch.rand(3, length, generator=generator) > 0.25
    loss_mask[2, 6:] = False  # padding
    valid = loss_mask & (torch.rand(3, length, generator=generator) > 0.2)

    def run(fused: bool) -> tuple[list[float], list[int], list[int], dict[str, torch.Tensor]]:
        model.zero_grad()
        if fused:
            losses, hits, counts = ttt_losses_fused(
                model, aux, ids, target, valid, ScoredRows.of(loss_mask, steps), steps,
                temperature=temperature)
        else:
            losses, hits, counts = ttt_losses(model, aux, ids, target, valid, steps,
                                              temperature=temperature)
        sum(0.8 ** i * x for i, x in enumerate(losses)).backward()
        return ([x.item() for x in losses], [int(h) for h in hits], [int(n) for n in counts],
                {n: p.grad.clone() for n, p in model.trainable().items()})

    reference = run(False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_loss, "CHUNK_ROWS", 5)
        fused = run(True)
    assert fused[0] == pytest.approx(reference[0], rel=1e-5)
    assert fused[1:3] == reference[1:3] and all(n > 5 for n in fused[2])
    for name, grad in reference[3].items():
        torch.testing.assert_close(fused[3][name], grad, atol=1e-6, rtol=1e-4)
    assert all(g.abs().sum() > 0 for g in reference[3].values())


def test_fused_and_reference_steps_train_alike_and_a_non_finite_step_is_skipped(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """Whole optimizer steps on real extracted data, fp32: the fused step (metrics kept
    on the device, the skip decided there) gives the reference step's losses step after
    step; a batch with a NaN feature is skipped by both, the weights untouched."""
    args = parse_args(["--data", str(tiny["data"]), "--target", str(tiny["model"]),
                       "--vocab", str(tiny["vocab"]), "--out", str(tmp_path), "--ttt-steps",
                       "3"])
    data = ExtractedData(args.data)
    batch = load_batch(data.root, data.samples[:8], 64, 4096)
    runs = {}
    for fused in (False, True):
        model, head = build_model(args, data, torch.device("cpu"))
        optimizer = build_optimizer(model, 3e-3)
        scheduler = build_scheduler(optimizer, 0, 100)
        scaler = new_scaler(torch.device("cpu"))
        history = [train_step(model, head, batch, optimizer, scheduler, ttt_steps=3,
                              scaler=scaler, fused=fused).read() for _ in range(4)]
        before = {n: p.detach().clone() for n, p in model.trainable().items()}
        poisoned = dataclasses.replace(batch, aux=batch.aux.clone())
        poisoned.aux[0, 3, 0] = float("nan")
        skipped = train_step(model, head, poisoned, optimizer, scheduler, ttt_steps=3,
                             scaler=scaler, fused=fused)
        assert skipped.read().get("skipped") == 1.0 and float(skipped.skipped()) == 1.0
        assert all(torch.equal(p, before[n]) for n, p in model.trainable().items())
        history.append(train_step(model, head, batch, optimizer, scheduler, ttt_steps=3,
                                  scaler=scaler, fused=fused).read())
        runs[fused] = history
    for reference, fused in zip(runs[False], runs[True], strict=True):
        assert set(fused) == set(reference)
        for name in ("loss", "loss_0", "loss_2", "acc_0", "acc_2"):
            assert fused[name] == pytest.approx(reference[name], rel=1e-4, abs=1e-6), name
    assert runs[True][-1]["loss"] < runs[True][0]["loss"]


def test_target_temperature_sharpens_the_targets_and_0_is_the_argmax() -> None:
    """T = 1 is the soft cross-entropy against the target's softmax; T = 0 the plain
    cross-entropy against its argmax; a small T approaches that; hits do not depend on
    T (they count draft argmax == target argmax)."""
    model, config = tiny_draft()
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(11, config.hidden_size, generator=generator)
    target = 3 * torch.randn(11, config.draft_vocab_size, generator=generator)
    logits = model.logits(rows).float()
    soft, soft_hits = head_loss(model, rows, target)
    expected = -(target.softmax(-1) * logits.log_softmax(-1)).sum()
    assert soft.item() == pytest.approx(expected.item(), rel=1e-5)
    hard, hard_hits = head_loss(model, rows, target, 0.0)
    assert hard.item() == pytest.approx(
        F.cross_entropy(logits, target.argmax(-1), reduction="sum").item(), rel=1e-5)
    sharp, sharp_hits = head_loss(model, rows, target, 1e-3)
    assert sharp.item() == pytest.approx(hard.item(), rel=1e-4)
    half, _ = head_loss(model, rows, target, 0.5)
    expected = -((target / 0.5).softmax(-1) * logits.log_softmax(-1)).sum()
    assert half.item() == pytest.approx(expected.item(), rel=1e-5)
    assert soft_hits == hard_hits == sharp_hits == (logits.argmax(-1) == target.argmax(-1)).sum()
    assert soft.item() != pytest.approx(hard.item(), rel=1e-2)


def test_wider_draft_mlp_is_written_and_loads_back(tiny: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """--draft-intermediate-size widens the draft's MLP: config.json says so (the
    engines build the draft from it), the weights have that shape and load_draft reads
    them back; --target-temperature 0 trains (its held-out loss is still at T = 1)."""
    out = tmp_path / "wide"
    summary = run_train(tiny, out, "--batch-tokens", "1024", "--ttt-steps", "2",
                        "--max-steps", "3", "--draft-intermediate-size", "96",
                        "--target-temperature", "0")
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["intermediate_size"] == 96
    with safe_open(str(out / "draft" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("midlayer.mlp.up_proj.weight").get_shape() == [96, 64]
        assert f.get_slice("midlayer.mlp.down_proj.weight").get_shape() == [64, 96]
    embed = load_file(tiny["model"] / "model.safetensors")["model.embed_tokens.weight"]
    draft = load_draft(out / "draft", embed.float())
    assert draft.midlayer.mlp.gate_proj.weight.shape == (96, 64)
    loss_0 = summary["chosen"]["loss_i"][0]
    assert math.isfinite(loss_0) and loss_0 > 0
    # --init from it keeps its width without being told
    run_train(tiny, tmp_path / "again", "--batch-tokens", "1024", "--ttt-steps", "2",
              "--max-steps", "1", "--init", str(out / "draft"))
    again = json.loads((tmp_path / "again" / "draft" / "config.json").read_text())
    assert again["intermediate_size"] == 96


@pytest.mark.parametrize("flag", [["--draft-intermediate-size", "0"],
                                  ["--target-temperature", "-1"],
                                  ["--target-temperature", "nan"]])
def test_bad_width_or_temperature_is_a_usage_error(flag: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--data", "d", "--target", "t", "--out", "o", *flag])
    assert exited.value.code == 2


# -- 3. kill -9 and resume --------------------------------------------------------------

def read_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_kill_minus_9_then_resume_matches_an_uninterrupted_run(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    args = ["--batch-tokens", "768", "--epochs", "2", "--save-every", "3", "--seed", "5",
            "--ttt-steps", "3", "--lr", "3e-3", "--draft-dtype", "fp32"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    trace = tmp_path / "broken.trace"
    reference = subprocess.Popen(train_cli(tiny, whole, *args), cwd=REPO, env=ENV,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    victim = subprocess.Popen(train_cli(tiny, broken, *args, "--trace-data", str(trace)),
                              cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (broken / "checkpoints" / "latest").exists(), 90, interval=0.01,
                 what="a first checkpoint")
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert not (broken / "draft").exists(), "the run finished before the kill"
    pointer = (broken / "checkpoints" / "latest").read_text().strip()
    killed_at = int(pointer.removeprefix("step_"))
    resumed = subprocess.run(train_cli(tiny, broken, *args, "--trace-data", str(trace)),
                             cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {broken / 'checkpoints' / pointer} (step {killed_at}" \
        in resumed.stderr
    _, stderr = reference.communicate(timeout=120)
    assert reference.returncode == 0, stderr[-3000:]

    latest = (whole / "checkpoints" / "latest").read_text().strip()
    final = json.loads((whole / "checkpoints" / latest / "trainer_state.json").read_text())
    total = final["total_steps"]
    assert final["step"] == total > killed_at
    state = json.loads((broken / "checkpoints" / f"step_{total:07d}" /
                        "trainer_state.json").read_text())
    assert state["step"] == total
    # the resumed run wrote the last total - killed_at lines; of the killed run's lines,
    # those after its last checkpoint were done again, so they do not count
    lines = read_trace(trace)
    redone = total - killed_at
    lines = [x for x in lines[:-redone] if x["step"] <= killed_at] + lines[-redone:]
    assert [x["step"] for x in lines] == list(range(1, total + 1))
    held = state["heldout_indices"]  # the default: 1 of 32 samples, never trained on
    assert len(held) == 1 and held == final["heldout_indices"]
    for epoch in (0, 1):
        used = Counter(i for x in lines if x["epoch"] == epoch for i in x["indices"])
        assert sorted(used) == sorted(set(range(32)) - set(held))
        assert set(used.values()) == {1}
    # weights and optimizer state as if never interrupted
    got = load_file(broken / "draft" / "model.safetensors")
    want = load_file(whole / "draft" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5)
    assert read_trace(broken / "heldout.jsonl") == read_trace(whole / "heldout.jsonl")
    assert json.loads((broken / "train_summary.json").read_text()) \
        == json.loads((whole / "train_summary.json").read_text())
    optimizer = torch.load(broken / "checkpoints" / f"step_{total:07d}" / "optimizer.pt",
                           weights_only=True)
    assert all(int(s["step"]) == total for s in optimizer["state"].values())
    kept = {p.name for p in (broken / "checkpoints").iterdir()}
    assert kept == {"latest", f"step_{total:07d}", f"step_{total - 3:07d}"}


@pytest.mark.slow
@pytest.mark.parametrize("readers", ["0", "2"])
def test_sigterm_saves_a_checkpoint_and_exits_143(tiny: dict[str, Path], tmp_path: Path,
                                                  readers: str) -> None:
    """SIGTERM to the job's whole process group, as the shim sends it: with reader
    processes too (`--read-processes 2`, the GPU default), the trainer saves and exits
    143, not a reader's death raised in the loop."""
    out, trace = tmp_path / "out", tmp_path / "trace"
    process = subprocess.Popen(
        train_cli(tiny, out, "--batch-tokens", "512", "--epochs", "3", "--ttt-steps", "2",
                  "--trace-data", str(trace), "--read-processes", readers), cwd=REPO, env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: trace.exists() and len(trace.read_text().splitlines()) >= 2, 90,
                 interval=0.01, what="two steps")
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 143, stderr[-2000:]
    done = len(read_trace(trace))
    state = json.loads((out / "checkpoints" / f"step_{done:07d}" / "trainer_state.json")
                       .read_text())  # --save-every is 1000: only SIGTERM saved it
    assert state["step"] == done < 27 and not (out / "draft").exists()
    assert "checkpoint saved; rerun to resume" in stderr


def test_reader_processes_train_the_same_draft_as_a_reader_thread(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """`--read-processes 2` (a GPU's default) reads the same batches in the same order as
    one thread (a CPU's): the same trace and, bit for bit, the same draft."""
    args = ["--batch-tokens", "768", "--epochs", "1", "--ttt-steps", "2", "--seed", "3",
            "--draft-dtype", "fp32", "--heldout-samples", "8"]
    runs = {}
    for readers in ("0", "2"):
        out = tmp_path / f"readers-{readers}"
        result = subprocess.run(train_cli(tiny, out, *args, "--read-processes", readers,
                                          "--trace-data", str(out) + ".trace"),
                                cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[readers] = out
    assert read_trace(Path(str(runs["0"]) + ".trace")) == read_trace(
        Path(str(runs["2"]) + ".trace"))
    assert (runs["0"] / "draft" / "model.safetensors").read_bytes() == (
        runs["2"] / "draft" / "model.safetensors").read_bytes()


# -- 4. --init, and what is refused -----------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run's output directory (its draft is the --init of the tests below)."""
    out = tmp_path_factory.mktemp("trained")
    args = ["--data", str(tiny["data"]), "--target", str(tiny["model"]), "--vocab",
            str(tiny["vocab"]), "--out", str(out), "--batch-tokens", "1024", "--ttt-steps",
            "2", "--lr", "3e-3"]
    from workers.train import main

    assert main(args) == 0
    return out


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str]:
    from workers.train import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def other_vocab(tiny: dict[str, Path], path: Path, size: int = 64) -> Path:
    """A valid mapping of `size` ids that is not the draft's."""
    t2d = torch.zeros(384, dtype=torch.bool)
    t2d[torch.arange(size) * 5] = True
    used = torch.nonzero(t2d).reshape(-1)
    save_file({"d2t": used - torch.arange(size), "t2d": t2d}, str(path))
    return path


def test_init_reuses_the_drafts_mapping_and_refuses_another(
        tiny: dict[str, Path], trained: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    init = trained / "draft"
    common = ["--data", tiny["data"], "--target", tiny["model"], "--init", init,
              "--max-steps", "1", "--ttt-steps", "2", "--lr", "1e-12"]
    code, err = run_main(capsys, *common, "--out", tmp_path / "a")
    assert code == 0, err
    # one step at lr 1e-12 moves no bf16 weight: the run started from the draft's weights
    before, after = load_file(init / "model.safetensors"), load_file(
        tmp_path / "a" / "draft" / "model.safetensors")
    for name in before:
        assert torch.equal(before[name], after[name]), name
    code, err = run_main(capsys, *common, "--vocab", tiny["vocab"], "--out", tmp_path / "b")
    assert code == 0, err  # the same mapping given explicitly is fine
    code, err = run_main(capsys, *common, "--vocab", other_vocab(tiny, tmp_path / "v"),
                         "--out", tmp_path / "c")
    assert code == 2 and err.startswith("error: --vocab") and "differs from the d2t/t2d" in err
    assert "Traceback" not in err and not (tmp_path / "c" / "draft").exists()


def fake_target(path: Path, hidden: int, vocab_size: int) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab_size, "rms_norm_eps": 1e-5}))
    save_file({"model.embed_tokens.weight": torch.randn(vocab_size, hidden),
               "lm_head.weight": torch.randn(vocab_size, hidden)},
              str(path / "model.safetensors"))
    return path


def test_bad_inputs_exit_2_without_traceback(tiny: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", tmp_path / "out"]
    cases = {
        "does not exist": ["--data", tmp_path / "nope", "--target", tiny["model"],
                           "--vocab", tiny["vocab"]],
        "hidden_size 64 but the --target has 32": [
            "--data", tiny["data"], "--target", fake_target(tmp_path / "t32", 32, 384),
            "--vocab", tiny["vocab"]],
        "vocab_size 384 but the --target has 400": [
            "--data", tiny["data"], "--target", fake_target(tmp_path / "v400", 64, 400),
            "--vocab", tiny["vocab"]],
        "vocab size mismatch": ["--data", tiny["data"], "--target", tiny["model"], "--vocab",
                                other_vocab_file(tmp_path / "v.safetensors")],
        "--vocab is required": ["--data", tiny["data"], "--target", tiny["model"]],
    }
    for expected, args in cases.items():
        code, err = run_main(capsys, *args, *out)
        assert code == 2 and err.startswith("error: ") and expected in err, (expected, err)
        assert "Traceback" not in err
    assert not (tmp_path / "out" / "draft").exists()


def other_vocab_file(path: Path) -> Path:
    """A mapping for a 400-id target."""
    t2d = torch.zeros(400, dtype=torch.bool)
    t2d[:64] = True
    save_file({"d2t": torch.zeros(64, dtype=torch.int64), "t2d": t2d}, str(path))
    return path


# -- 5. the saved draft -----------------------------------------------------------------

def test_saved_draft_has_sglang_names_config_and_the_mapping(tiny: dict[str, Path],
                                                             trained: Path) -> None:
    config = json.loads((trained / "draft" / "config.json").read_text())
    target = json.loads((tiny["model"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert config[key] == target[key], key
    assert config["draft_vocab_size"] == 64 and config["torch_dtype"] == "bfloat16"
    assert config["rope_theta"] == target["rope_parameters"]["rope_theta"]
    assert config["rope_scaling"] is None
    # layer inputs [2, 4, 5]: as such for vLLM, minus one (nested) for SGLang
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                      "use_aux_hidden_state": True}
    assert "n_predict" not in config
    with safe_open(str(trained / "draft" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        shapes = {k: f.get_slice(k).get_shape() for k in names}
    layer = "midlayer."
    assert shapes == {
        "fc.weight": [64, 192], "norm.weight": [64], "lm_head.weight": [64, 64],
        "d2t": [64], "t2d": [384],
        f"{layer}input_layernorm.weight": [64], f"{layer}hidden_norm.weight": [64],
        f"{layer}post_attention_layernorm.weight": [64],
        f"{layer}self_attn.q_proj.weight": [64, 128], f"{layer}self_attn.k_proj.weight": [32, 128],
        f"{layer}self_attn.v_proj.weight": [32, 128], f"{layer}self_attn.o_proj.weight": [64, 64],
        f"{layer}mlp.gate_proj.weight": [128, 64], f"{layer}mlp.up_proj.weight": [128, 64],
        f"{layer}mlp.down_proj.weight": [64, 128]}
    saved, mapping = load_file(trained / "draft" / "model.safetensors"), load_file(tiny["vocab"])
    assert torch.equal(saved["d2t"], mapping["d2t"]) and torch.equal(saved["t2d"], mapping["t2d"])
    assert saved["fc.weight"].dtype == torch.bfloat16  # no embed_tokens: the target's serves
    # workers.vocab reads the mapping back from the draft directory
    d2t, t2d, rows = vocab.load_mapping(trained / "draft")
    assert torch.equal(d2t, mapping["d2t"]) and torch.equal(t2d, mapping["t2d"]) and rows == 64
    # transformers reads the config (rope from rope_theta/rope_scaling)
    from transformers import LlamaConfig

    loaded = LlamaConfig.from_pretrained(trained / "draft")
    assert loaded.rope_parameters["rope_theta"] == config["rope_theta"]


# -- 6. the held-out measure and the choice of the draft --------------------------------

def test_simulated_tau_by_hand() -> None:
    accs = [0.5, 0.5, 1.0, 0.0, 1.0]
    # 1 + 0.5, + 0.25, + 0.25, + 0, + 0
    assert [simulated_tau(accs, k) for k in range(1, 6)] == [1.5, 1.75, 2.0, 2.0, 2.0]
    assert simulated_tau([1.0] * 7, 7) == 8.0 and simulated_tau([0.0, 1.0], 2) == 1.0
    with pytest.raises(ValueError):
        simulated_tau(accs, 6)
    assert reported_ks(7, 5) == [3, 5, 7] and reported_ks(2, 2) == [2] \
        and reported_ks(7, 4) == [3, 4, 5, 7]


def test_heldout_count_default_share_and_count() -> None:
    assert [heldout_count(None, n) for n in (1, 19, 20, 60, 100, 1000, 12_800, 100_000)] \
        == [0, 0, 1, 1, 2, 20, 256, 256]
    assert heldout_count("0", 1000) == 0 and heldout_count("0.0", 1000) == 0
    assert heldout_count("7", 1000) == 7 and heldout_count("0.05", 1000) == 50
    assert heldout_count("0.001", 50) == 1  # a share never rounds to none
    for bad in ("1.5", "-1", "abc"):
        with pytest.raises(ValueError):
            heldout_count(bad, 1000)
    assert default_eval_every(steps_per_epoch=100, total_steps=300) == 75  # 4 over the run
    assert default_eval_every(steps_per_epoch=100, total_steps=1000) == 100  # each epoch
    assert default_eval_every(steps_per_epoch=3, total_steps=2) == 1


def test_hold_out_is_seeded_stable_and_disjoint(tiny: dict[str, Path]) -> None:
    def split(count: int, seed: int) -> tuple[list[int], list[int]]:
        data = ExtractedData(tiny["data"])
        data.hold_out(count, seed)
        return [s.index for s in data.samples], [s.index for s in data.heldout]

    training, held = split(5, seed=3)
    assert split(5, seed=3) == (training, held)  # a rerun holds out the same ones
    assert len(held) == 5 and not set(held) & set(training)
    assert sorted(training + held) == list(range(32)) and held == sorted(held)
    assert split(5, seed=4)[1] != held
    assert split(0, seed=3) == (list(range(32)), [])
    with pytest.raises(TrainError, match="at least one must be left"):
        split(32, seed=3)


def test_heldout_measure_matches_a_brute_force_count() -> None:
    model, config = tiny_draft()
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 32, generator=generator)
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[torch.arange(16) * 2] = True
    weight[t2d] *= 3  # most argmaxes inside the draft vocabulary: valid positions
    head = TargetHead(weight, t2d)
    batches = []
    for size, length in ((2, 9), (3, 6)):
        mask = torch.rand(size, length, generator=generator) > 0.2
        batches.append(Batch(torch.randn(size, length, 96, generator=generator),
                             torch.randn(size, length, 32, generator=generator),
                             torch.randint(0, 40, (size, length), generator=generator), mask,
                             list(range(size)), int(mask.sum())))
    steps = 3
    model.train()
    measure = measure_heldout(model, head, batches, ttt_steps=steps, step=7, epoch=1)
    assert model.training  # left as it was found
    hits, counts, terms = [0] * steps, [0] * steps, [[] for _ in range(steps)]
    with torch.no_grad():
        for batch in batches:
            target_logits, valid = head(batch.hidden, batch.loss_mask)
            hidden = list(model.unroll(batch.aux, batch.input_ids, steps))
            for i in range(steps):
                for b in range(batch.input_ids.shape[0]):
                    for t in range(batch.input_ids.shape[1] - 1 - i):
                        if valid[b, t + 1 + i]:
                            draft = model.logits(hidden[i][b, t])
                            target = target_logits[b, t + 1 + i]
                            counts[i] += 1
                            hits[i] += int(draft.argmax() == target.argmax())
                            terms[i].append(-(target.softmax(-1)
                                              * F.log_softmax(draft, -1)).sum())
    assert measure.counts == counts and min(counts) > 0
    assert measure.accs == [h / n for h, n in zip(hits, counts, strict=True)]
    assert 0 < sum(hits) < sum(counts)  # a case where the accuracies are not trivial
    for i in range(steps):  # the mean over all held-out positions, not of batch means
        assert measure.losses[i] == pytest.approx(float(torch.stack(terms[i]).mean()),
                                                  rel=1e-5)
    expected, chain = 1.0, 1.0
    for k in range(1, steps + 1):
        chain *= hits[k - 1] / counts[k - 1]
        expected += chain
        assert measure.tau_sim[k] == pytest.approx(expected)
    assert (measure.step, measure.epoch) == (7, 1)
    assert HeldoutMeasure.from_record(json.loads(json.dumps(measure.record()))) == measure


def run_train(tiny: dict[str, Path], out: Path, *extra: str) -> dict[str, Any]:
    """An in-process run; its out/train_summary.json."""
    from workers.train import main

    assert main(["--data", str(tiny["data"]), "--target", str(tiny["model"]), "--vocab",
                 str(tiny["vocab"]), "--out", str(out), *extra]) == 0
    return json.loads((out / "train_summary.json").read_text())


def heldout_lines(out: Path) -> list[dict[str, Any]]:
    return read_trace(out / "heldout.jsonl")


def measure_dir(tiny: dict[str, Path], weights: Path, count: int, seed: int,
                ttt_steps: int) -> HeldoutMeasure:
    """The held-out measure of the weights in `weights`, computed afresh."""
    args = parse_args(["--data", str(tiny["data"]), "--target", str(tiny["model"]),
                       "--vocab", str(tiny["vocab"]), "--out", "unused"])
    data = ExtractedData(tiny["data"])
    data.hold_out(count, seed)
    model, head = build_model(args, data, torch.device("cpu"))
    model.load_trainable(load_draft_weights(weights, model))
    batches = [load_batch(data.root, samples, 64, 768)
               for samples in pack_heldout(data.heldout, 768)]
    return measure_heldout(model, head, batches, ttt_steps=ttt_steps, step=0, epoch=0)


@pytest.mark.slow
def test_the_draft_is_the_held_out_peak_not_the_last_step(tiny: dict[str, Path],
                                                          tmp_path: Path) -> None:
    # an lr that grows to absurd values (warmup longer than the run) makes the held-out
    # measure jump up and down; the warmup makes the schedule the same for any length
    args = ["--batch-tokens", "768", "--ttt-steps", "3", "--lr", "1", "--warmup-steps", "200",
            "--heldout-samples", "4", "--eval-every", "1", "--seed", "0",
            "--draft-dtype", "fp32", "--epochs", "3"]
    probe = run_train(tiny, tmp_path / "probe", *args, "--max-steps", "12")
    taus = [x["tau_sim"]["3"] for x in heldout_lines(tmp_path / "probe")]
    assert probe["chosen_step"] == max(range(1, 13), key=lambda s: (taus[s - 1], s))
    # the first step after which the measure fell below an earlier one: stop there
    last = next(s for s in range(2, 13) if taus[s - 1] < max(taus[:s - 1]))
    out = tmp_path / "peak"
    summary = run_train(tiny, out, *args, "--max-steps", str(last))
    lines = heldout_lines(out)
    assert [x["step"] for x in lines] == list(range(1, last + 1))
    assert [x["tau_sim"]["3"] for x in lines] == taus[:last]  # the same trajectory
    chosen = summary["chosen_step"]
    assert chosen == max(range(1, last + 1), key=lambda s: (taus[s - 1], s)) != last
    assert summary["last_step"] == last and summary["select"] == "best"
    assert summary["chosen"]["step"] == chosen and summary["last"]["step"] == last
    assert [x["step"] for x in lines if x["best"]][-1] == chosen
    # out/draft/ holds the chosen step's weights (out/best/), not the last checkpoint's
    draft = load_file(out / "draft" / "model.safetensors")
    best = load_file(out / "best" / f"step_{chosen:07d}" / "model.safetensors")
    final = load_file(out / "checkpoints" / f"step_{last:07d}" / "model.safetensors")
    assert all(torch.equal(draft[n], best[n]) for n in draft)
    assert any(not torch.equal(draft[n], final[n]) for n in draft)
    assert json.loads((out / "best" / f"step_{chosen:07d}" / "heldout.json")
                      .read_text())["step"] == chosen
    # measured afresh: the draft written beats the last step on the held-out samples
    ours = measure_dir(tiny, out / "draft", 4, 0, 3)
    theirs = measure_dir(tiny, out / "checkpoints" / f"step_{last:07d}", 4, 0, 3)
    assert ours.accs == summary["chosen"]["acc"] and theirs.accs == summary["last"]["acc"]
    assert ours.tau_sim[3] > theirs.tau_sim[3]
    # --select last: the old behaviour, the measure still logged
    kept = run_train(tiny, tmp_path / "last", *args, "--max-steps", str(last),
                     "--select", "last")
    assert kept["chosen_step"] == last and kept["best"]["step"] == chosen
    last_draft = load_file(tmp_path / "last" / "draft" / "model.safetensors")
    assert all(torch.equal(last_draft[n], final[n]) for n in last_draft)
    assert not (tmp_path / "last" / "best").exists()


@pytest.mark.slow
def test_heldout_samples_never_reach_a_training_batch_and_0_disables(
        tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--batch-tokens", "768", "--ttt-steps", "2", "--epochs", "2", "--lr", "3e-3",
            "--draft-dtype", "fp32"]
    out, trace = tmp_path / "held", tmp_path / "held.trace"
    monkeypatch.setenv("JOBSUP_PROGRESS_FILE", str(tmp_path / "progress.json"))
    summary = run_train(tiny, out, *args, "--heldout-samples", "5", "--trace-data", str(trace))
    metrics = json.loads((tmp_path / "progress.json").read_text())["metrics"]
    last_measure = heldout_lines(out)[-1]
    assert metrics["heldout_tau_2"] == last_measure["tau_sim"]["2"]
    assert [metrics["heldout_acc_0"], metrics["heldout_acc_1"]] == last_measure["acc"]
    assert metrics["heldout_best_step"] == summary["best"]["step"]
    assert metrics["heldout_loss"] == pytest.approx(last_measure["loss"])
    state = json.loads((out / "checkpoints" / f"step_{summary['last_step']:07d}" /
                        "trainer_state.json").read_text())
    held = state["heldout_indices"]
    assert len(held) == 5 == summary["heldout_samples"]
    lines = read_trace(trace)
    for epoch in (0, 1):
        used = Counter(i for x in lines if x["epoch"] == epoch for i in x["indices"])
        assert sorted(used) == sorted(set(range(32)) - set(held))
        assert set(used.values()) == {1}
    measured = heldout_lines(out)
    assert measured and measured[-1]["step"] == summary["last_step"]
    assert all(x["counts"][0] > 0 for x in measured)
    # default --eval-every: each epoch (steps_per_epoch < total / 4 is not the case here)
    assert summary["eval_every"] == max(1, min(len(lines) // 2, -(-len(lines) // 4)))

    out, trace = tmp_path / "none", tmp_path / "none.trace"
    summary = run_train(tiny, out, *args, "--heldout-samples", "0", "--trace-data", str(trace))
    lines = read_trace(trace)
    used = Counter(i for x in lines if x["epoch"] == 0 for i in x["indices"])
    assert sorted(used) == list(range(32))
    assert summary["heldout_samples"] == 0 and summary["select"] == "last"
    assert summary["chosen_step"] == summary["last_step"] == len(lines)
    assert not (out / "heldout.jsonl").exists() and not (out / "best").exists()
    draft = load_file(out / "draft" / "model.safetensors")
    final = load_file(out / "checkpoints" / f"step_{len(lines):07d}" / "model.safetensors")
    assert all(torch.equal(draft[n], final[n]) for n in draft)


class KilledError(Exception):
    """Stands for a kill -9 at a chosen point of an in-process run."""


class KillAfterMeasure(ProgressReporter):
    """Raises at the progress update that follows the held-out measure of `step`: after
    a new best is written to out/best/, before the step's checkpoint."""

    def __init__(self, step: int):
        super().__init__(None, "step", path="")
        self.step = step

    def update(self, done: int, metrics: Any = None, *, force: bool = False) -> None:
        if done == self.step and force and metrics and "heldout_tau_3" in metrics:
            raise KilledError


@pytest.mark.slow
def test_a_killed_and_resumed_run_chooses_the_same_draft(tiny: dict[str, Path],
                                                         tmp_path: Path) -> None:
    from workers.train import train

    common = ["--data", str(tiny["data"]), "--target", str(tiny["model"]), "--vocab",
              str(tiny["vocab"]), "--batch-tokens", "768", "--ttt-steps", "3", "--lr", "1",
              "--warmup-steps", "200", "--heldout-samples", "4", "--eval-every", "2",
              "--save-every", "3", "--max-steps", "12", "--epochs", "3",
              "--draft-dtype", "fp32"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert train(parse_args([*common, "--out", str(whole)]),
                 ProgressReporter(None, "step", path="")) == 0
    lines = heldout_lines(whole)
    summary = json.loads((whole / "train_summary.json").read_text())
    # killed after a new best at a step that is not a checkpoint's (4, 8 or 10): its
    # out/best/ is newer than the checkpoint the rerun resumes from, which measures it again
    # (measured: bests at 2, 4, 6, 8 and 10, the last step 12 worse)
    best_steps = [x["step"] for x in lines if x["best"] and x["step"] % 3 and x["step"] > 3]
    kill_at = best_steps[-1] if best_steps else 4
    with pytest.raises(KilledError):
        train(parse_args([*common, "--out", str(broken)]), KillAfterMeasure(kill_at))
    assert not (broken / "draft").exists()
    if kill_at in best_steps:  # written before the kill, newer than the last checkpoint
        assert (broken / "best" / f"step_{kill_at:07d}").is_dir()
    assert train(parse_args([*common, "--out", str(broken)]),
                 ProgressReporter(None, "step", path="")) == 0
    assert heldout_lines(broken) == lines  # one line per measure, none twice
    assert json.loads((broken / "train_summary.json").read_text()) == summary
    got = load_file(broken / "draft" / "model.safetensors")
    want = load_file(whole / "draft" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert sorted(p.name for p in (broken / "best").iterdir()) \
        == sorted(p.name for p in (whole / "best").iterdir())
