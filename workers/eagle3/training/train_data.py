"""The trainer's input side: the samples of a `workers.extract` output (manifest.jsonl,
extract_config.json, one safetensors file per sample), each epoch's batch plan, and the
batches themselves, read as memory-mapped slices and read ahead (`read_ahead`).
Kept apart from `workers.train` so the training loop reads as optimizer steps alone;
the plan is a pure function of (samples, epoch, seed, batch_tokens), which is what lets
a resumed run land on the same batch boundaries.

Reading ahead in processes, not a thread, on a GPU (`read_ahead`): the training step of
a small draft is bound by the launch of its ~1,500 kernels in Python, and a reader
thread in the same interpreter takes the GIL between them. Measured on an H200
(`bench/train_gpu.py --config smollm2 --disk DIR`, SmolLM2-135M's shapes, 32,768-token
batches): the step alone on a resident batch 117k tokens/s, the reader alone 330-660k,
the two together on one thread of read-ahead 31.5k."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.common import read_jsonl
from workers.eagle3.extraction.fp8_features import decode, is_encoded, read_feature, scale_name
from workers.eagle3.training.fused_loss import ScoredRows

SORT_WINDOW = 1024
"""Samples of the epoch's permutation sorted by length together before packing."""


class TrainError(Exception):
    """A user mistake or unusable input: `error: ...`, exit 2."""


@dataclass(frozen=True)
class Sample:
    index: int
    file: str
    seq_len: int


