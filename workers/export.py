"""Export a `workers.extract` output to another trainer's offline format:
`python -m workers.export --to specforge|speculators --hidden-states DIR --out OUT`;
and, for speculators, a trained draft: `--draft DIR --target TARGET` (either or both).

Sample by sample (one sample in memory per --workers thread, never the dataset), each
output written to a temp name and renamed, so a rerun skips what is complete and an
interrupted run (or a full disk, exit 4) resumes where it stopped.

--to specforge (sgl-project/SpecForge, offline EAGLE-3 training, `hidden_states_path`):
  OUT/rows_<a>-<a+2000>/data_<index>.ckpt, one torch.save'd dict per sample:
  `input_ids` [S] int64, `loss_mask` [S] int64, `aux_hidden_state` [1, S, 3H] (our
  aux_hidden_states: layer inputs low|mid|high) and `hidden_state` [1, S, H] (the final
  state after the norm, which SpecForge feeds to the target's lm_head). SpecForge lists
  every `*.ckpt` / `*.ckpt.gz` under the directory, recursively, and torch.load's them
  (pickle: open only exports you trust). With --vocab: OUT/vocab_mapping/vocab_mapping.pt
  ({"d2t", "t2d"}) for `model.vocab_mapping_path`.

--to speculators (vllm-project/speculators, offline training, `--data-path OUT`):
  OUT is a Hugging Face dataset (`save_to_disk`: columns `input_ids`, `loss_mask`
  int64 sequences and `seq_len`, torch format; needs the `datasets` package) whose row i
  goes with OUT/hidden_states/hs_<i>.safetensors: `hidden_states` [S, 4, H] (the three
  aux layers, then the last layer's output BEFORE the final norm, as vLLM's
  extract_hidden_states writes it with layer ids [2, N//2, N-3, N]) and `token_ids` [S]
  int64. Samples without assistant tokens are left out, as speculators' own
  preprocessing drops them. With --vocab (N draft ids): OUT/d2t-<N>.npy and
  OUT/t2d-<N>.npy, where the released `speculators train --data-path OUT
  --draft-vocab-size N` (0.9.0, train/cli.py `parse_vocab_mappings`) looks for them,
  and the same arrays as OUT/d2t.npy and OUT/t2d.npy, where the repository's older
  scripts/train.py looks; the export prints the `speculators train` line.
  The pre-norm state is not in a default extraction, and the normed `hidden_state`
  cannot stand in for it (speculators applies the target's norm itself, and RMSNorm
  cannot be undone): extract with `python -m workers.extract --keep-prenorm-last`.

--to speculators --draft DIR --target TARGET: OUT/draft/ = the draft `workers.train`
wrote plus the target's `embed_tokens` (speculators' loader needs it in the file; vLLM
and SGLang do not, so out/train/draft/ never holds it), and the exact `speculators
convert` line, printed, that makes OUT/speculators_draft/ with the draft's layer ids
(workers/eagle3/draft/speculators_draft.py says why both).

--vocab takes the d2t/t2d file of `workers.vocab` (or a draft checkpoint that has them).
Progress goes to $JOBSUP_PROGRESS_FILE; OUT/export.json records what was exported.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import os
import shlex
import shutil
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.common import ProgressReporter, fail, read_jsonl, setup_logging, write_json
from workers.eagle3.draft import speculators_draft
from workers.eagle3.draft.vocab_mapping import VocabError, load_mapping
from workers.eagle3.extraction.fp8_features import is_encoded, read_feature, store_of
from workers.eagle3.extraction.hidden_files import (
    PRENORM_KEY,
    SHARD_SIZE,
    DiskFull,
    Writeback,
    safetensors_parts,
    write_atomically,
)

log = logging.getLogger("workers.export")

EXIT_DISK_FULL = 4
FORMATS = ("specforge", "speculators")
PRENORM_HINT = ("re-extract with `python -m workers.extract --keep-prenorm-last` (it stores "
                f"{PRENORM_KEY}, the last layer's output before the final norm; +1/4 disk)")


FP8_EXPORT_DTYPE = torch.bfloat16
"""What an fp8 extraction's hidden states are written as: both formats' trainers read
bf16. speculators has an fp8 convention of its own (hs-connectors 0.9.0's FP8 backend:
`hidden_states_scales` [S, 1, 1], one scale per token over all four layers, read with
`--hidden-states-backend fp8`), but ours has one scale per token and layer: writing
theirs would round every value a second time, and their default file backend, which
the export's printed train command uses, reads bf16."""


