"""Hidden-state extraction for EAGLE-3: `python -m workers.extract --help`.

Prefill only (no sampling, no lm_head): for each conversation, the inputs of decoder
layers [2, N//2, N-3] (what HF's `output_hidden_states[i]` holds) concatenated low|mid|
high into `aux_hidden_states` [S, 3H], the final hidden state after the final norm
`hidden_state` [S, H], `input_ids` [S] int64 and `loss_mask` [S] uint8 (1 on assistant
tokens), one safetensors file per sample under `rows_<a>-<b>/`, written to a temp name
and renamed (a partial file never counts), listed in `manifest.jsonl`. With
`--keep-prenorm-last` also `hidden_state_prenorm` [S, H], the last layer's output before
the final norm (+1/4 disk), for `workers.export --to speculators`.

Storage: `--store dtype` keeps the hidden states in the compute dtype (--dtype: bf16 on
a GPU). `--store fp8` (the default) stores them as float8_e4m3fn with one fp32
scale per token and per layer beside each (`aux_hidden_states_scale` [S, 3],
`hidden_state_scale` [S, 1], `hidden_state_prenorm_scale` [S, 1]; x ~= fp8 * scale):
about half the disk of bf16 (H + 4 bytes per token and layer instead of 2H), per
element within 1/16 of the value plus 2^-10 of the scale
(workers/eagle3/extraction/fp8_features.py). Encoded on the GPU before the device-to-host copy;
train, export and every other reader decode it (train to its compute dtype, export to bf16).
extract_config.json records the store; a resume without --store keeps it, and one with
another store is refused.

Speed: on a GPU the three costs — forward passes, device-to-host copies, file writes —
overlap. Batches are packed by length (`--batch-tokens`), captured states are copied
into a pool of pinned host buffers with non-blocking copies on a side stream, and a
bounded pool of writer threads turns them into files while the next batch computes.
`--no-overlap` runs the same work one step after the other (for comparison).
Writeback is steady by default (`--writeback fsync`: each file is fsynced, then its
pages leave the page cache): left to the kernel (`--writeback none`, or `--no-fsync`),
dirty pages pile up until the writers are throttled (on an H200: 80 % of HF's own
prefill on a 61-layer MoE, against 99 % with fsync; docs/benchmarks.md) and a long
run evicts the whole page cache. `--writeback range` starts each file's writeback at
once and waits for it a few files later (bench/writeback.py compares the three).

Several GPUs: `--gpus N` runs one process per GPU, each taking every N-th sample into
the same tree (workers/eagle3/extraction/ranks.py); `--gpus-per-model K` splits the
model's layers over K GPUs for a target larger than one (workers/eagle3/target/split.py),
N/K copies with `--gpus N`.

Several nodes: started once per task by a launcher that sets RANK and WORLD_SIZE (srun
under jobsup's `slurm` backend, torchrun), task t of T with L local ranks (`--gpus`,
`--ranks`; else 1, on GPU LOCAL_RANK) runs ranks t*L.. of T*L: each sample extracted once.
The tree must be on a filesystem all nodes share, and no two processes append to one
file (appends from several NFS clients are not safe): each rank keeps its manifest,
summary and progress under `.ranks/`; the task of rank 0 sums the progress into the
job's, and once every rank of this launch has finished, folds the rest into
`manifest.jsonl` and `extract_summary.json` (in the producer, not in each consumer:
train, vocab, export and evaluate keep reading one complete manifest).

Batch invariance: `--check-batch-invariance N` re-runs N of the samples alone and
compares them with the same samples inside their packed batches (per-layer relative
differences, MoE routing flips, lm_head argmax changes:
workers/eagle3/extraction/batch_invariance.py), writes `batch_invariance.json`, logs a
table and exits without extracting. In bf16 a mixture-of-experts target is not
batch-invariant: near-tie top-k routing decisions flip with what a sample is batched
with, and every later layer inherits the flip.

Resume: samples whose file exists whole are skipped (their manifest line is restored
if the crash came between the rename and the append); a file cut short (a power loss
before its data reached the disk, possible without fsync) is written again. Samples
with NaN/Inf hidden states are skipped and counted, never written. A full disk stops
the run cleanly (exit 4), with no partial file left behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.common import (
    JsonlStats,
    ProgressReporter,
    fail,
    read_jsonl,
    record_messages,
    require_file,
    setup_logging,
    tokenize_conversation,
    write_json,
)
from workers.eagle3.extraction.extract_parent import run_parent
from workers.eagle3.extraction.fp8_features import DEFAULT_STORE, STORES, store_of
from workers.eagle3.extraction.hidden_files import (
    DEFAULT_WRITEBACK,
    PRENORM_KEY,
    WRITEBACK_MODES,
    DiskFull,
    existing_indexes,
    rank_manifest,
    rank_summary,
    restore_manifest,
)
from workers.eagle3.extraction.ranks import LaunchError, in_shard, launcher_task, run_identity
from workers.eagle3.target.loading import (
    DTYPE_NAMES,
    EXPERTS,
    load_target,
    load_tokenizer,
    torch_dtype,
)
from workers.eagle3.target.model import Target, TargetError

if TYPE_CHECKING:  # imported where used: the parent of the ranks never loads torch
    import torch

    from workers.eagle3.extraction.extractor import Sample, Stats

log = logging.getLogger("workers.extract")

EXIT_DISK_FULL = 4


def load_samples(data: Path, tokenizer: Any, *, max_length: int | None, on_too_long: str,
                 stats: Stats, limit: int | None) -> Iterator[Sample]:
    """Tokenized samples in file order; the index is the record's ordinal among valid
    records, so it is stable across resumes of the same file."""
    from workers.eagle3.extraction.extractor import Sample

    jsonl = JsonlStats()
    seen: set[str] = set()
    index = 0
    for number, record in read_jsonl(data, jsonl):
        if limit is not None and index >= limit:
            break
        try:  # `messages`, or ShareGPT-style `conversations`
            messages = record_messages(record)
        except ValueError as exc:
            jsonl.malformed.append(number)
            log.warning("%s: skipping malformed line %d: %s", data, number, exc)
            continue
        sample_id = str(record.get("id", index))
        if sample_id in seen:
            log.warning("duplicate id %s; later copy skipped", sample_id)
            continue
        seen.add(sample_id)
        if not messages:  # the chat template refuses an empty conversation
            index += 1
            stats.empty.append(sample_id)
            continue
        tokens = tokenize_conversation(tokenizer, messages, max_length=max_length)
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


def load_model(path: Path, *, device: str, dtype: torch.dtype, experts: str = "auto",
               progress: ProgressReporter | None = None) -> tuple[Target, Any]:
    """The target (a causal LM, or a multimodal model's language model: see
    workers/eagle3/target/loading.py) on `device`, or split over a comma-separated list of devices;
    `experts`: how a packed-INT4 checkpoint's routed experts are held. A packed load
    reports its GB read and GB/s in `progress`'s metrics (`load_gb`, `load_gb_per_s`):
    the seed's 24-minute load was silent."""
    from workers.eagle3.target.split import parse_devices

    started = time.monotonic()

    def loading(bytes_read: int) -> None:
        if progress is not None:
            gb = bytes_read / 1e9
            progress.update(0, {"load_gb": gb,
                                "load_gb_per_s": gb / max(time.monotonic() - started, 1e-3)})

    try:
        tokenizer = load_tokenizer(path)
        return load_target(path, device=parse_devices(device), dtype=dtype,
                           experts=experts, on_bytes_read=loading), tokenizer
    except TargetError as exc:
        fail(f"--model: {exc}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m workers.extract", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="target model directory")
    parser.add_argument("--data", required=True, type=Path,
                        help='conversations JSONL: "messages" [{role, content}] or ShareGPT '
                             '"conversations" [{from: human|gpt|system, value}]')
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--device", default=None,
                        help="device (default cuda if any, else cpu), or a comma-separated "
                             "list to split the model over (e.g. cuda:2,cuda:3)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPE_NAMES)], default="auto",
                        help="compute and storage dtype (auto: bf16 on CUDA, fp32 on CPU, "
                             "where bf16 matmuls run many times slower)")
    parser.add_argument("--experts", choices=EXPERTS, default="auto",
                        help="a compressed-tensors pack-quantized INT4 checkpoint's routed "
                             "experts: packed (kept INT4, the Triton kernel on CUDA), or "
                             "dequantized to bf16 by transformers (4x the memory); auto: "
                             "packed (recorded in extract_config.json)")
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
    writeback = parser.add_mutually_exclusive_group()
    writeback.add_argument("--writeback", choices=WRITEBACK_MODES, default=DEFAULT_WRITEBACK,
                           help="how each file goes to the disk: fsync (before its rename, "
                                "then its pages leave the page cache), range (writeback "
                                "started at once, waited for a few files later, pages "
                                "dropped; not durable against a power loss), none (the "
                                f"kernel's dirty limits decide). Default {DEFAULT_WRITEBACK}")
    writeback.add_argument("--fsync", dest="writeback", action="store_const", const="fsync",
                           help="--writeback fsync")
    writeback.add_argument("--no-fsync", dest="writeback", action="store_const",
                           const="none", help="--writeback none")
    parser.add_argument("--keep-prenorm-last", action="store_true",
                        help=f"also store the last layer's output BEFORE the final norm "
                             f"({PRENORM_KEY} [S, H]), which vLLM's speculators train on "
                             "(workers.export --to speculators needs it); +1/4 disk. Off by "
                             "default: hidden_state (after the norm) cannot be turned back "
                             "into it")
    parser.add_argument("--store", choices=STORES, default=None,
                        help="how hidden states are stored: fp8 (float8_e4m3fn, one fp32 "
                             "scale per token and per layer in <name>_scale; about half the "
                             "disk of bf16, error <= 1/16 of each value + 2^-10 of its "
                             "scale) or dtype (the compute dtype, --dtype: bf16 on a GPU). "
                             f"Default {DEFAULT_STORE}, or on a resume the store the output "
                             "directory began with (another is refused)")
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
    parser.add_argument("--check-batch-invariance", type=int, default=None, metavar="N",
                        help="instead of extracting, re-run N of the samples alone and compare "
                             "them with the same samples in their packed --batch-tokens "
                             "batches (per-layer differences, MoE routing flips, lm_head "
                             "argmax changes); writes OUT/batch_invariance.json, logs a table "
                             "and exits. A diagnostic that decides how to extract (--dtype, "
                             "--batch-tokens), so it does not also commit to an extraction; "
                             "one process: not with --gpus or --ranks")
    parser.add_argument("--check-fp32-router", action="store_true",
                        help="with --check-batch-invariance: compute the MoE routers' logits "
                             "in fp32 during the check (the remedy to measure; DeepSeek-V3's "
                             "router already does, Qwen3-MoE's and Mixtral's do not)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.batch_tokens < 1 or args.max_length < 1 or args.writers < 1 or args.queue_depth < 1:
        parser.error("--batch-tokens, --max-length, --writers, --queue-depth must be >= 1")
    if args.check_batch_invariance is not None:
        if args.check_batch_invariance < 1:
            parser.error("--check-batch-invariance must be >= 1")
        if args.gpus is not None or args.ranks is not None:
            parser.error("--check-batch-invariance runs in one process: drop --gpus and "
                         "--ranks (--device or --gpus-per-model K still split a large model)")
    elif args.check_fp32_router:
        parser.error("--check-fp32-router goes with --check-batch-invariance")
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
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        on_gpu = args.device.startswith("cuda") or args.gpus is not None
        args.dtype = "bf16" if on_gpu else "fp32"
    return args


def rank_devices(args: argparse.Namespace) -> list[str]:
    """The device (or comma-separated devices of a split model) of each process to run:
    one entry means one process, several mean data-parallel ranks."""
    if args.rank is not None:
        return [args.device]
    per_model = args.gpus_per_model
    if args.gpus is not None or per_model > 1:
        import torch

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
    try:  # a task of a multi-task launch (srun, torchrun), unless a parent made us a rank
        task = launcher_task(os.environ) if args.rank is None else None
    except LaunchError as exc:
        fail(f"{exc}\nhint: unset WORLD_SIZE to run alone")
    if task is not None and args.check_batch_invariance is not None:
        fail(f"--check-batch-invariance runs in one process, not as task {task.rank} of "
             f"WORLD_SIZE={task.world_size}\nhint: run it as a job of one task")
    prefix = (f"rank {args.rank} " if args.rank is not None
              else f"task {task.rank} " if task is not None else "")
    setup_logging(args.verbose, prefix=prefix)
    require_file(args.model, "model")
    require_file(args.data, "data file")
    if args.device.startswith("cuda"):  # torch only here: a parent of CPU ranks never loads it
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda but no CUDA device is available (use --device cpu)")
        if task is not None and args.device == "cuda" and torch.cuda.device_count() > 1:
            local = int(os.environ.get("LOCAL_RANK", "0") or 0)  # tasks sharing a node's GPUs
            args.device = f"cuda:{local % torch.cuda.device_count()}"
    args.store = resume_settings(args.out, keep_prenorm=args.keep_prenorm_last,
                                 store=args.store)
    args.out.mkdir(parents=True, exist_ok=True)
    devices = rank_devices(args)
    if len(devices) > 1 or task is not None:
        return run_parent(args, sys.argv[1:] if argv is None else argv, devices, task)
    args.device = devices[0]
    return extract_here(args)


def extract_here(args: argparse.Namespace) -> int:
    """The extraction in this process: alone, or as one rank of a parent's."""
    import torch

    from workers.eagle3.extraction.batch_invariance import (
        CheckError,
        check_batch_invariance,
        format_report,
    )
    from workers.eagle3.extraction.extractor import Extractor, Stats, capture_layers
    from workers.eagle3.target.split import parse_devices

    first = torch.device(parse_devices(args.device)[0])
    if first.type == "cuda" and first.index is not None:
        torch.cuda.set_device(first)  # else CUDA puts a context on GPU 0 for every rank
    progress = ProgressReporter(None, "sample")
    progress.update(0, force=True)  # the model load can take minutes: say we are alive
    t0 = time.monotonic()
    target, tokenizer = load_model(args.model, device=args.device, dtype=torch_dtype(args.dtype),
                                   experts=args.experts, progress=progress)
    log.info("loaded %s (%s) in %.1f s: %d layers, hidden %d, capturing layers %s",
             args.model, type(target.model).__name__, time.monotonic() - t0,
             target.num_layers, target.hidden_size, capture_layers(target.num_layers))

    stats = Stats()
    done = (restore_manifest(args.out) if args.rank is None
            else existing_indexes(args.out, (args.rank, args.world_size)))
    samples = list(load_samples(args.data, tokenizer, max_length=args.max_length,
                                on_too_long=args.on_too_long, stats=stats, limit=args.limit))
    if args.check_batch_invariance is not None:  # the diagnostic instead of the extraction
        try:
            report = check_batch_invariance(
                target.decoder, target.lm_head, samples, n=args.check_batch_invariance,
                batch_tokens=args.batch_tokens, fp32_router=args.check_fp32_router)
        except CheckError as exc:
            fail(f"--check-batch-invariance: {exc}")
        path = write_json(args.out / "batch_invariance.json", report)
        log.info("%s\nreport: %s", format_report(report), path)
        return 0
    if args.rank is not None:  # this rank's shard: every world_size-th sample
        samples = [s for s in samples if in_shard(s.index, args.rank, args.world_size)]
    stats.total = len(samples)
    todo = [s for s in samples if s.index not in done]
    stats.done_before = stats.total - len(todo)
    progress.total = stats.total
    if args.rank in (None, 0):
        write_config(args, target)
    log.info("%d samples: %d already done, %d to extract", stats.total, stats.done_before,
             len(todo))
    manifest = None if args.rank is None else rank_manifest(args.out, args.rank)
    if manifest is not None:
        manifest.parent.mkdir(exist_ok=True)
    extractor = Extractor(target, args.out, batch_tokens=args.batch_tokens,
                          writers=args.writers, queue_depth=args.queue_depth,
                          overlap=not args.no_overlap, writeback=args.writeback,
                          progress=progress, stats=stats, keep_prenorm=args.keep_prenorm_last,
                          manifest=manifest, store=args.store)
    summary_name = ("extract_summary.json" if args.rank is None
                    else str(rank_summary(args.out, args.rank).relative_to(args.out)))
    try:
        extractor.run(todo)
    except DiskFull as exc:
        write_summary(args.out, stats, summary_name, args.rank, args.world_size)
        print(f"error: {exc}; {stats.done_before + stats.written} of {stats.total} samples "
              f"done. Free space and rerun the same command to resume.", file=sys.stderr)
        return EXIT_DISK_FULL
    extractor._report(force=True)
    write_summary(args.out, stats, summary_name, args.rank, args.world_size)
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


def resume_settings(out: Path, *, keep_prenorm: bool, store: str | None) -> str:
    """The store to extract in: `store` (--store), else the one `out`'s
    extract_config.json records (also one written before any sample: a resume without
    --store goes on in the store it began with, also one begun before the default became
    fp8), else DEFAULT_STORE. Where samples exist, a resumed extraction also keeps its
    --keep-prenorm-last setting and its --store: files with and without the pre-norm
    state in one tree would fail an export half-way, and fp8 files beside bf16 ones would
    make one dataset of two precisions that its extract_config.json misdescribes. Any
    sample file counts (each rank of a large run checks: opening every file is for the
    resume)."""
    try:
        config = json.loads((out / "extract_config.json").read_text(encoding="utf-8"))
        before = bool(config.get("keep_prenorm_last"))
        store_before = store_of(config)
    except (OSError, ValueError, AttributeError):
        return store or DEFAULT_STORE
    if store is None:
        if store_before not in STORES:
            fail(f"{out}/extract_config.json records store {store_before!r}, not one of "
                 f"{', '.join(STORES)}: give --store, or use a new --out")
        store = store_before
    if next(out.glob("rows_*/*.safetensors"), None) is None:
        return store
    if before != keep_prenorm:
        fail(f"{out} was extracted {'with' if before else 'without'} --keep-prenorm-last; "
             f"rerun {'with' if before else 'without'} it to resume, or use a new --out")
    if store_before != store:
        fail(f"{out} was extracted with --store {store_before}; one output directory holds "
             f"one store: rerun with --store {store_before} to resume, or use a new --out")
    return store


def write_config(args: argparse.Namespace, target: Target) -> None:
    from workers.eagle3.extraction.extractor import capture_layers

    config = {"model": str(args.model), "num_layers": target.num_layers,
              "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
              "aux_layer_ids": capture_layers(target.num_layers),
              "dtype": args.dtype, "experts": target.experts, "max_length": args.max_length,
              "keep_prenorm_last": args.keep_prenorm_last, "store": args.store,
              "writeback": args.writeback}
    write_json(args.out / "extract_config.json", config)  # whole or absent to a reader


def write_summary(out: Path, stats: Stats, name: str = "extract_summary.json",
                  rank: int | None = None, world_size: int = 1) -> None:
    """The run's counts; a rank's also say which rank of how many, in which launch
    (`ranks_finished` waits for them)."""
    identity = {} if rank is None else {"rank": rank, "world_size": world_size,
                                        "run": run_identity(os.environ)}
    summary = {**identity, "total": stats.total, "done_before": stats.done_before,
               "written": stats.written, "bytes_written": stats.bytes_written,
               "nonfinite_skipped": stats.nonfinite,
               "too_long_skipped": stats.too_long_skipped, "truncated": stats.truncated,
               "empty_skipped": stats.empty, "malformed_lines": stats.malformed_lines}
    write_json(out / name, summary)


if __name__ == "__main__":
    raise SystemExit(main())
