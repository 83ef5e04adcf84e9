"""Small file helpers shared by the daemon and the shim (stdlib only: the shim imports it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON so readers see the old file or the whole new one, never a torn one:
    write a temp file beside it, fsync, rename over the target."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def create_json_exclusive(path: str | os.PathLike[str], data: Any) -> bool:
    """Create `path` holding `data` unless it exists; True if this call created it.
    The content is written to a temp file first and hard-linked into place, so the
    file is never seen empty or half-written, and of two racing callers one wins."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)  # also after a failed write (a full disk)
    return True


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The parsed file, or None when it is missing or not (yet) valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tail_lines(
    path: str | os.PathLike[str], n: int, *, block_size: int = 65536
) -> tuple[list[str], int]:
    """The last `n` lines of a text file, reading backwards from its end (a log can be
    GBs), and the byte offset they end at (where a follower continues)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, seek/read loop
    except OSError:
        return [], 0
    with f:
        f.seek(0, os.SEEK_END)
        end = size = f.tell()
        if n <= 0:
            return [], size
        blocks: list[bytes] = []
        newlines = 0
        while end > 0 and newlines <= n:  # each block read and counted once
            start = max(0, end - block_size)
            f.seek(start)
            block = f.read(end - start)
            blocks.append(block)
            newlines += block.count(b"\n")
            end = start
    data = b"".join(reversed(blocks))
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:], size


def read_from(path: str | os.PathLike[str], offset: int, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes from `offset`, and the offset after them. Stops at the last
    newline when there is one, so a follower never prints half a line twice."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except OSError:
        return b"", offset
    cut = data.rfind(b"\n")
    if 0 <= cut < len(data) - 1:
        data = data[: cut + 1]
    return data, offset + len(data)
