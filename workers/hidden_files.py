"""The files of a hidden-state extraction: one safetensors file per sample under
`rows_<a>-<b>/`, written whole or not at all, and `manifest.jsonl` listing them.
Used by the extraction worker and its data-parallel ranks; the trainer takes the
torn-line repair for its own JSONL file."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.common import read_jsonl, write_json

SHARD_SIZE = 2000
"""Samples per sub-directory: no directory holds 100k entries."""

PRENORM_KEY = "hidden_state_prenorm"
"""[S, H]: the last decoder layer's output BEFORE the final norm, stored only by
`workers.extract --keep-prenorm-last` (+1/4 disk). `hidden_state` is the state after the
norm, which cannot be turned back into this one (RMSNorm divides out the scale)."""


def sample_path(out: Path, index: int) -> Path:
    start = index // SHARD_SIZE * SHARD_SIZE
    return out / f"rows_{start}-{start + SHARD_SIZE}" / f"{index:08d}.safetensors"


class DiskFull(Exception):
    """ENOSPC or EDQUOT while writing a sample; its temp file is already removed."""


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                      torch.int64: "I64", torch.uint8: "U8"}


def safetensors_parts(tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str]) -> list[memoryview]:
    """The safetensors file as a list of buffers: the header, then each tensor's bytes
    straight from its (CPU, contiguous) memory. Written with `write`, which releases the
    GIL, this avoids `safetensors.save`'s copy of every sample into one bytes object."""
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        flat = tensor.reshape(-1).view(torch.uint8)  # 1-D: len() of the view is its bytes
        parts.append(memoryview(flat.numpy()) if size else memoryview(b""))
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return [memoryview(len(encoded).to_bytes(8, "little") + encoded), *parts]


def write_atomically(path: Path, parts: Sequence[memoryview | bytes], *, fsync: bool) -> None:
    """Write to `.name.tmp` beside it, then rename: the final name only ever holds a
    whole file. On ENOSPC the temp file is removed and DiskFull raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb", buffering=0) as f:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:  # a raw write may be short
                    written = f.write(view)
                    view = view[written:]
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"disk full while writing {path}") from exc
        raise


def append_manifest(out: Path, entry: dict[str, Any]) -> None:
    with open(out / "manifest.jsonl", "a", encoding="utf-8") as f:
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


def existing_indexes(out: Path) -> set[int]:
    """Indexes whose file exists (a rank's view; the parent settled the manifest)."""
    found = set()
    for path in out.glob("rows_*/*.safetensors"):
        if not path.name.startswith("."):
            try:
                found.add(int(path.stem))
            except ValueError:
                continue
    return found


def restore_manifest(out: Path) -> set[int]:
    """Indexes whose file exists; manifest lines missing for existing files (a crash
    between rename and append) are added back."""
    listed: set[int] = set()
    manifest = out / "manifest.jsonl"
    truncate_torn_line(manifest)
    if manifest.exists():
        for _, entry in read_jsonl(manifest, required=("index",)):
            listed.add(int(entry["index"]))
    present = existing_indexes(out)
    for index in sorted(present - listed):
        path = sample_path(out, index)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            length = f.get_slice("input_ids").get_shape()[0]
            loss = int(f.get_tensor("loss_mask").sum())
        append_manifest(out, {"index": index, "id": meta.get("id", ""),
                              "file": str(path.relative_to(out)), "seq_len": length,
                              "bytes": path.stat().st_size, "loss_tokens": loss})
    return present


def merge_summaries(out: Path, world_size: int) -> None:
    """One extract_summary.json from the ranks' own: counts summed, lists joined."""
    merged: dict[str, Any] = {}
    for rank in range(world_size):
        path = out / ".ranks" / f"extract_summary.rank{rank}.json"
        if not path.exists():
            continue
        for key, value in json.loads(path.read_text()).items():
            if isinstance(value, list):
                merged[key] = sorted({*merged.get(key, []), *value}, key=str)
            else:
                merged[key] = merged.get(key, 0) + value
    if merged:
        write_json(out / "extract_summary.json", merged)
