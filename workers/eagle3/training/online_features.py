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
    device. One forward pass per batch, without gradients, in the target's dtype.

    With `cache_bytes`, the features of samples are kept in host memory, as made, up to
    that many bytes, and a batch whose samples are all kept is built from them instead
    of a forward pass: a data set that fits (the demo's, on a CPU, where the forward is
    most of an epoch) costs its forward once, not once per epoch. One that does not fit
    is made anew each epoch, as SpecForge's online mode does."""

    def __init__(self, target: Target, samples: OnlineSamples, cache_bytes: int = 0):
        self.target = target
        self.samples = samples
        self.cache_bytes = cache_bytes
        self.cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Sample index -> its (aux [S, 3H], hidden [S, H]) on the host, as made."""
        self.cached_bytes = 0
        self.batches = 0
        self.forwards = 0
        """Of `batches`, those made by the target's forward (the others: the cache)."""
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
        scored = ScoredRows.of(mask, ttt_steps).to(self.device)
        cached = [self.cached.get(s.index) for s in samples]
        self.batches += 1
        if all(c is not None and c[0].shape[0] >= n for c, n in zip(cached, lengths,
                                                                      strict=True)):
            return self._from_cache(samples, lengths, padded, ids, mask, scored)
        self.forwards += 1
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
        self._keep(samples, lengths, aux, hidden, finite)
        return Batch(aux, hidden, ids.to(self.device, non_blocking=True), loss_mask,
                     [s.index for s in samples], sum(lengths), scored=scored)

    def _keep(self, samples: Sequence[Sample], lengths: Sequence[int], aux: torch.Tensor,
              hidden: torch.Tensor, finite: torch.Tensor) -> None:
        """Each sample's features into the cache while it has room (a sample with a
        non-finite position is not kept: its batch's mask says where)."""
        if not self.cache_bytes:
            return
        whole = finite.all(-1).tolist() if len(samples) else []
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            size = length * (aux.shape[-1] + hidden.shape[-1]) * aux.element_size()
            if sample.index in self.cached or not whole[row] \
                    or self.cached_bytes + size > self.cache_bytes:
                continue
            self.cached[sample.index] = (aux[row, :length].to("cpu", copy=True),
                                         hidden[row, :length].to("cpu", copy=True))
            self.cached_bytes += size

    def _from_cache(self, samples: Sequence[Sample], lengths: Sequence[int], padded: int,
                    ids: torch.Tensor, mask: torch.Tensor, scored: ScoredRows) -> Batch:
        first_aux, first_hidden = self.cached[samples[0].index]
        aux = first_aux.new_zeros((len(samples), padded, first_aux.shape[-1]))
        hidden = first_hidden.new_zeros((len(samples), padded, first_hidden.shape[-1]))
        for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
            kept_aux, kept_hidden = self.cached[sample.index]
            aux[row, :length] = kept_aux[:length]
            hidden[row, :length] = kept_hidden[:length]
        move = {"device": self.device, "non_blocking": True}
        return Batch(aux.to(**move), hidden.to(**move), ids.to(**move), mask.to(**move),
                     [s.index for s in samples], sum(lengths), scored=scored)

    def close(self) -> None:
        self.capture.remove()
