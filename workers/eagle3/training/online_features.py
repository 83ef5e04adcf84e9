"""Online training's input side: the target's forward pass inside the trainer makes each
batch's features (the inputs of the captured layers and the final normed hidden state,
what `workers.extract` would have written), which are used once and never reach the
disk (`workers.train --online`).

SpecForge and speculators train the same way ("online": hidden states made on the fly
during training); offline extraction stays for those who extract once and train many
times. The features are the extraction's own: the same hooks on the same layers
(`extraction.extractor.Capture`, `capture_layers`), right padding to a multiple of 8 as
`train_data.load_batch` pads, so an online batch holds the values an offline one reads
from an extraction in the compute dtype (tests/test_train.py compares the two).

Samples come tokenized (`workers.extract.load_samples`: the chat template, the
assistant-token loss mask, too-long and malformed conversations skipped and counted);
their lengths plan the epochs exactly as an extraction's manifest does, so a resumed
run lands on the same batch boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workers.eagle3.extraction.extractor import Capture, capture_layers
from workers.eagle3.extraction.extractor import Sample as Tokenized
from workers.eagle3.target.model import Target
from workers.eagle3.target.split import to_device
from workers.eagle3.training.fused_loss import ScoredRows
from workers.eagle3.training.train_data import Batch, Sample, TrainError, TrainingSamples


class OnlineSamples(TrainingSamples):
    """Tokenized conversations as training samples: index, id and length per sample,
    the tokens kept in memory for the target's forward."""

    def __init__(self, tokenized: Sequence[Tokenized], config: dict[str, Any],
                 skipped: dict[str, int] | None = None):
        super().__init__([Sample(t.index, t.id, len(t.input_ids)) for t in tokenized],
                         config)
        if not self.samples:
            raise TrainError("--conversations: no usable conversation")
        self.tokens = {t.index: t for t in tokenized}
        self.skipped = skipped or {}
        """Conversations not trained on, by why (too long, foreign tokens, ...)."""


class OnlineFeatures:
    """The target, hooked at its captured layers, turning samples into batches on its
    device. One forward pass per batch, without gradients, in the target's dtype."""

    def __init__(self, target: Target, samples: OnlineSamples):
        self.target = target
        self.samples = samples
        self.layer_ids = capture_layers(target.num_layers)
        self.base = target.decoder
        self.input_device = self.base.get_input_embeddings().weight.device
        self.device = self.base.norm.weight.device
        self.capture = Capture(self.base, self.layer_ids)

    @staticmethod
    def config_of(target: Target) -> dict[str, Any]:
        """What an extraction's extract_config.json would say of the features."""
        return {"aux_layer_ids": capture_layers(target.num_layers),
                "num_layers": target.num_layers, "hidden_size": target.hidden_size,
                "vocab_size": target.vocab_size, "features": "online"}

    @torch.no_grad()
    def batch(self, samples: Sequence[Sample], max_length: int, ttt_steps: int) -> Batch:
        """The batch `load_batch` would read for these samples from their extraction:
        aux [B, L, 3H], hidden [B, L, H], input_ids [B, L], loss_mask [B, L], each
        sample cut to `max_length` and right-padded to a multiple of 8, on the target's
        device, with the rows each of `ttt_steps` TTT steps scores chosen on the host
        (`ScoredRows`). Padding is zero. A position where the target gave a non-finite
        value is zeroed too and not trained on (its loss mask cleared on the device),
        where an extraction skips the whole sample."""
        tokens = [self.samples.tokens[s.index] for s in samples]
        lengths = [min(len(t.input_ids), max_length) for t in tokens]
        padded = -(-max(lengths) // 8) * 8
        ids = torch.zeros((len(tokens), padded), dtype=torch.long)
        attention = torch.zeros((len(tokens), padded), dtype=torch.long)
        mask = torch.zeros((len(tokens), padded), dtype=torch.bool)
        for row, (t, length) in enumerate(zip(tokens, lengths, strict=True)):
            ids[row, :length] = torch.tensor(t.input_ids[:length])
            attention[row, :length] = 1
            mask[row, :length] = torch.tensor(t.loss_mask[:length], dtype=torch.bool)
        self.capture.states.clear()
        self.base(input_ids=ids.to(self.input_device, non_blocking=True),
                  attention_mask=attention.to(self.input_device, non_blocking=True),
                  use_cache=False)
        aux = torch.cat([to_device(self.capture.states[i], self.device)
                         for i in self.layer_ids], dim=-1)
        hidden = self.capture.states["final"]
        self.capture.states.clear()
        finite = torch.isfinite(aux).all(-1) & torch.isfinite(hidden).all(-1)
        kept = (finite & attention.to(self.device, non_blocking=True).bool())[..., None]
        aux = torch.where(kept, aux, 0)  # the padding zero, as a batch read from disk has it
        hidden = torch.where(kept, hidden, 0)
        loss_mask = mask.to(self.device, non_blocking=True) & finite
        return Batch(aux, hidden, ids.to(self.device, non_blocking=True), loss_mask,
                     [s.index for s in samples], sum(lengths),
                     scored=ScoredRows.of(mask, ttt_steps).to(self.device))

    def close(self) -> None:
        self.capture.remove()
