"""Hidden-state extraction for EAGLE-3: `python -m workers.extract --help`.

Prefill only (no sampling, no lm_head): for each conversation, the inputs of decoder
layers [2, N//2, N-3] (what HF's `output_hidden_states[i]` holds) concatenated low|mid|
high into `aux_hidden_states` [S, 3H], the final hidden state after the final norm
`hidden_state` [S, H], `input_ids` [S] int64 and `loss_mask` [S] uint8 (1 on assistant
tokens), one safetensors file per sample under `rows_<a>-<b>/`, written to a temp name
and renamed (a partial file never counts), listed in `manifest.jsonl`.

Speed: on a GPU the three costs — forward passes, device-to-host copies, file writes —
overlap. Batches are packed by length (`--batch-tokens`), captured states are copied
into a pool of pinned host buffers with non-blocking copies on a side stream, and a
bounded pool of writer threads turns them into files while the next batch computes.
`--no-overlap` runs the same work one step after the other (for comparison).

Several GPUs: `--gpus N` runs one process per GPU, each taking every N-th sample into
the same tree and manifest (workers/ranks.py); `--gpus-per-model K` splits the model's
layers over K GPUs for a target larger than one (workers/split.py), N/K copies with
`--gpus N`.

Resume: samples whose file exists are skipped (their manifest line is restored if the
crash came between the rename and the append). Samples with NaN/Inf hidden states are
skipped and counted, never written. A full disk stops the run cleanly (exit 4), with
no partial file left behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.common import (
    JsonlStats,
    ProgressReporter,
    fail,
    read_jsonl,
    require_file,
    setup_logging,
    tokenize_conversation,
)
from workers.hidden_files import (
    DiskFull,
    append_manifest,
    existing_indexes,
    merge_summaries,
    restore_manifest,
    safetensors_parts,
    sample_path,
    write_atomically,
)
from workers.ranks import rank_argv, run_ranks
from workers.split import load_split, parse_devices, to_device

log = logging.getLogger("workers.extract")

EXIT_DISK_FULL = 4
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


class Capture:
    """Forward hooks that keep the inputs of the chosen layers and the final norm's
    output, instead of all N+1 hidden states `output_hidden_states` would keep."""

    def __init__(self, base: Any, layer_ids: Sequence[int]):
        self.states: dict[Any, torch.Tensor] = {}
        self.handles = []
        for i in layer_ids:
            self.handles.append(base.layers[i].register_forward_pre_hook(
                self._pre(i), with_kwargs=True))
        self.handles.append(base.norm.register_forward_hook(self._final))

    def _pre(self, i: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.states[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _final(self, _module: Any, _args: Any, output: torch.Tensor) -> None:
        self.states["final"] = output

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Extractor:
    """The extraction loop over tokenized samples, given a loaded model."""

    def __init__(self, model: Any, out: Path, *, batch_tokens: int = 16384, writers: int = 4,
                 queue_depth: int = 3, overlap: bool = True, fsync: bool = False,
                 progress: ProgressReporter | None = None, stats: Stats | None = None):
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        if not hasattr(self.base, "layers") or not hasattr(self.base, "norm"):
            raise ValueError("the model has no `layers`/`norm` decoder (Llama-style needed)")
        self.num_layers = len(self.base.layers)
        self.layer_ids = capture_layers(self.num_layers)
        self.hidden = model.config.hidden_size
        # a split model takes its input on the embedding's device and ends on the norm's
        self.input_device = self.base.get_input_embeddings().weight.device
        self.device = self.base.norm.weight.device
        self.dtype = next(model.parameters()).dtype
        self.out = out
        self.batch_tokens = batch_tokens
        self.overlap = overlap and self.device.type == "cuda"
        self.fsync = fsync
        self.progress = progress or ProgressReporter(None, "sample")
        self.stats = stats or Stats()
        self.writers = ThreadPoolExecutor(max_workers=writers, thread_name_prefix="writer")
        self.manifest_lock = threading.Lock()
        self.started = time.monotonic()
        self._error: BaseException | None = None
        # pinned host buffers, recycled: the bound on batches in flight
        self._buffers: queue.Queue[torch.Tensor] = queue.Queue()
        if self.overlap:
            self.copy_stream = torch.cuda.Stream(device=self.device)
            for _ in range(queue_depth):
                self._buffers.put(torch.empty(batch_tokens * 4 * self.hidden + batch_tokens,
                                              dtype=self.dtype, pin_memory=True))

    # -- the loop -------------------------------------------------------------------
    def run(self, samples: Sequence[Sample]) -> Stats:
        capture = Capture(self.base, self.layer_ids)
        pending: list[Future[None]] = []
        try:
            for batch in pack_batches(samples, self.batch_tokens):
                self._raise_writer_error()
                with torch.inference_mode():
                    aux, final, finite = self._forward(batch, capture)
                if self.overlap:
                    pending.extend(self._copy_async_then_write(batch, aux, final, finite))
                else:
                    host = [t.to("cpu") for t in (aux, final, finite)]
                    self._write_batch(batch, *host)
                pending = [f for f in pending if not f.done()]
            for future in pending:
                future.result()
            self._raise_writer_error()
        finally:
            capture.remove()
            self.writers.shutdown(wait=True)
        return self.stats

    def _forward(self, batch: Sequence[Sample],
                 capture: Capture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One padded forward pass (right padding: a causal model's real positions do
        not see the pads). Returns aux [B, L, 3H], final [B, L, H] and a per-sample
        all-finite flag [B], still on the device."""
        longest = max(len(s.input_ids) for s in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        attention = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, sample in enumerate(batch):
            ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
            attention[row, : len(sample.input_ids)] = 1
        ids = ids.to(self.input_device, non_blocking=True)
        attention = attention.to(self.input_device, non_blocking=True)
        capture.states.clear()
        self.base(input_ids=ids, attention_mask=attention, use_cache=False)
        # with a split model the captured layers live on several devices: gather them
        # on the last one (a no-op otherwise)
        aux = torch.cat([to_device(capture.states[i], self.device) for i in self.layer_ids],
                        dim=-1)
        final = capture.states["final"]
        valid = to_device(attention, self.device).bool().unsqueeze(-1)
        finite = (torch.isfinite(aux) | ~valid).flatten(1).all(1) & \
                 (torch.isfinite(final) | ~valid).flatten(1).all(1)
        return aux, final, finite

    def _copy_async_then_write(self, batch: Sequence[Sample], aux: torch.Tensor,
                               final: torch.Tensor, finite: torch.Tensor) -> list[Future[None]]:
        """Copy into a pinned buffer on the side stream, then let a writer thread wait
        for that copy alone: the next forward pass starts at once."""
        buffer = self._buffers.get()  # blocks when `queue_depth` batches are in flight
        b, length, _ = aux.shape
        n_aux, n_final = aux.numel(), final.numel()
        host_aux = buffer[:n_aux].view(b, length, 3 * self.hidden)
        host_final = buffer[n_aux:n_aux + n_final].view(b, length, self.hidden)
        host_finite = torch.empty(b, dtype=torch.bool, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host_aux.copy_(aux, non_blocking=True)
            host_final.copy_(final, non_blocking=True)
            host_finite.copy_(finite, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        # the device tensors must live until the copy has read them
        for t in (aux, final, finite):
            t.record_stream(self.copy_stream)

        remaining = [len(batch)]
        lock = threading.Lock()

        def write(row: int) -> None:
            try:
                done.synchronize()
                self._write_sample(batch[row], host_aux, host_final, host_finite, row)
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

    def _write_batch(self, batch: Sequence[Sample], aux: torch.Tensor, final: torch.Tensor,
                     finite: torch.Tensor) -> None:
        futures = [self.writers.submit(self._write_sample, s, aux, final, finite, row)
                   for row, s in enumerate(batch)]
        for future in futures:  # no overlap: wait for the writes before the next batch
            future.result()

    def _write_sample(self, sample: Sample, aux: torch.Tensor, final: torch.Tensor,
                      finite: torch.Tensor, row: int) -> None:
        length = len(sample.input_ids)
        if not bool(finite[row]):
            log.warning("sample %s (%d): NaN/Inf in its hidden states; skipped", sample.id,
                        sample.index)
            with self.manifest_lock:
                self.stats.nonfinite.append(sample.id)
            return
        tensors = {
            "aux_hidden_states": aux[row, :length].contiguous(),
            "hidden_state": final[row, :length].contiguous(),
            "input_ids": torch.tensor(sample.input_ids, dtype=torch.int64),
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8),
        }
        parts = safetensors_parts(tensors, {"id": sample.id, "index": str(sample.index)})
        size = sum(p.nbytes for p in parts)
        path = sample_path(self.out, sample.index)
        write_atomically(path, parts, fsync=self.fsync)
        with self.manifest_lock:
            append_manifest(self.out, {
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


def load_samples(data: Path, tokenizer: Any, *, max_length: int | None, on_too_long: str,
                 stats: Stats, limit: int | None) -> Iterator[Sample]:
    """Tokenized samples in file order; the index is the record's ordinal among valid
    records, so it is stable across resumes of the same file."""
    jsonl = JsonlStats()
    seen: set[str] = set()
    index = 0
    for _, record in read_jsonl(data, jsonl, required=("messages",)):
        if limit is not None and index >= limit:
            break
        sample_id = str(record.get("id", index))
        if sample_id in seen:
            log.warning("duplicate id %s; later copy skipped", sample_id)
            continue
        seen.add(sample_id)
        tokens = tokenize_conversation(tokenizer, record["messages"], max_length=max_length)
        current, index = index, index + 1
        if tokens.truncated:
            if on_too_long == "skip":
                stats.too_long_skipped.append(sample_id)
                continue
            stats.truncated += 1
        if not tokens.input_ids:
            stats.empty.append(sample_id)
            continue
        yield Sample(current, sample_id, tokens.input_ids, tokens.loss_mask)
    stats.malformed_lines = jsonl.malformed


def load_model(path: Path, *, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model on `device`, or split over a comma-separated list of devices."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    devices = parse_devices(device)
    if len(devices) > 1:
        return load_split(path, devices, dtype), tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    return model, tokenizer


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workers.extract", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="target model directory")
    parser.add_argument("--data", required=True, type=Path, help="conversations JSONL")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--device", default=None,
                        help="device (default cuda if any, else cpu), or a comma-separated "
                             "list to split the model over (e.g. cuda:2,cuda:3)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-length", type=int, default=4096,
                        help="longest sample in tokens (default 4096)")
    parser.add_argument("--on-too-long", choices=("truncate", "skip"), default="truncate")
    parser.add_argument("--batch-tokens", type=int, default=16384,
                        help="padded tokens per forward pass (default 16384)")
    parser.add_argument("--writers", type=int, default=4, help="writer threads (default 4)")
    parser.add_argument("--queue-depth", type=int, default=3,
                        help="batches copied but not yet written (default 3)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="compute, then copy, then write (for comparison)")
    parser.add_argument("--fsync", action="store_true", help="fsync each file before rename")
    parser.add_argument("--limit", type=int, default=None, help="only the first N samples")
    parser.add_argument("--gpus", default=None, metavar="N|all",
                        help="data-parallel: one process per GPU, each a shard of the samples")
    parser.add_argument("--gpus-per-model", type=int, default=1, metavar="K",
                        help="split the model's layers over K GPUs (a target larger than "
                             "one GPU); with --gpus N, N/K data-parallel copies (default 1)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="data-parallel processes on --device (e.g. CPU ranks for tests)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.batch_tokens < 1 or args.max_length < 1 or args.writers < 1 or args.queue_depth < 1:
        parser.error("--batch-tokens, --max-length, --writers, --queue-depth must be >= 1")
    if args.gpus_per_model < 1:
        parser.error("--gpus-per-model must be >= 1")
    if args.gpus_per_model > 1 and args.ranks is not None:
        parser.error("--gpus-per-model goes with --gpus (CUDA devices), not --ranks")
    if args.gpus is not None and args.gpus != "all" and not args.gpus.isdigit():
        parser.error(f"--gpus takes a number or 'all', not {args.gpus!r}")
    if args.device is not None and (args.gpus is not None or args.gpus_per_model > 1):
        parser.error("--gpus and --gpus-per-model pick the CUDA devices (from cuda:0); "
                     "to choose them, give --device cuda:2,cuda:3 alone")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def rank_devices(args: argparse.Namespace) -> list[str]:
    """The device (or comma-separated devices of a split model) of each process to run:
    one entry means one process, several mean data-parallel ranks."""
    if args.rank is not None:
        return [args.device]
    per_model = args.gpus_per_model
    if args.gpus is not None or per_model > 1:
        available = torch.cuda.device_count()
        wanted = per_model if args.gpus is None else (
            available if args.gpus == "all" else int(args.gpus))
        if wanted < 1 or wanted > available:
            fail(f"--gpus {args.gpus or wanted}: {available} CUDA device(s) available")
        if wanted % per_model:
            fail(f"--gpus {wanted} is not a multiple of --gpus-per-model {per_model}")
        return [",".join(f"cuda:{g}" for g in range(r * per_model, (r + 1) * per_model))
                for r in range(wanted // per_model)]
    if args.ranks is not None and args.ranks > 1:
        return [args.device] * args.ranks
    return [args.device]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose, prefix=f"rank {args.rank} " if args.rank is not None else "")
    require_file(args.model, "model")
    require_file(args.data, "data file")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda but no CUDA device is available (use --device cpu)")
    args.out.mkdir(parents=True, exist_ok=True)
    devices = rank_devices(args)
    if len(devices) > 1:  # the parent of the ranks: settle the manifest, then fan out
        restore_manifest(args.out)
        own = rank_argv(sys.argv[1:] if argv is None else argv,
                        drop=("--gpus", "--gpus-per-model", "--ranks", "--device"))
        code = run_ranks("workers.extract", own, devices=devices,
                         state_dir=args.out / ".ranks")
        merge_summaries(args.out, len(devices))
        return code
    args.device = devices[0]
    first = torch.device(parse_devices(args.device)[0])
    if first.type == "cuda" and first.index is not None:
        torch.cuda.set_device(first)  # else CUDA puts a context on GPU 0 for every rank
    progress = ProgressReporter(None, "sample")
    progress.update(0, force=True)  # the model load can take minutes: say we are alive
    t0 = time.monotonic()
    model, tokenizer = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    log.info("loaded %s in %.1f s: %d layers, hidden %d, capturing layers %s", args.model,
             time.monotonic() - t0, model.config.num_hidden_layers, model.config.hidden_size,
             capture_layers(model.config.num_hidden_layers))

    stats = Stats()
    done = restore_manifest(args.out) if args.rank is None else existing_indexes(args.out)
    samples = list(load_samples(args.data, tokenizer, max_length=args.max_length,
                                on_too_long=args.on_too_long, stats=stats, limit=args.limit))
    if args.rank is not None:  # this rank's shard: every world_size-th sample
        samples = [s for s in samples if s.index % args.world_size == args.rank]
    stats.total = len(samples)
    todo = [s for s in samples if s.index not in done]
    stats.done_before = stats.total - len(todo)
    progress.total = stats.total
    if args.rank in (None, 0):
        write_config(args, model)
    log.info("%d samples: %d already done, %d to extract", stats.total, stats.done_before,
             len(todo))
    extractor = Extractor(model, args.out, batch_tokens=args.batch_tokens,
                          writers=args.writers, queue_depth=args.queue_depth,
                          overlap=not args.no_overlap, fsync=args.fsync, progress=progress,
                          stats=stats)
    summary_name = ("extract_summary.json" if args.rank is None
                    else f".ranks/extract_summary.rank{args.rank}.json")
    try:
        extractor.run(todo)
    except DiskFull as exc:
        write_summary(args.out, stats, summary_name)
        print(f"error: {exc}; {stats.done_before + stats.written} of {stats.total} samples "
              f"done. Free space and rerun the same command to resume.", file=sys.stderr)
        return EXIT_DISK_FULL
    extractor._report(force=True)
    write_summary(args.out, stats, summary_name)
    elapsed = time.monotonic() - extractor.started
    log.info("done: %d written (%.1f GB, %.0f tokens/s), %d already there, %d NaN/Inf "
             "skipped, %d too long skipped, %d truncated, %d malformed lines",
             stats.written, stats.bytes_written / 1e9, stats.tokens / max(elapsed, 1e-9),
             stats.done_before, len(stats.nonfinite), len(stats.too_long_skipped),
             stats.truncated, len(stats.malformed_lines))
    if args.device.startswith("cuda"):
        peaks = ", ".join(f"{d} {torch.cuda.max_memory_allocated(d) / 1e9:.1f} GB"
                          for d in parse_devices(args.device))
        log.info("peak GPU memory: %s", peaks)
    return 0


def write_config(args: argparse.Namespace, model: Any) -> None:
    config = {"model": str(args.model), "num_layers": model.config.num_hidden_layers,
              "hidden_size": model.config.hidden_size,
              "vocab_size": model.config.vocab_size,
              "aux_layer_ids": capture_layers(model.config.num_hidden_layers),
              "dtype": args.dtype, "max_length": args.max_length}
    (args.out / "extract_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_summary(out: Path, stats: Stats, name: str = "extract_summary.json") -> None:
    summary = {"total": stats.total, "done_before": stats.done_before,
               "written": stats.written, "bytes_written": stats.bytes_written,
               "nonfinite_skipped": stats.nonfinite,
               "too_long_skipped": stats.too_long_skipped, "truncated": stats.truncated,
               "empty_skipped": stats.empty, "malformed_lines": stats.malformed_lines}
    target = out / name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, target)


if __name__ == "__main__":
    raise SystemExit(main())