class TrainingSamples:
    """The samples a run trains on, each an index and a length: those held out of
    training (`hold_out`) and each epoch's batch plan (`plan_epoch`). `config` says what
    the features are (an extraction's extract_config.json: `aux_layer_ids`,
    `num_layers`, `hidden_size`, `vocab_size`). An extraction's (`ExtractedData`) or
    tokenized conversations whose features the target makes as they train
    (`online_features.OnlineSamples`)."""

    def __init__(self, samples: list[Sample], config: dict[str, Any]):
        self.samples = sorted(samples, key=lambda s: s.index)
        self.config = config
        self.heldout: list[Sample] = []

    def hold_out(self, count: int, seed: int) -> None:
        """Moves `count` samples, drawn by a seeded permutation of the sample indices (the
        same ones on every rerun), from `samples` (what the epochs are planned over) to
        `heldout`, both in index order."""
        everything = sorted([*self.samples, *self.heldout], key=lambda s: s.index)
        if not 0 <= count < len(everything):
            raise TrainError(f"cannot hold out {count} of {len(everything)} samples: "
                             "at least one must be left to train on")
        generator = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
        chosen = set(torch.randperm(len(everything), generator=generator)[:count].tolist())
        self.heldout = [s for k, s in enumerate(everything) if k in chosen]
        self.samples = [s for k, s in enumerate(everything) if k not in chosen]

    def plan_epoch(self, epoch: int, seed: int, batch_tokens: int) -> list[list[Sample]]:
        """The epoch's batches, a pure function of (samples, epoch, seed, batch_tokens):
        a resumed run recomputes the same plan."""
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.samples), generator=generator).tolist()
        plan: list[list[Sample]] = []
        for start in range(0, len(order), SORT_WINDOW):
            window = sorted((self.samples[i] for i in order[start:start + SORT_WINDOW]),
                            key=lambda s: s.seq_len)
            batches: list[list[Sample]] = []
            for sample in window:
                longest = -(-min(sample.seq_len, batch_tokens) // 8) * 8  # padded as loaded
                if batches and (len(batches[-1]) + 1) * longest <= batch_tokens:
                    batches[-1].append(sample)
                else:
                    batches.append([sample])
            shuffle = torch.randperm(len(batches), generator=generator).tolist()
            plan.extend(batches[i] for i in shuffle)
        return plan


class ExtractedData(TrainingSamples):
    """The samples of a `workers.extract` output: its manifest and extract_config.json."""

    def __init__(self, root: Path):
        self.root = root
        manifest, config = root / "manifest.jsonl", root / "extract_config.json"
        for path in (manifest, config):
            if not path.is_file():
                raise TrainError(f"{path} does not exist: is --data a workers.extract output?")
        entries = {}
        for _, record in read_jsonl(manifest, required=("index", "file", "seq_len")):
            entries[int(record["index"])] = Sample(int(record["index"]), str(record["file"]),
                                                   int(record["seq_len"]))
        super().__init__(list(entries.values()),
                         json.loads(config.read_text(encoding="utf-8")))
        if not self.samples:
            raise TrainError(f"{manifest}: no samples")


@dataclass
class Batch:
    aux: torch.Tensor  # [B, L, 3H]
    hidden: torch.Tensor  # [B, L, H], the target's final (normed) hidden state
    input_ids: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool, False on padding
    indices: list[int]
    tokens: int  # real (unpadded) tokens
    aux_scale: torch.Tensor | None = None
    """[B, L, 3] fp32 where `aux` is still fp8 as stored (`load_batch(fp8=True)`): the
    batch is then decoded where it trains (`decoded`), not by its reader."""
    hidden_scale: torch.Tensor | None = None  # [B, L, 1], as `aux_scale`
    decode_to: torch.dtype | None = None
    """What `decoded` decodes fp8 features to (`load_batch`'s `dtype`; None: fp32)."""
    scored: ScoredRows | None = None
    """The rows each TTT step scores (`ScoredRows.of` the loss mask), made by the reader
    on the host so that the step never asks the device how many there are."""

    def _map(self, how: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        aux_scale, hidden_scale = (None if t is None else how(t)
                                   for t in (self.aux_scale, self.hidden_scale))
        scored = None if self.scored is None else self.scored.map(how)
        return Batch(how(self.aux), how(self.hidden), how(self.input_ids),
                     how(self.loss_mask), self.indices, self.tokens, aux_scale, hidden_scale,
                     self.decode_to, scored)

    def pin_memory(self) -> Batch:
        """Page-locked copies (what `DataLoader(pin_memory=True)` calls on a batch)."""
        return self._map(lambda t: t.pin_memory())

    def to(self, device: torch.device) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def decoded(self) -> Batch:
        """The batch with its fp8 features decoded (to `decode_to`) on the device they are
        on; itself when none is fp8. The same values as a reader's decode (`read_feature`)."""
        if self.aux_scale is None and self.hidden_scale is None:
            return self
        aux, hidden = (t if scale is None else decode(t, scale, self.decode_to)
                       for t, scale in ((self.aux, self.aux_scale),
                                        (self.hidden, self.hidden_scale)))
        return Batch(aux, hidden, self.input_ids, self.loss_mask, self.indices, self.tokens,
                     scored=self.scored)


def load_batch(root: Path, samples: Sequence[Sample], hidden_size: int, max_length: int,
               pin: bool = False, dtype: torch.dtype | None = None,
               fp8: bool = False) -> Batch:
    """Reads only the rows needed (memory-mapped slices), right-padded to a multiple of 8.
    The hidden states are cast to `dtype` (the trainer's compute dtype) as they are
    copied into the batch, so bf16 extractions train on CPU in fp32; None keeps the
    files' dtype. An fp8 extraction (`--store fp8`) is decoded with its per-token,
    per-layer scales to `dtype` (None: fp32, the exact product); with `fp8`, kept as
    stored with its scales for the trainer to decode on its device (`Batch.decoded`):
    half the bytes to copy and no decode in the reader (a batch whose files are not all
    fp8 is decoded here)."""
    lengths = [min(s.seq_len, max_length) for s in samples]
    padded = -(-max(lengths) // 8) * 8
    out: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}  # of the features kept in fp8
    widths = {"aux_hidden_states": 3 * hidden_size, "hidden_state": hidden_size}

    def buffer(shape: tuple[int, ...], kind: torch.dtype) -> torch.Tensor:
        return torch.zeros((len(samples), padded, *shape), dtype=kind, pin_memory=pin)

    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        path = root / sample.file
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in ("aux_hidden_states", "hidden_state", "input_ids", "loss_mask"):
                    part = f.get_slice(name)
                    shape = part.get_shape()
                    if name in widths and (len(shape) != 2 or shape[1] != widths[name]):
                        raise TrainError(f"{path}: {name} is {shape}, expected "
                                         f"[S, {widths[name]}]: extracted from another model?")
                    encoded = name in widths and is_encoded(f, name)  # --store fp8
                    if encoded and fp8 and (row == 0 or name in scales):
                        scale = f.get_slice(scale_name(name))[:length]
                        if row == 0:
                            scales[name] = buffer(scale.shape[1:], torch.float32)
                        scales[name][row, :length] = scale
                        tensor = part[:length]
                    else:
                        if name in scales:  # this batch mixes stores: decode it here
                            out[name] = decode(out[name], scales.pop(name), dtype)
                        tensor = (read_feature(f, name, length, dtype) if encoded
                                  else part[:length])
                    if name not in out:
                        cast = (dtype if dtype is not None and name in widths
                                and name not in scales else tensor.dtype)
                        out[name] = buffer(tensor.shape[1:], cast)
                    out[name][row, :tensor.shape[0]] = tensor
        except TrainError:
            raise
        except Exception as exc:  # a torn or foreign file (safetensors' own error type)
            raise TrainError(f"{path}: unreadable sample: {exc}") from exc
    mask = out["loss_mask"].bool()
    return Batch(out["aux_hidden_states"], out["hidden_state"], out["input_ids"].long(), mask,
                 [s.index for s in samples], sum(lengths), scales.get("aux_hidden_states"),
                 scales.get("hidden_state"), dtype)


def read_ahead(load: Callable[[list[Sample]], Batch], batches: Sequence[list[Sample]], *,
               processes: int = 0, pin: bool = False) -> Iterator[Batch]:
    """The batches in order, each read while the ones before it train: on one thread
    (`prefetched`) when `processes` is 0, else in that many forked worker processes
    (`load` there should not pin: `pin` pins each batch here, on the loader's thread),
    two batches ahead each. The workers ignore SIGTERM and SIGINT: a stop sent to the
    job's process group is the trainer's to handle (it saves a checkpoint); they end
    with the iterator, or with this process. Forked, not spawned: they touch no CUDA
    state, and `load` and the plan need not pickle."""
    if processes <= 0:
        yield from prefetched(load, batches)
        return
    from torch.utils.data import DataLoader, Dataset

    class Planned(Dataset[Batch]):
        def __len__(self) -> int:
            return len(batches)

        def __getitem__(self, k: int) -> Batch:
            return load(batches[k])

    loader = DataLoader(Planned(), batch_size=None, shuffle=False, num_workers=processes,
                        pin_memory=pin, prefetch_factor=2, worker_init_fn=_reader_signals,
                        multiprocessing_context="fork")
    yield from loader


def _reader_signals(_worker: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def prefetched(load: Callable[[list[Sample]], Batch],
               batches: Sequence[list[Sample]]) -> Iterator[Batch]:
    """Loads batch k+1 on a thread while batch k trains."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as pool:
        pending = pool.submit(load, batches[0]) if batches else None
        for k in range(len(batches)):
            assert pending is not None
            current = pending
            pending = pool.submit(load, batches[k + 1]) if k + 1 < len(batches) else None
            yield current.result()
