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

import torch
from safetensors import safe_open

from workers.common import read_jsonl
from workers.eagle3.extraction.fp8_features import is_encoded, read_feature

SORT_WINDOW = 1024
"""Samples of the epoch's permutation sorted by length together before packing."""


class TrainError(Exception):
    """A user mistake or unusable input: `error: ...`, exit 2."""


@dataclass(frozen=True)
class Sample:
    index: int
    file: str
    seq_len: int


class ExtractedData:
    def __init__(self, root: Path):
        self.root = root
        manifest, config = root / "manifest.jsonl", root / "extract_config.json"
        for path in (manifest, config):
            if not path.is_file():
                raise TrainError(f"{path} does not exist: is --data a workers.extract output?")
        self.config = json.loads(config.read_text(encoding="utf-8"))
        entries = {}
        for _, record in read_jsonl(manifest, required=("index", "file", "seq_len")):
            entries[int(record["index"])] = Sample(int(record["index"]), str(record["file"]),
                                                   int(record["seq_len"]))
        self.samples = [entries[i] for i in sorted(entries)]
        if not self.samples:
            raise TrainError(f"{manifest}: no samples")
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


@dataclass
class Batch:
    aux: torch.Tensor  # [B, L, 3H]
    hidden: torch.Tensor  # [B, L, H], the target's final (normed) hidden state
    input_ids: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool, False on padding
    indices: list[int]
    tokens: int  # real (unpadded) tokens

    def pin_memory(self) -> Batch:
        """Page-locked copies (what `DataLoader(pin_memory=True)` calls on a batch)."""
        pinned = [t.pin_memory() for t in (self.aux, self.hidden, self.input_ids,
                                           self.loss_mask)]
        return Batch(*pinned, indices=self.indices, tokens=self.tokens)

    def to(self, device: torch.device) -> Batch:
        moved = [t.to(device, non_blocking=True) for t in (self.aux, self.hidden,
                                                           self.input_ids, self.loss_mask)]
        return Batch(*moved, indices=self.indices, tokens=self.tokens)


def load_batch(root: Path, samples: Sequence[Sample], hidden_size: int, max_length: int,
               pin: bool = False, dtype: torch.dtype | None = None) -> Batch:
    """Reads only the rows needed (memory-mapped slices), right-padded to a multiple of 8.
    The hidden states are cast to `dtype` (the trainer's compute dtype) as they are
    copied into the batch, so bf16 extractions train on CPU in fp32; None keeps the
    files' dtype. An fp8 extraction (`--store fp8`) is decoded with its per-token,
    per-layer scales to `dtype` (None: fp32, the exact product)."""
    lengths = [min(s.seq_len, max_length) for s in samples]
    padded = -(-max(lengths) // 8) * 8
    out: dict[str, torch.Tensor] = {}
    widths = {"aux_hidden_states": 3 * hidden_size, "hidden_state": hidden_size}
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
                    if name in widths and is_encoded(f, name):  # --store fp8
                        tensor = read_feature(f, name, length, dtype)
                    else:
                        tensor = part[:length]
                    if name not in out:
                        cast = dtype if dtype is not None and name in widths else tensor.dtype
                        out[name] = torch.zeros((len(samples), padded, *tensor.shape[1:]),
                                                dtype=cast, pin_memory=pin)
                    out[name][row, :tensor.shape[0]] = tensor
        except TrainError:
            raise
        except Exception as exc:  # a torn or foreign file (safetensors' own error type)
            raise TrainError(f"{path}: unreadable sample: {exc}") from exc
    mask = out["loss_mask"].bool()
    return Batch(out["aux_hidden_states"], out["hidden_state"], out["input_ids"].long(), mask,
                 [s.index for s in samples], sum(lengths))


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
