"""The files of a hidden-state extraction: one safetensors file per sample under
`rows_<a>-<b>/`, written whole or not at all, and `manifest.jsonl` listing them; how
each file goes to the disk (fsync, sync_file_range, or the kernel's choice) and what a
crash can leave behind in each case is `Writeback`'s. Used by the extraction worker
and its data-parallel ranks; the trainer takes the torn-line repair for its own JSONL
file.

Ranks never append to `manifest.jsonl`: each has its own (`.ranks/manifest.rankR.jsonl`),
folded into `manifest.jsonl` by `restore_manifest` once no rank runs (the parent of the
ranks, before and after them; with several tasks, the task of rank 0 after every rank
finished). Appends from several nodes to one file are not safe on NFS (O_APPEND is
emulated by each client: two nodes' lines can overwrite each other), one writer per
file is; and a consumer keeps reading one whole `manifest.jsonl`. The fold rewrites it
(temp file, rename), so a crash leaves the old manifest or the new one. Each rank's
summary (`.ranks/extract_summary.rankR.json`) names its world size and launch (`run`):
`ranks_finished` tells this launch's finished ranks from an earlier attempt's."""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from workers.common import read_jsonl, replace_file, write_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHARD_SIZE = 2000
"""Samples per sub-directory: no directory holds 100k entries."""

RANKS_DIR = ".ranks"
"""The ranks' own files in the output tree: manifests, summaries, progress."""

SUMMARY_KEYS = ("rank", "world_size", "run")
"""A rank's summary's identity: not summed by `merge_summaries`."""

PRENORM_KEY = "hidden_state_prenorm"
"""[S, H]: the last decoder layer's output BEFORE the final norm, stored only by
`workers.extract --keep-prenorm-last` (+1/4 disk). `hidden_state` is the state after the
norm, which cannot be turned back into this one (RMSNorm divides out the scale)."""


def sample_path(out: Path, index: int) -> Path:
    start = index // SHARD_SIZE * SHARD_SIZE
    return out / f"rows_{start}-{start + SHARD_SIZE}" / f"{index:08d}.safetensors"


class DiskFull(Exception):
    """ENOSPC or EDQUOT while writing a sample, or writing it back: its temp file, or
    the file whose writeback failed, is already removed."""


@functools.cache
def safetensors_dtypes() -> dict[torch.dtype, str]:
    """The safetensors name of each dtype a sample file holds. A function, not a constant:
    importing this module does not import torch (the parent of the ranks reads the
    manifests without it; only a resume that rebuilds lost manifest lines loads it,
    through safetensors)."""
    import torch

    from workers.eagle3.extraction.fp8_features import SAFETENSORS_FP8

    return {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
            torch.int64: "I64", torch.uint8: "U8", torch.float8_e4m3fn: SAFETENSORS_FP8}


