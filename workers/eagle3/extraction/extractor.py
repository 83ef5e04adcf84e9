"""The extraction loop: tokenized samples in, one safetensors file per sample out.
Packs samples into batches by length, captures the chosen layers' inputs with forward
hooks, and overlaps forward passes, device-to-host copies and file writes (pinned
buffers, a side stream, writer threads). Given a loaded model, so the command line
(workers/extract.py) and the GPU benchmarks drive the same loop; no argument parsing
and no model loading here."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.common import ProgressReporter
from workers.eagle3.extraction.fp8_features import DEFAULT_STORE, STORES, encode, scale_name
from workers.eagle3.extraction.hidden_files import (
    DEFAULT_WRITEBACK,
    PRENORM_KEY,
    Writeback,
    append_manifest,
    safetensors_parts,
    sample_path,
    write_atomically,
)
from workers.eagle3.target.model import Target
from workers.eagle3.target.split import to_device

log = logging.getLogger("workers.extract")  # one log for the whole extract worker


def capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's auxiliary layers: [2, N//2, N-3] (for N = 61: [2, 30, 58])."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass(frozen=True)
class Sample:
    index: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class Stats:
    total: int = 0
    done_before: int = 0
    written: int = 0
    bytes_written: int = 0
    tokens: int = 0
    nonfinite: list[str] = field(default_factory=list)
    too_long_skipped: list[str] = field(default_factory=list)
    truncated: int = 0
    empty: list[str] = field(default_factory=list)
    malformed_lines: list[int] = field(default_factory=list)


def pack_batches(samples: Sequence[Sample], batch_tokens: int) -> list[list[Sample]]:
    """Batches of similar length whose padded size (count x longest) fits in
    `batch_tokens`; a sample longer than that is a batch of its own."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids))
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in ordered:
        longest = len(sample.input_ids)  # ascending order: the newest is the longest
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches


def pad_batch(batch: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, longest] int64 on the CPU, padded on the right
    with zeros (a causal model's real positions do not see the pads)."""
    longest = max(len(s.input_ids) for s in batch)
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    attention = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, sample in enumerate(batch):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
        attention[row, : len(sample.input_ids)] = 1
    return ids, attention


class Capture:
    """Forward hooks that keep the inputs of the chosen layers and the final norm's
    output (and with `prenorm`, its input: the last layer's output before the final
    norm), instead of all N+1 hidden states `output_hidden_states` would keep."""

    def __init__(self, base: Any, layer_ids: Sequence[int], prenorm: bool = False):
        self.states: dict[Any, torch.Tensor] = {}
        self.handles = []
        for i in layer_ids:
            self.handles.append(base.layers[i].register_forward_pre_hook(
                self._pre(i), with_kwargs=True))
        self.handles.append(base.norm.register_forward_hook(self._final))
        if prenorm:
            self.handles.append(base.norm.register_forward_pre_hook(
                self._pre("prenorm"), with_kwargs=True))

    def _pre(self, i: int | str) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.states[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _final(self, _module: Any, _args: Any, output: torch.Tensor) -> None:
        self.states["final"] = output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Extractor:
    """The extraction loop over tokenized samples, given a loaded target (its text
    decoder: a multimodal model's language model is hooked the same way)."""

    def __init__(self, target: Target, out: Path, *, batch_tokens: int = 16384,
                 writers: int = 4, queue_depth: int = 3, overlap: bool = True,
                 writeback: str = DEFAULT_WRITEBACK, progress: ProgressReporter | None = None,
                 stats: Stats | None = None, keep_prenorm: bool = False,
                 manifest: Path | None = None, store: str = DEFAULT_STORE):
        # also store the last layer's output before the final norm (PRENORM_KEY): what
        # vLLM's speculators train on; +1/4 disk. Carried next to the normed final state
        # as one [.., 2H] tensor through the copy and write path.
        self.keep_prenorm = keep_prenorm
        # one of STORES: "fp8" encodes on the device, before the copy (fp8_features.py)
        if store not in STORES:
            raise ValueError(f"store {store!r} is not one of {STORES}")
        self.fp8 = store == "fp8"
        self.base = target.decoder
        self.num_layers = target.num_layers
        self.layer_ids = capture_layers(self.num_layers)
        self.hidden = target.hidden_size
        # a split model takes its input on the embedding's device and ends on the norm's
        self.input_device = self.base.get_input_embeddings().weight.device
        self.device = self.base.norm.weight.device
        self.dtype = target.dtype
        self.out = out
        # one writer per manifest file: a rank appends to its own (hidden_files)
        self.manifest = manifest if manifest is not None else out / "manifest.jsonl"
        self.batch_tokens = batch_tokens
        self.overlap = overlap and self.device.type == "cuda"
        # one of WRITEBACK_MODES; "range" keeps up to one file per writer thread in flight
        self.writeback = Writeback(writeback, in_flight_files=writers)
        self.progress = progress or ProgressReporter(None, "sample")
        self.stats = stats or Stats()
        self.writers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="writer")
        self.manifest_lock = threading.Lock()
        self.started = time.monotonic()
        self._error: BaseException | None = None
        # pinned host buffers (bytes), recycled: the bound on batches in flight
        self._buffers: queue.Queue[torch.Tensor] = queue.Queue()
        if self.overlap:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            layers = 5 if keep_prenorm else 4
            if self.fp8:  # 1 byte per value, plus a 4-byte scale per token and layer
                token_bytes = layers * self.hidden + 4 * layers
            else:
                token_bytes = layers * self.hidden * self.dtype.itemsize
            for _ in range(queue_depth):
                self._buffers.put(torch.empty(batch_tokens * token_bytes + 64,
                                              dtype=torch.uint8, pin_memory=True))

    # -- the loop -------------------------------------------------------------------
    def run(self, samples: Sequence[Sample]) -> Stats:
        capture = Capture(self.base, self.layer_ids, prenorm=self.keep_prenorm)
        pending: list[Future[None]] = []
        try:
            for batch in pack_batches(samples, self.batch_tokens):
                self._raise_writer_error()
                with torch.inference_mode():
                    aux, final, finite = self._forward(batch, capture)
                    features = self._stored(aux, final)
                    del aux, final  # with --store fp8, only the encoded batch stays
                if self.overlap:
                    pending.extend(self._copy_async_then_write(batch, features, finite))
                else:
                    host = {name: t.to("cpu") for name, t in features.items()}
                    self._write_batch(batch, host, finite.to("cpu"))
                pending = [f for f in pending if not f.done()]
            for future in pending:
                future.result()
            self._raise_writer_error()
        finally:
            capture.remove()
            self.writers.shutdown(wait=True)
            self.writeback.close()
        return self.stats

    def _forward(self, batch: Sequence[Sample],
                 capture: Capture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One padded forward pass (right padding: a causal model's real positions do
        not see the pads). Returns aux [B, L, 3H], final [B, L, H] (with keep_prenorm
        [B, L, 2H]: the normed state, then the one before the norm) and a per-sample
        all-finite flag [B], still on the device."""
        ids, attention = pad_batch(batch)
        ids = ids.to(self.input_device, non_blocking=True)
        attention = attention.to(self.input_device, non_blocking=True)
        capture.states.clear()
        self.base(input_ids=ids, attention_mask=attention, use_cache=False)
        # with a split model the captured layers live on several devices: gather them
        # on the last one (a no-op otherwise)
        aux = torch.cat([to_device(capture.states[i], self.device) for i in self.layer_ids],
                        dim=-1)
        final = capture.states["final"]
        if self.keep_prenorm:
            final = torch.cat([final, capture.states["prenorm"]], dim=-1)
        valid = to_device(attention, self.device).bool().unsqueeze(-1)
        finite = (torch.isfinite(aux) | ~valid).flatten(1).all(1) & \
                 (torch.isfinite(final) | ~valid).flatten(1).all(1)
        return aux, final, finite

    def _stored(self, aux: torch.Tensor, final: torch.Tensor) -> dict[str, torch.Tensor]:
        """What goes to the host, still on the device: "aux" [B, L, 3H] and "final"
        [B, L, H or 2H] as computed, or with --store fp8 encoded (one batched op each,
        no host sync) plus their scales "aux_scale" [B, L, 3], "final_scale" [B, L, 1 or 2]."""
        if not self.fp8:
            return {"aux": aux, "final": final}
        aux_q, aux_scale = encode(aux, 3)
        final_q, final_scale = encode(final, final.shape[-1] // self.hidden)
        return {"aux": aux_q, "final": final_q, "aux_scale": aux_scale,
                "final_scale": final_scale}

    def _copy_async_then_write(self, batch: Sequence[Sample], features: dict[str, torch.Tensor],
                               finite: torch.Tensor) -> list[Future[None]]:
        """Copy into a pinned buffer on the side stream, then let a writer thread wait
        for that copy alone: the next forward pass starts at once."""
        buffer = self._buffers.get()  # blocks when `queue_depth` batches are in flight
        # widest elements first: every view into the byte buffer starts aligned
        ordered = sorted(features.items(), key=lambda item: -item[1].element_size())
        total = sum(t.numel() * t.element_size() for _, t in ordered)
        if buffer.numel() < total:  # a sample longer than batch_tokens, alone
            buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        host: dict[str, torch.Tensor] = {}
        offset = 0
        for name, t in ordered:
            size = t.numel() * t.element_size()
            host[name] = buffer[offset:offset + size].view(t.dtype).view(t.shape)
            offset += size
        host_finite = torch.empty(len(batch), dtype=torch.bool, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for name, t in ordered:
                host[name].copy_(t, non_blocking=True)
            host_finite.copy_(finite, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        # the device tensors must live until the copy has read them
        for t in (*features.values(), finite):
            t.record_stream(self.copy_stream)

        remaining = [len(batch)]
        lock = threading.Lock()

        def write(row: int) -> None:
            try:
                done.synchronize()
                self._write_sample(batch[row], host, host_finite, row)
            finally:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:  # the whole batch is on disk: recycle its buffer
                        self._buffers.put(buffer)

        return [self.writers.submit(self._guard, write, row) for row in range(len(batch))]

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # surfaced in the main loop
            self._error = self._error or exc
            raise

    def _raise_writer_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_batch(self, batch: Sequence[Sample], host: dict[str, torch.Tensor],
                     finite: torch.Tensor) -> None:
        futures = [self.writers.submit(self._write_sample, s, host, finite, row)
                   for row, s in enumerate(batch)]
        for future in futures:  # no overlap: wait for the writes before the next batch
            future.result()

    def _write_sample(self, sample: Sample, host: dict[str, torch.Tensor],
                      finite: torch.Tensor, row: int) -> None:
        length = len(sample.input_ids)
        if not bool(finite[row]):
            log.warning("sample %s (%d): NaN/Inf in its hidden states; skipped", sample.id,
                        sample.index)
            with self.manifest_lock:
                self.stats.nonfinite.append(sample.id)
            return
        aux, final, hidden = host["aux"], host["final"], self.hidden
        tensors = {"aux_hidden_states": aux[row, :length].contiguous(),
                   "hidden_state": final[row, :length, :hidden].contiguous()}
        if self.keep_prenorm:
            tensors[PRENORM_KEY] = final[row, :length, hidden:].contiguous()
        if self.fp8:  # each fp8 tensor's scales [S, layers] beside it
            tensors[scale_name("aux_hidden_states")] = host["aux_scale"][row, :length].contiguous()
            tensors[scale_name("hidden_state")] = host["final_scale"][row, :length, :1].contiguous()
            if self.keep_prenorm:
                tensors[scale_name(PRENORM_KEY)] = \
                    host["final_scale"][row, :length, 1:].contiguous()
        tensors["input_ids"] = torch.tensor(sample.input_ids, dtype=torch.int64)
        tensors["loss_mask"] = torch.tensor(sample.loss_mask, dtype=torch.uint8)
        parts = safetensors_parts(tensors, {"id": sample.id, "index": str(sample.index)})
        size = sum(p.nbytes for p in parts)
        path = sample_path(self.out, sample.index)
        write_atomically(path, parts, writeback=self.writeback)
        with self.manifest_lock:
            append_manifest(self.manifest, {
                "index": sample.index, "id": sample.id,
                "file": str(path.relative_to(self.out)), "seq_len": length,
                "bytes": size, "loss_tokens": int(sum(sample.loss_mask))})
            self.stats.written += 1
            self.stats.bytes_written += size
            self.stats.tokens += length
            self._report()

    def _report(self, force: bool = False) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.progress.update(self.stats.done_before + self.stats.written, {
            "tokens_per_s": self.stats.tokens / elapsed,
            "gb_per_s": self.stats.bytes_written / elapsed / 1e9,
            "nonfinite_skipped": len(self.stats.nonfinite),
        }, force=force)