class ExportError(Exception):
    """A user mistake or unusable input: `error: ...`, exit 2."""


@dataclass(frozen=True)
class Entry:
    """One extracted sample, from the manifest."""

    index: int
    id: str
    file: str
    seq_len: int
    loss_tokens: int | None


@dataclass
class Source:
    """A `workers.extract` output: its config and its samples in index order."""

    root: Path
    config: dict[str, Any]
    entries: list[Entry]

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def keeps_prenorm(self) -> bool:
        return bool(self.config.get("keep_prenorm_last"))


def read_source(root: Path) -> Source:
    manifest, config_path = root / "manifest.jsonl", root / "extract_config.json"
    for path in (manifest, config_path):
        if not path.is_file():
            raise ExportError(f"{path} does not exist: is --hidden-states a workers.extract "
                              "output directory?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        int(config["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{config_path}: unreadable extract config: {exc}") from exc
    # read only (the source is never written): a line torn by a kill mid-append, or
    # one still being appended, is skipped as malformed
    entries: dict[int, Entry] = {}
    for _, record in read_jsonl(manifest, required=("index", "file", "seq_len")):
        loss = record.get("loss_tokens")
        entries[int(record["index"])] = Entry(
            int(record["index"]), str(record.get("id", record["index"])), str(record["file"]),
            int(record["seq_len"]), None if loss is None else int(loss))
    if not entries:
        raise ExportError(f"{manifest}: no samples")
    return Source(root, config, [entries[i] for i in sorted(entries)])


def read_sample(source: Source, entry: Entry, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The named tensors of one sample file, checked against the extraction's shapes;
    hidden states stored fp8 (`workers.extract --store fp8`) come back decoded to bf16
    (FP8_EXPORT_DTYPE), any others in the extraction's dtype."""
    path = source.root / entry.file
    if not path.is_file():
        raise ExportError(f"{path}: listed in the manifest but missing (rerun workers.extract "
                          "on the same --out to finish the extraction)")
    length, hidden = entry.seq_len, source.hidden
    widths = {"aux_hidden_states": 3 * hidden, "hidden_state": hidden, PRENORM_KEY: hidden}
    try:
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            missing = [k for k in keys if k not in present]
            if PRENORM_KEY in missing:
                raise ExportError(f"{path} has no {PRENORM_KEY}: {PRENORM_HINT}")
            if missing:
                raise ExportError(f"{path}: no {', '.join(missing)} in it")
            tensors = {k: read_feature(f, k, dtype=FP8_EXPORT_DTYPE)
                       if k in widths and is_encoded(f, k) else f.get_tensor(k) for k in keys}
    except ExportError:
        raise
    except Exception as exc:  # a torn or foreign file (safetensors' own error types)
        raise ExportError(f"{path}: unreadable sample: {exc}") from exc
    for key, tensor in tensors.items():
        want = (length, widths[key]) if key in widths else (length,)
        if tuple(tensor.shape) != want:
            raise ExportError(f"{path}: {key} is {list(tensor.shape)}, expected {list(want)}")
    return tensors


def atomic_bytes(path: Path, data: memoryview, writeback: Writeback) -> None:
    write_atomically(path, [data], writeback=writeback)


def saved_bytes(obj: Any) -> memoryview:
    """torch.save into memory: the file is then written like every other (temp + rename,
    ENOSPC -> DiskFull), which torch.save's own writer would not let us do."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


# -- the two formats ----------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """One output file to make from one sample."""

    entry: Entry
    path: Path
    row: int


class Format(ABC):
    name = ""

    def __init__(self, source: Source, out: Path, fsync: bool):
        self.source, self.out = source, out
        self.writeback = Writeback("fsync" if fsync else "none")  # neither holds files

    def check(self) -> None:  # noqa: B027 - a hook: formats with nothing to check skip it
        """Refuse before writing anything."""

    @abstractmethod
    def jobs(self) -> list[Job]:
        """One job per sample: where its output goes."""

    def done(self, job: Job) -> bool:
        return job.path.is_file()

    @abstractmethod
    def convert(self, job: Job) -> int:
        """Writes one output file; returns its size in bytes."""

    @abstractmethod
    def write_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
        """The vocabulary mapping in the tool's own file format."""

    def finish(self, jobs: list[Job]) -> None:  # noqa: B027 - a hook, as check()
        """After every sample file is there."""


class SpecForge(Format):
    """sgl-project/SpecForge: specforge/data/preprocessing.py `list_local_files` +
    `OfflineEagle3Dataset`, written as scripts/prepare_hidden_states.py writes them."""

    name = "specforge"

    def jobs(self) -> list[Job]:
        out = []
        for row, entry in enumerate(self.source.entries):
            start = entry.index // SHARD_SIZE * SHARD_SIZE  # their file_group_size: 2000
            out.append(Job(entry, self.out / f"rows_{start}-{start + SHARD_SIZE}" /
                           f"data_{entry.index}.ckpt", row))
        return out

    def convert(self, job: Job) -> int:
        t = read_sample(self.source, job.entry,
                        ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state"))
        record = {"input_ids": t["input_ids"].to(torch.int64),
                  "loss_mask": t["loss_mask"].to(torch.int64),
                  "aux_hidden_state": t["aux_hidden_states"].unsqueeze(0),
                  "hidden_state": t["hidden_state"].unsqueeze(0)}
        data = saved_bytes(record)
        # the temp name ends in .tmp: SpecForge lists only *.ckpt, so never a partial file
        atomic_bytes(job.path, data, self.writeback)
        return data.nbytes

    def write_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
        path = self.out / "vocab_mapping" / "vocab_mapping.pt"
        atomic_bytes(path, saved_bytes({"d2t": d2t.to(torch.int64).contiguous(),
                                        "t2d": t2d.to(torch.bool).contiguous()}),
                     self.writeback)
        return path


def npy_bytes(array: Any) -> memoryview:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getbuffer()


class Speculators(Format):
    """vllm-project/speculators: src/speculators/train/data.py `ArrowDataset` reading
    hs_connectors' `FileTransfer` files (hs_<i>.safetensors, as vLLM's
    ExampleHiddenStatesConnector writes them)."""

    name = "speculators"

    def check(self) -> None:
        if not self.source.keeps_prenorm:
            raise ExportError(
                f"--to speculators needs the last layer's output before the final norm, "
                f"which {self.source.root} does not hold ({PRENORM_KEY}): {PRENORM_HINT}. "
                "Its hidden_state is after the norm, which speculators would normalize again "
                "and which cannot be undone, so it is not used instead")
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise ExportError("--to speculators writes a Hugging Face dataset (what its "
                              "trainer loads with load_from_disk): pip install datasets") from None

    def jobs(self) -> list[Job]:
        rows = [e for e in self.source.entries if self.loss_tokens(e) > 0]
        dropped = len(self.source.entries) - len(rows)
        if dropped:
            log.info("%d samples have no assistant tokens; left out, as speculators' "
                     "preprocessing drops them", dropped)
        return [Job(e, self.out / "hidden_states" / f"hs_{row}.safetensors", row)
                for row, e in enumerate(rows)]

    def loss_tokens(self, entry: Entry) -> int:
        if entry.loss_tokens is not None:
            return entry.loss_tokens
        # a manifest line without the count: read the mask (small, memory-mapped)
        return int(read_sample(self.source, entry, ("loss_mask",))["loss_mask"].sum())

    def done(self, job: Job) -> bool:
        """The file exists and was made from this very sample: rows are positions, so
        an extraction that grew or lost samples since moves them."""
        if not job.path.is_file():
            return False
        try:
            with safe_open(str(job.path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # noqa: BLE001 - a foreign or broken file is redone
            return False
        return meta.get("jobsup_index") == str(job.entry.index)

    def convert(self, job: Job) -> int:
        t = read_sample(self.source, job.entry,
                        ("input_ids", "aux_hidden_states", PRENORM_KEY))
        length, hidden = job.entry.seq_len, self.source.hidden
        stacked = torch.cat([t["aux_hidden_states"].view(length, 3, hidden),
                             t[PRENORM_KEY].view(length, 1, hidden)], dim=1)  # [S, 4, H]
        parts = safetensors_parts(
            {"hidden_states": stacked, "token_ids": t["input_ids"].to(torch.int64)},
            {"jobsup_index": str(job.entry.index), "jobsup_id": job.entry.id})
        write_atomically(job.path, parts, writeback=self.writeback)
        return sum(p.nbytes for p in parts)

    def write_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
        """d2t-<N>.npy/t2d-<N>.npy (the released CLI's names) and d2t.npy/t2d.npy
        (the repository script's): a few hundred KB each, so both are served."""
        d2t_bytes = npy_bytes(d2t.to(torch.int64).numpy())
        t2d_bytes = npy_bytes(t2d.to(torch.bool).numpy())
        for suffix in (f"-{d2t.numel()}", ""):
            atomic_bytes(self.out / f"d2t{suffix}.npy", d2t_bytes, self.writeback)
            atomic_bytes(self.out / f"t2d{suffix}.npy", t2d_bytes, self.writeback)
        return self.out / f"d2t-{d2t.numel()}.npy"

    def train_command(self, draft_vocab_size: int | None) -> list[str]:
        """The released `speculators train` (0.9.0) on this export: the layer ids the
        features hold (else it assumes [2, N//2, N-3]) and, with a vocabulary, its
        size, by which it finds d2t-<N>.npy/t2d-<N>.npy in --data-path."""
        argv = ["speculators", "train", "--speculator-type", "eagle3",
                "--data-path", str(self.out.resolve())]
        model = self.source.config.get("model")
        if model:
            argv += ["--verifier-name-or-path", str(model)]
        layers = self.source.config.get("aux_layer_ids")
        if layers:
            argv += ["--target-layer-ids", *map(str, layers)]
        if draft_vocab_size is not None:
            argv += ["--draft-vocab-size", str(draft_vocab_size)]
        return argv

    def finish(self, jobs: list[Job]) -> None:
        """The dataset (token ids and loss masks only, streamed from the sample files
        into Arrow), rebuilt whole each run: it is small next to the hidden states."""
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        staging, cache = self.out / ".dataset.tmp", self.out / ".dataset.cache"
        for path in (staging, cache):
            shutil.rmtree(path, ignore_errors=True)
        sequence = getattr(datasets, "List", None) or datasets.Sequence  # List: datasets >= 4
        features = datasets.Features({
            "input_ids": sequence(datasets.Value("int64")),
            "loss_mask": sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64")})
        try:
            dataset = datasets.Dataset.from_generator(
                dataset_rows, features=features, cache_dir=str(cache),
                fingerprint=uuid.uuid4().hex,  # else it pickles the generator to hash it
                gen_kwargs={"root": str(self.source.root),
                            "files": [job.entry.file for job in jobs]})
            dataset.set_format(type="torch")  # as speculators' prepare_data.py saves it
            dataset.save_to_disk(str(staging))
            del dataset
            for old in self.out.glob("data-*.arrow"):
                old.unlink()
            for new in sorted(staging.iterdir(), key=lambda p: p.name == "state.json"):
                os.replace(new, self.out / new.name)  # state.json last
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"disk full while writing the dataset in {self.out}") from exc
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)


def dataset_rows(root: str, files: list[str]) -> Iterator[dict[str, Any]]:
    """The speculators dataset's rows, one sample file at a time."""
    for file in files:
        with safe_open(str(Path(root) / file), framework="pt") as f:
            ids = f.get_tensor("input_ids").to(torch.int64)
            mask = f.get_tensor("loss_mask").to(torch.int64)
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": ids.numel()}


FORMAT_CLASSES: dict[str, type[Format]] = {"specforge": SpecForge, "speculators": Speculators}


# -- the run ------------------------------------------------------------------------------

@dataclass
class Stats:
    total: int = 0
    done_before: int = 0
    written: int = 0
    bytes_written: int = 0
    started: float = field(default_factory=time.monotonic)


def run_jobs(fmt: Format, jobs: list[Job], workers: int, progress: ProgressReporter,
             stats: Stats) -> None:
    """Converts the jobs on `workers` threads with at most 2 x workers samples in
    flight; the first error stops new work, lets what runs finish, and is raised."""
    def report(force: bool = False) -> None:
        elapsed = max(time.monotonic() - stats.started, 1e-9)
        progress.update(stats.done_before + stats.written,
                        {"gb_per_s": stats.bytes_written / elapsed / 1e9}, force=force)

    error: BaseException | None = None
    pending: set[Future[int]] = set()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="export") as pool:
        todo = iter(jobs)
        while True:
            while error is None and len(pending) < 2 * workers:
                job = next(todo, None)
                if job is None:
                    break
                pending.add(pool.submit(fmt.convert, job))
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                try:
                    size = future.result()
                except BaseException as exc:  # noqa: BLE001 - raised below, once
                    error = error or exc
                    continue
                stats.written += 1
                stats.bytes_written += size
                report()
    report(force=True)
    if error is not None:
        raise error


def check_record(out: Path, to: str) -> dict[str, Any]:
    """OUT/export.json as an earlier run left it ({} when none); refuses an OUT that
    holds another format's export."""
    record = out / "export.json"
    before: dict[str, Any] = {}
    if record.is_file():
        try:
            before = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            before = {}
        if before.get("to") not in (None, to):
            raise ExportError(f"{out} holds a --to {before.get('to')} export; give --to "
                              f"{to} a directory of its own")
    return before if isinstance(before, dict) else {}


def export(args: argparse.Namespace) -> Stats:
    """The features (--hidden-states) and/or the draft (--draft); OUT/export.json keeps
    what an earlier run of the other part recorded."""
    stats = Stats()
    summary = {**check_record(args.out, args.to), "to": args.to}
    if args.hidden_states is not None:
        stats, features = export_features(args)
        summary.update(features)
    if args.draft is not None:
        summary.update(export_draft(args))
    write_json(args.out / "export.json", summary)
    return stats


def export_draft(args: argparse.Namespace) -> dict[str, Any]:
    """OUT/draft/ for `speculators convert`, and the line that converts it (stdout)."""
    if not (args.draft / "config.json").is_file():
        raise ExportError(f"--draft {args.draft}: no config.json (give the draft directory "
                          "workers.train wrote: OUT/train/draft)")
    written, draft_dir = (args.out / speculators_draft.DRAFT_DIR).resolve(), args.draft.resolve()
    # OUT/draft is replaced whole: it may be neither the draft, nor hold it (a checkpoint
    # under it would be deleted), nor lie inside it
    if written == draft_dir or written in draft_dir.parents or draft_dir in written.parents:
        raise ExportError(f"--out {args.out} would write {written}, replacing --draft "
                          f"{args.draft}; give --out a directory of its own")
    try:
        draft, layers = speculators_draft.write_speculators_draft(args.draft, args.target,
                                                                  args.out)
    except speculators_draft.SpeculatorsDraftError as exc:
        raise ExportError(str(exc)) from exc
    argv = speculators_draft.convert_command(
        draft, args.target, args.out / speculators_draft.CONVERTED_DIR, layers)
    line = speculators_draft.command_line(argv)
    log.info("draft for speculators: %s (with the target's embed_tokens); convert it with:",
             draft)
    print(line, flush=True)
    return {"draft": str(args.draft), "target": str(args.target), "draft_layer_ids": layers,
            "convert_command": line}


def export_features(args: argparse.Namespace) -> tuple[Stats, dict[str, Any]]:
    source = read_source(args.hidden_states)
    out = args.out
    for a, b in ((out, source.root), (source.root, out)):
        if a.resolve() == b.resolve() or b.resolve() in a.resolve().parents:
            raise ExportError(f"--out {out} and --hidden-states {source.root} overlap; give "
                              "--out a directory of its own")
    if args.limit is not None:
        source.entries = source.entries[:args.limit]
    mapping = None
    if args.vocab is not None:
        if not args.vocab.exists():
            raise ExportError(f"--vocab {args.vocab} does not exist")
        try:
            d2t, t2d, _ = load_mapping(args.vocab)
        except VocabError as exc:
            raise ExportError(str(exc)) from exc
        vocab_size = source.config.get("vocab_size")
        if isinstance(vocab_size, int) and t2d.numel() != vocab_size:
            raise ExportError(f"--vocab {args.vocab} maps a target vocabulary of {t2d.numel()} "
                              f"ids, but {source.root} was extracted from a model of "
                              f"{vocab_size}: another target's mapping?")
        mapping = (d2t, t2d)
    fmt = FORMAT_CLASSES[args.to](source, out, args.fsync)
    fmt.check()
    check_record(out, args.to)
    out.mkdir(parents=True, exist_ok=True)

    jobs = fmt.jobs()
    stats = Stats(total=len(jobs))
    progress = ProgressReporter(stats.total, "sample")
    todo = [job for job in jobs if not fmt.done(job)]
    stats.done_before = stats.total - len(todo)
    log.info("%s -> %s (%s): %d samples, %d already exported, %d to write", source.root, out,
             args.to, stats.total, stats.done_before, len(todo))
    run_jobs(fmt, todo, args.workers, progress, stats)
    fmt.finish(jobs)
    if mapping is not None:
        log.info("vocab mapping: %s", fmt.write_vocab(*mapping))
    summary = {"hidden_states": str(source.root), "samples": stats.total,
               "aux_layer_ids": source.config.get("aux_layer_ids"),
               "hidden_size": source.hidden, "vocab": str(args.vocab) if args.vocab else None,
               "store": store_of(source.config)}
    if isinstance(fmt, Speculators):
        line = shlex.join(fmt.train_command(None if mapping is None else mapping[0].numel()))
        log.info("train on it with: %s", line)
        summary["train_command"] = line
    return stats, summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", required=True, choices=FORMATS, help="the trainer's format")
    parser.add_argument("--hidden-states", type=Path, default=None,
                        help="a workers.extract output directory")
    parser.add_argument("--draft", type=Path, default=None,
                        help="--to speculators: a draft directory workers.train wrote "
                             "(OUT/train/draft), made ready for `speculators convert`")
    parser.add_argument("--target", type=Path, default=None,
                        help="with --draft: the target model directory (its embedding goes "
                             "into the draft; the convert line names it as the verifier)")
    parser.add_argument("--out", required=True, type=Path,
                        help="output directory (rerun with the same arguments to resume)")
    parser.add_argument("--vocab", type=Path, default=None,
                        help="d2t/t2d file from workers.vocab (or a draft checkpoint holding "
                             "them), written where the trainer reads its mapping")
    parser.add_argument("--workers", type=int, default=4,
                        help="samples converted at a time (default 4)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N samples")
    parser.add_argument("--fsync", action="store_true", help="fsync each file before rename")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.hidden_states is None and args.draft is None:
        parser.error("give --hidden-states (the features), --draft (a trained draft), or both")
    if args.draft is not None and args.to != "speculators":
        parser.error("--draft is for --to speculators; SGLang and SpecForge load the draft "
                     "workers.train wrote as it is")
    if args.draft is not None and args.target is None:
        parser.error("--draft needs --target (the target model directory)")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    ProgressReporter(None, "sample").update(0, force=True)  # alive before the first read
    try:
        stats = export(args)
    except ExportError as exc:
        fail(str(exc))
        return 2
    except DiskFull as exc:
        print(f"error: {exc}. Free space and rerun the same command to resume.",
              file=sys.stderr)
        return EXIT_DISK_FULL
    elapsed = time.monotonic() - stats.started
    log.info("done: %d written (%.2f GB, %.2f GB/s), %d already there", stats.written,
             stats.bytes_written / 1e9, stats.bytes_written / max(elapsed, 1e-9) / 1e9,
             stats.done_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
