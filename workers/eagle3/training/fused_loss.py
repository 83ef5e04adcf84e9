"""The TTT objective at the kernels' speed: the draft head and its loss fused and
chunked, the scored rows chosen on the host, no device synchronisation inside a step.

`ttt_losses` (workers/eagle3/draft/model.py) is the reference: per TTT step it gathers
the valid positions with a boolean mask (a host synchronisation each, to learn how many
rows there are), makes the [rows, draft_vocab] logits in fp32, the target's softmax over
them whole, and, under activation checkpointing, makes the logits again in backward.
This module computes the same losses, hits and counts:

- **The rows** each TTT step scores come from the loss mask, which the batch's reader
  has on the host (`ScoredRows.of`): draft position (b, t) against target position
  (b, t + 1 + i) wherever loss_mask[b, t + 1 + i]. The other half of "valid", the
  target's full-vocabulary argmax falling in the draft vocabulary, is known only on the
  device; it becomes a 0/1 weight per row, multiplied, never gathered.
- **The head and its loss** (`fused_head_loss`): rows in chunks of `CHUNK_ROWS`; per
  chunk the draft logits z = x W^T in the compute dtype, the target's distribution p
  from its stored logits at `temperature` (one-hot at 0), and at once both the loss
  (logsumexp(z) - p.z) and its gradient (softmax(z) - p, scaled by the row's weight),
  turned into the gradients of x and W by two more matrix products. Nothing of size
  [rows, vocab] outlives its chunk, nothing is made twice, and the backward pass only
  scales what the forward kept ([rows, H] and [V, H]) by the loss's gradient. This is
  the idea of SpecForge's and Liger's fused linear cross-entropy.

The losses are the reference's to rounding (tests/test_train.py compares them, and the
gradients, in fp32 on the tiny model); in bf16 the head's products are bf16 with fp32
softmaxes, as the reference's autocast makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.eagle3.draft.model import Eagle3Draft

CHUNK_ROWS = 4096
"""Rows of the head per chunk: at a 32k draft vocabulary, [4096, 32000] fp32 is 0.5 GB
per temporary, and the products are still large enough to fill an H100."""


@dataclass(frozen=True)
class ScoredRows:
    """Per TTT step i, the flat positions (in [B*L]) of the draft rows it scores and of
    their targets: `draft[i][n]` is trained on `target[i][n]` = it + 1 + i."""

    draft: list[torch.Tensor]
    target: list[torch.Tensor]

    @classmethod
    def of(cls, loss_mask: torch.Tensor, steps: int) -> ScoredRows:
        """From a batch's loss mask [B, L] (on the host: the counts are then known
        without asking the device)."""
        mask = loss_mask.cpu().bool()
        batch, length = mask.shape
        draft, target = [], []
        for i in range(steps):
            span = max(length - 1 - i, 0)
            rows, cols = torch.nonzero(mask[:, 1 + i:1 + i + span], as_tuple=True)
            flat = rows * length + cols
            draft.append(flat)
            target.append(flat + 1 + i)
        return cls(draft, target)

    def map(self, how: Callable[[torch.Tensor], torch.Tensor]) -> ScoredRows:
        """`how` applied to each index tensor (a batch's `pin_memory`, `to`)."""
        return ScoredRows([how(t) for t in self.draft], [how(t) for t in self.target])

    def to(self, device: torch.device) -> ScoredRows:
        """On `device` (a batch's reader pins them with the batch: `Batch.pin_memory`)."""
        return self.map(lambda t: t.to(device, non_blocking=True))


class FusedHeadLoss(torch.autograd.Function):
    """(summed weighted cross-entropy, weighted top-1 hits) of the head `weight` [V, H]
    on rows `x` [N, H] against the target logits `target_logits[target_rows]` [N, V]
    at `temperature`, each row weighted by `row_weight` [N] (0 or 1). The gradients of
    `x` and `weight` are made in the forward pass, chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                target_logits: torch.Tensor, target_rows: torch.Tensor,
                row_weight: torch.Tensor, temperature: float,
                compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.to(compute_dtype)
        rows = x.to(compute_dtype)
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_x = torch.empty_like(rows) if needs_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if needs_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        hits = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            part = rows[start:start + CHUNK_ROWS]
            scale = row_weight[start:start + CHUNK_ROWS].float()
            logits = (part @ w.T).float()
            target = target_logits.index_select(0, target_rows[start:start + CHUNK_ROWS])
            target = target.float()
            best = target.argmax(-1)
            log_norm = torch.logsumexp(logits, -1)
            if temperature == 0:
                chosen = logits.gather(-1, best[:, None])[:, 0]
                loss += ((log_norm - chosen) * scale).sum()
            else:
                target = (target / temperature).softmax(-1)
                loss += ((log_norm - (target * logits).sum(-1)) * scale).sum()
            hits += ((logits.argmax(-1) == best).float() * scale).sum()
            if grad_x is None or grad_w is None:
                continue
            # d loss / d logits = softmax(logits) - p, per row times its weight
            grad = logits.sub_(log_norm[:, None]).exp_()
            if temperature == 0:
                grad.scatter_add_(-1, best[:, None], -torch.ones_like(log_norm[:, None]))
            else:
                grad.sub_(target)
            grad = grad.mul_(scale[:, None]).to(compute_dtype)
            grad_x[start:start + CHUNK_ROWS] = grad @ w
            grad_w += (grad.T @ part).float()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.mark_non_differentiable(hits)
        return loss, hits

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor,  # type: ignore[override]
                 _grad_hits: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dx = (grad_x.float() * grad_loss).to(x_dtype) if ctx.needs_input_grad[0] else None
        dw = (grad_w * grad_loss).to(w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None


def fused_head_loss(x: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                    target_rows: torch.Tensor, row_weight: torch.Tensor,
                    temperature: float = 1.0,
                    compute_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`FusedHeadLoss`: (loss summed over the rows, hits), both fp32 scalars on the
    device. `compute_dtype` of the products: bf16 on CUDA, else x's."""
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    loss, hits = FusedHeadLoss.apply(x, weight, target_logits, target_rows, row_weight,
                                     temperature, compute_dtype)
    return loss, hits


def ttt_losses_fused(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor,
                     target_logits: torch.Tensor, valid: torch.Tensor, rows: ScoredRows,
                     steps: int, *, temperature: float = 1.0
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`ttt_losses`' (mean loss, hits, valid count) per TTT step, the rows chosen by
    `rows` (`ScoredRows.of` the batch's loss mask) and weighted by `valid` [B, L] (the
    loss mask and the target's argmax in the draft vocabulary), all on the device."""
    width = model.config.hidden_size
    flat_targets = target_logits.reshape(-1, target_logits.shape[-1])
    flat_valid = valid.reshape(-1).float()
    losses, correct, counts = [], [], []
    for i, hidden in enumerate(model.unroll(aux, input_ids, steps)):
        weight = flat_valid.index_select(0, rows.target[i])
        normed = model.norm(hidden.reshape(-1, width).index_select(0, rows.draft[i]))
        total, hits = fused_head_loss(normed, model.lm_head.weight, flat_targets,
                                      rows.target[i], weight, temperature)
        count = weight.sum()
        losses.append(total / count.clamp(min=1))
        correct.append(hits)
        counts.append(count)
    return losses, correct, counts
