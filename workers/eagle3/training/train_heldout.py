"""The trainer's held-out measure, by which `workers.train` chooses the draft it writes.

Accepted length can peak and then fall while the training loss keeps dropping, so the
draft written is the one that did best on samples it never trained on, not the last.
A few extracted samples are held out (`--heldout-samples`); every `--eval-every` steps
and at the end the draft runs over them with no gradient, the same TTT unroll as
training (eval mode, bf16 autocast on CUDA), giving per TTT step i:

- acc_i: the share of valid positions (those training scores) where the draft's argmax
  is the target's;
- the simulated acceptance tau_sim(k) = 1 + sum_{j=1..k} prod_{i<j} acc_i: the expected
  tokens per verification pass of a chain of k draft tokens (the bonus token counts).
  TTT step i feeds the true tokens and the draft's own hidden states of the earlier
  steps, so acc_i is, to first order, the acceptance of draft position i given the
  earlier ones were accepted.

A pure measure: dataclasses in and out; the run (`workers.train`) does the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.eagle3.draft.model import STEP_WEIGHT, Eagle3Draft, TargetHead, ttt_losses
from workers.eagle3.training.train_data import Batch, Sample

DEFAULT_HELDOUT_SHARE = 0.02
"""--heldout-samples default: this share of the samples, at most DEFAULT_HELDOUT_MAX..."""
DEFAULT_HELDOUT_MAX = 256
"""...(few: the measure runs every --eval-every steps and must stay cheap), and at least
one once there are DEFAULT_HELDOUT_MIN_SAMPLES samples (none below: too few to spare)."""
DEFAULT_HELDOUT_MIN_SAMPLES = 20
MIN_EVALUATIONS = 4
"""--eval-every default: every epoch, and at least this many evaluations per run."""


def heldout_count(spec: str | None, num_samples: int) -> int:
    """How many samples --heldout-samples holds out: an integer is a count, a number
    with a point a share (0 <= share < 1), None the default (2 %, at most 256, at least
    1 from 20 samples on). 0 disables the held-out measure. Raises ValueError."""
    if spec is None:
        if num_samples < DEFAULT_HELDOUT_MIN_SAMPLES:
            return 0
        return max(1, min(DEFAULT_HELDOUT_MAX, round(DEFAULT_HELDOUT_SHARE * num_samples)))
    if "." in spec or "e" in spec.lower():
        share = float(spec)
        if not 0 <= share < 1:
            raise ValueError(f"a share must be in [0, 1), got {spec}")
        return max(1, round(share * num_samples)) if share > 0 else 0
    count = int(spec)
    if count < 0:
        raise ValueError(f"a count must be >= 0, got {spec}")
    return count


def default_eval_every(steps_per_epoch: int, total_steps: int) -> int:
    """Every epoch, or more often so that a run has at least MIN_EVALUATIONS."""
    return max(1, min(steps_per_epoch, math.ceil(total_steps / MIN_EVALUATIONS)))


def simulated_tau(accs: Sequence[float], k: int) -> float:
    """1 + sum_{j=1..k} prod_{i<j} acc_i: expected accepted length with k draft tokens,
    when draft position i is accepted with probability acc_i given the earlier ones."""
    if not 1 <= k <= len(accs):
        raise ValueError(f"k must be in 1..{len(accs)}, got {k}")
    tau, accepted_all = 1.0, 1.0
    for acc in accs[:k]:
        accepted_all *= acc
        tau += accepted_all
    return tau


def reported_ks(ttt_steps: int, select_k: int) -> list[int]:
    """The k whose tau_sim is logged and reported: 3, 5, the TTT length, --select-k."""
    return sorted({min(3, ttt_steps), min(5, ttt_steps), ttt_steps, select_k})


def pack_heldout(samples: Sequence[Sample], batch_tokens: int) -> list[list[Sample]]:
    """The held-out samples by length, packed greedily into batches of at most
    `batch_tokens` padded tokens as the training plan packs them (no shuffle)."""
    batches: list[list[Sample]] = []
    for sample in sorted(samples, key=lambda s: (s.seq_len, s.index)):
        longest = -(-min(sample.seq_len, batch_tokens) // 8) * 8  # padded as loaded
        if batches and (len(batches[-1]) + 1) * longest <= batch_tokens:
            batches[-1].append(sample)
        else:
            batches.append([sample])
    return batches


@dataclass(frozen=True)
class HeldoutMeasure:
    step: int
    epoch: int
    accs: list[float]  # acc_i per TTT step (0.0 where a step has no valid position)
    counts: list[int]  # valid positions per TTT step
    losses: list[float]  # mean soft cross-entropy per TTT step
    tau_sim: dict[int, float]  # k -> tau_sim(k), k = 1..TTT steps

    @property
    def loss(self) -> float:
        """The training objective: sum_i 0.8^i * loss_i."""
        return sum(STEP_WEIGHT ** i * loss for i, loss in enumerate(self.losses))

    def beats(self, best: HeldoutMeasure | None, k: int) -> bool:
        """Better than or as good as `best` at tau_sim(k): a tie goes to the later."""
        return best is None or self.tau_sim[k] >= best.tau_sim[k]

    def record(self) -> dict[str, Any]:
        """One line of out/heldout.jsonl (and trainer_state.json's `best`)."""
        return {"step": self.step, "epoch": self.epoch, "acc": self.accs,
                "counts": self.counts, "loss": self.loss, "loss_i": self.losses,
                "tau_sim": {str(k): v for k, v in self.tau_sim.items()}}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> HeldoutMeasure:
        return cls(int(record["step"]), int(record["epoch"]),
                   [float(x) for x in record["acc"]], [int(x) for x in record["counts"]],
                   [float(x) for x in record["loss_i"]],
                   {int(k): float(v) for k, v in record["tau_sim"].items()})

    def metrics(self, ks: Iterable[int]) -> dict[str, float]:
        """The progress-file metrics: heldout_loss, heldout_acc_i, heldout_tau_k."""
        shown = {"heldout_loss": self.loss}
        shown.update({f"heldout_acc_{i}": acc for i, acc in enumerate(self.accs)})
        shown.update({f"heldout_tau_{k}": self.tau_sim[k] for k in ks})
        return shown


@torch.no_grad()
def measure_heldout(model: Eagle3Draft, head: TargetHead, batches: Iterable[Batch], *,
                    ttt_steps: int, step: int, epoch: int) -> HeldoutMeasure:
    """The draft over the held-out batches (moved to the model's device here): the TTT
    unroll of training in eval mode, no gradient, bf16 autocast on CUDA. Leaves the
    model in the mode it found it in."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct_total = torch.zeros(ttt_steps, dtype=torch.int64, device=device)
    count_total = torch.zeros(ttt_steps, dtype=torch.int64, device=device)
    loss_total = torch.zeros(ttt_steps, dtype=torch.float64, device=device)
    try:
        for batch in batches:
            moved = batch.to(device).decoded()
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=device.type == "cuda"):
                target_logits, valid = head(moved.hidden, moved.loss_mask)
                losses, correct, counts = ttt_losses(model, moved.aux, moved.input_ids,
                                                     target_logits, valid, ttt_steps)
            correct_total += torch.stack(correct)
            count_total += torch.stack(counts)
            # ttt_losses gives the mean over the batch's valid positions: back to a sum
            loss_total += torch.stack([x.double() for x in losses]) * torch.stack(counts)
    finally:
        model.train(was_training)
    corrects, counts_list = correct_total.tolist(), count_total.tolist()
    accs = [c / n if n else 0.0 for c, n in zip(corrects, counts_list, strict=True)]
    losses_list = [s / n if n else 0.0
                   for s, n in zip(loss_total.tolist(), counts_list, strict=True)]
    return HeldoutMeasure(step, epoch, accs, counts_list, losses_list,
                          {k: simulated_tau(accs, k) for k in range(1, ttt_steps + 1)})