def safetensors_parts(tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str]) -> list[memoryview]:
    """The safetensors file as a list of buffers: the header, then each tensor's bytes
    straight from its (CPU, contiguous) memory. Written with `write`, which releases the
    GIL, this avoids `safetensors.save`'s copy of every sample into one bytes object."""
    import torch

    dtypes = safetensors_dtypes()
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtypes[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        flat = tensor.reshape(-1).view(torch.uint8)  # 1-D: len() of the view is its bytes
        parts.append(memoryview(flat.numpy()) if size else memoryview(b""))
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return [memoryview(len(encoded).to_bytes(8, "little") + encoded), *parts]


WRITEBACK_MODES = ("fsync", "range", "none")
"""How a written sample file is handed to the disk (`Writeback`); `--writeback`."""

DEFAULT_WRITEBACK = "fsync"
"""Steady writeback: on an H200 the worker ran at 99.2 % of HF's own prefill of a
61-layer MoE with per-file fsync, 99.2 % with "range" and 79.7 % with "none"
(docs/benchmarks.md); fsync is the one that also keeps every final name whole across a
power loss. bench/writeback.py compares the modes on the machine at hand."""

_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


@functools.cache
def _libc_sync_file_range() -> Callable[..., int] | None:
    """glibc's sync_file_range (Linux), or None where there is none: logged once."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        log.warning("sync_file_range is not available here: --writeback range falls back "
                    "to fsync")
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def sync_file_range(fd: int, flags: int) -> None:
    """sync_file_range(2) over the whole file (ctypes releases the GIL meanwhile);
    OSError on failure."""
    function = _libc_sync_file_range()
    assert function is not None, "Writeback checks availability first"
    if function(fd, 0, 0, flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def drop_cached_pages(fd: int) -> None:
    """Evict the file's clean pages from the page cache (dirty or in-flight ones stay)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Writeback:
    """How `write_atomically` hands each written file to the disk; one per run, shared
    by its writer threads, `close()`d at the end (it may hold files still in flight).

    - "fsync": fsync before the rename, then drop the file's pages from the page cache.
      A crash (of the process or the machine) leaves each final name whole or absent.
    - "range": start the file's writeback (sync_file_range WRITE) before the rename and
      return at once; once more than `in_flight_files` files are started, the oldest is
      waited for (WAIT_BEFORE|WRITE|WAIT_AFTER) and its pages dropped. A writer never
      waits for the file it just wrote, and the data dirty or under writeback stays
      bounded to about (`in_flight_files` + writer threads) files. Not a durability guarantee (no
      metadata, no disk-cache flush): after a power loss a final name may hold a short
      file, which `existing_indexes` does not count, so a resume writes it again.
      Where sync_file_range is missing (not Linux), "fsync" instead, with a warning.
    - "none": nothing; the kernel writes back when its dirty limits say so. A process
      crash still leaves whole files (temp + rename); a power loss may leave short ones.

    Errors of the writeback (ENOSPC, EDQUOT) are DiskFull, as those of the write."""

    def __init__(self, mode: str, *, in_flight_files: int = 4):
        if mode not in WRITEBACK_MODES:
            raise ValueError(f"writeback mode {mode!r} is not one of {WRITEBACK_MODES}")
        if in_flight_files < 1:
            raise ValueError("in_flight_files must be >= 1")
        self.mode = "fsync" if mode == "range" and _libc_sync_file_range() is None else mode
        self.in_flight_files = in_flight_files
        self._lock = threading.Lock()
        self._in_flight: deque[tuple[int, Path]] = deque()  # (fd, final path), oldest first

    def before_rename(self, fd: int) -> None:
        """The temp file's last byte is written."""
        if self.mode == "fsync":
            os.fsync(fd)
            drop_cached_pages(fd)
        elif self.mode == "range":
            sync_file_range(fd, _SYNC_FILE_RANGE_WRITE)

    def after_rename(self, fd: int, path: Path) -> None:
        """Takes `fd` (now `path`): closes it, or in "range" keeps it until its
        writeback is waited for, which finishes the oldest files over the bound."""
        if self.mode != "range":
            os.close(fd)
            return
        with self._lock:
            self._in_flight.append((fd, path))
            over = [self._in_flight.popleft()
                    for _ in range(len(self._in_flight) - self.in_flight_files)]
        self._finish(over)

    def close(self) -> None:
        """Waits for the files still in flight and drops their pages."""
        with self._lock:
            pending, self._in_flight = list(self._in_flight), deque()
        self._finish(pending)

    @staticmethod
    def _finish(files: list[tuple[int, Path]]) -> None:
        """Wait for each file's writeback, drop its pages, close it. A file whose
        writeback failed is removed (a resume writes it again); the first error is
        raised once every file is closed."""
        failed: tuple[OSError, Path] | None = None
        for fd, path in files:
            try:
                sync_file_range(fd, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE
                                | _SYNC_FILE_RANGE_WAIT_AFTER)
                drop_cached_pages(fd)
            except OSError as exc:
                path.unlink(missing_ok=True)
                failed = failed or (exc, path)
            finally:
                os.close(fd)
        if failed is not None:
            error, path = failed
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"disk full while writing back {path}") from error
            raise error


def write_atomically(path: Path, parts: Sequence[memoryview | bytes], *,
                     writeback: Writeback) -> None:
    """Write to `.name.tmp` beside it, hand it to `writeback`, then rename: the final
    name only ever holds a whole file (after a power loss, only with "fsync"; see
    Writeback). On ENOSPC the temp file is removed and DiskFull raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:  # a write may be short
                    view = view[os.write(fd, view):]
            writeback.before_rename(fd)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            raise
        writeback.after_rename(fd, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"disk full while writing {path}") from exc
        raise


def rank_manifest(out: Path, rank: int) -> Path:
    """Rank `rank`'s own manifest, which only it appends to."""
    return out / RANKS_DIR / f"manifest.rank{rank}.jsonl"


def rank_summary(out: Path, rank: int) -> Path:
    return out / RANKS_DIR / f"extract_summary.rank{rank}.json"


def append_manifest(manifest: Path, entry: dict[str, Any]) -> None:
    with open(manifest, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def truncate_torn_line(path: Path) -> None:
    """Drop a last line without its newline (a kill in the middle of an append), so
    the next append starts a line of its own."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def is_whole(path: Path) -> bool:
    """The file is as long as its safetensors header says: not cut short, as a power
    loss can leave a file written without fsync (its rename on disk, its data not)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header_bytes = int.from_bytes(f.read(8), "little")
            if 8 + header_bytes > size:
                return False
            header = json.loads(f.read(header_bytes))
            data_bytes = max((int(v["data_offsets"][1]) for k, v in header.items()
                              if k != "__metadata__"), default=0)
            return size == 8 + header_bytes + data_bytes
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False


def existing_indexes(out: Path, shard: tuple[int, int] | None = None) -> set[int]:
    """Indexes whose file exists whole; with `shard` (rank, world size), only that
    rank's (index % world == rank): the others' files are not opened. A short file is
    not counted: the resume writes it again, renamed over it; a missing one (a rename
    lost in a crash) is written again too."""
    found = set()
    for path in out.glob("rows_*/*.safetensors"):
        if not path.name.startswith("."):
            try:
                index = int(path.stem)
            except ValueError:
                continue
            if shard is not None and index % shard[1] != shard[0]:
                continue
            if is_whole(path):
                found.add(index)
            else:
                log.warning("%s is cut short (a crash before its data reached the disk); "
                            "it is written again", path)
    return found


def restore_manifest(out: Path) -> set[int]:
    """Indexes whose file exists. Settles `manifest.jsonl` while no rank runs: the
    ranks' own manifests are folded into it (and removed), and lines missing for
    existing files (a crash between rename and append) are added back; one line per
    index (the newest), in index order when it is rewritten."""
    manifest = out / "manifest.jsonl"
    rank_files = sorted((out / RANKS_DIR).glob("manifest.rank*.jsonl"))
    entries: dict[int, dict[str, Any]] = {}
    for path in (manifest, *rank_files):
        truncate_torn_line(path)
        if path.exists():
            for _, entry in read_jsonl(path, required=("index",)):
                entries[int(entry["index"])] = entry
    present = existing_indexes(out)
    missing = sorted(present - entries.keys())
    if not missing and not rank_files:
        return present
    for index in missing:
        path = sample_path(out, index)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            length = f.get_slice("input_ids").get_shape()[0]
            loss = int(f.get_tensor("loss_mask").sum())
        entries[index] = {"index": index, "id": meta.get("id", ""),
                          "file": str(path.relative_to(out)), "seq_len": length,
                          "bytes": path.stat().st_size, "loss_tokens": loss}
    lines = "".join(json.dumps(entries[index]) + "\n" for index in sorted(entries))
    replace_file(manifest, lines.encode("utf-8"), fsync=True)
    for path in rank_files:  # folded: a crash before this folds them again, no harm
        path.unlink(missing_ok=True)
    if rank_files:
        log.info("manifest: %d samples, %d ranks' manifests folded in", len(entries),
                 len(rank_files))
    return present


def ranks_finished(out: Path, world_size: int, run: str) -> bool:
    """Every rank of `world_size` wrote its summary in launch `run` (an earlier
    attempt's summaries do not count). ValueError where one of this launch counts
    another world size: the tasks disagree on their local ranks, so the shards would
    not cover the samples."""
    for rank in range(world_size):
        try:
            summary = json.loads(rank_summary(out, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if not isinstance(summary, dict) or summary.get("run") != run:
            return False
        if summary.get("world_size") != world_size:
            raise ValueError(
                f"rank {rank} ran as one of {summary.get('world_size')} ranks, this task "
                f"as one of {world_size}: every task must start the same number of local "
                "ranks (give --gpus N, not all, where nodes differ)")
    return True


def merge_summaries(out: Path, world_size: int) -> None:
    """One extract_summary.json from the ranks' own: counts summed, lists joined."""
    merged: dict[str, Any] = {}
    for rank in range(world_size):
        path = rank_summary(out, rank)
        if not path.exists():
            continue
        for key, value in json.loads(path.read_text()).items():
            if key in SUMMARY_KEYS:
                continue
            if isinstance(value, list):
                merged[key] = sorted({*merged.get(key, []), *value}, key=str)
            else:
                merged[key] = merged.get(key, 0) + value
    if merged:
        write_json(out / "extract_summary.json", merged)
