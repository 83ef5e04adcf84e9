"""Small file helpers shared by the daemon and the shim (stdlib only: the shim imports it).

Everything under a job's directory is the job's to replace: its progress file, its log
(a job finds it through /proc/self/fd/1), the attempt's JSON files. The readers here
(`open_regular`, `read_json`, `tail_lines`, `read_from`) therefore never block and never
read without bound: they refuse anything that is not a regular file (a FIFO would block
the reader for good, /dev/zero never ends) and cap every read in bytes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JSON_MAX_BYTES = 16 << 20
"""`read_json` treats a larger file as invalid. Pid and status files are tiny, but
launch.json and job.json hold a whole spec, env included, whose request may be up to
`max_body_bytes` (1 MiB by default; written with \\u escapes it can grow 3x). Callers
reading a file only a job writes pass a smaller cap (progress.PROGRESS_MAX_BYTES)."""
PRIVATE_MODE = 0o600
"""Mode of every file the supervisor side writes under a job's directory: job.json and
launch.json hold the job's env (an HF_TOKEN, say), which no other user of the machine
may read (docs/security.md)."""
TAIL_MAX_BYTES = 256 * 1024
"""`tail_lines` reads at most this much of a file's end, whatever `n` is."""
TAIL_LINE_MAX_BYTES = 4096
"""A line `tail_lines` returns keeps at most its last this many bytes, behind a marker."""

_OPEN_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
               | getattr(os, "O_NOCTTY", 0))
_READ_CHUNK = 1 << 20


class NotRegularFile(OSError):
    """The path names a FIFO, socket, device or directory, which is never read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(errno.EINVAL, "not a regular file", os.fspath(path))


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str]) -> Iterator[tuple[int, int]]:
    """A read-only descriptor of `path` and its size then, if it is a regular file
    (a symlink to one is fine); NotRegularFile otherwise, OSError if it cannot be opened.

    The path is stat'ed first, so a FIFO or device is normally not even opened; since it
    can be swapped between that and the open, the open is non-blocking (a FIFO opens at
    once) and the descriptor is fstat'ed again. Read it with `read_at` up to the size
    given: a file that grows meanwhile (or a /proc file of size 0 that never ends) is
    not read past it."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NotRegularFile(path)
    fd = os.open(path, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path)
        yield fd, info.st_size
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, length: int) -> bytes:
    """Up to `length` bytes from `offset` (fewer at the end of the file)."""
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, min(length, _READ_CHUNK), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def temp_path(target: Path) -> Path:
    """Where a whole new `target` is written before it takes the name: beside it (the
    rename stays on one filesystem), hidden and ending `.tmp` (never an output item,
    `outputs.TEMP_SUFFIXES`), with the writer's pid (two processes never share
    one). The workers' `workers.common.replace_file` follows the same rule."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _temp_file(target: Path, data: bytes, *, fsync: bool) -> Path:
    """`data` in `temp_path(target)` (mode `PRIVATE_MODE`), on disk when `fsync`; on
    failure (a full disk) no temp file is left behind."""
    tmp = temp_path(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_MODE)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_file(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """The supervisor side's one atomic write: readers see the old file or the whole
    new one, never a torn one. `data` goes to a temp file beside `path` (`temp_path`),
    then is renamed over it; no temp file is left behind, whatever fails.

    With `fsync` (the default, and what every caller uses) the temp file's data is on
    disk before the rename, so after a crash or power loss the name holds the old file
    or the whole new one, never an empty one. The directory is not fsynced: after a
    power loss the rename itself may be undone (the old file, or none, is back), which
    every reader of these files already handles as "not written yet"."""
    target = Path(path)
    tmp = _temp_file(target, data, fsync=fsync)
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # gone once renamed; else no temp file is left


def atomic_write_json(path: str | os.PathLike[str], data: Any, *, fsync: bool = True) -> None:
    """`data` as JSON through `replace_file` (fsync before the rename by default)."""
    replace_file(path, json.dumps(data).encode("utf-8"), fsync=fsync)


def create_json_exclusive(path: str | os.PathLike[str], data: Any) -> bool:
    """Create `path` holding `data` unless it exists; True if this call created it.
    The content is written to a temp file first (`temp_path`, always fsynced) and
    hard-linked into place, so the file is never seen empty or half-written, and of two
    racing callers one wins."""
    target = Path(path)
    tmp = _temp_file(target, json.dumps(data).encode("utf-8"), fsync=True)
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)  # also after a failed write (a full disk)
    return True


def read_json(path: str | os.PathLike[str], *, max_bytes: int = JSON_MAX_BYTES) -> Any | None:
    """The parsed file, or None when it is missing, not a regular file, larger than
    `max_bytes`, or not (yet) valid JSON."""
    try:
        with open_regular(path) as (fd, size):
            if size > max_bytes:
                return None
            data = read_at(fd, 0, size)
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: [[[[... nested deep
        return None


def tail_lines(
    path: str | os.PathLike[str], n: int, *, max_bytes: int = TAIL_MAX_BYTES,
    max_line: int = TAIL_LINE_MAX_BYTES, block_size: int = 65536,
) -> tuple[list[str], int]:
    """The last `n` lines of a text file and the byte offset they end at (where a
    follower continues), reading backwards from its end (a log can be GBs) and never
    more than `max_bytes` of it, so fewer than `n` lines may come back.

    Lines end at `\\n`. Within a line, `\\r` redraws (tqdm's progress bars) count as one
    line, its last visible redraw. A line longer than `max_line` bytes keeps its end,
    behind `…[cut N bytes]`; a line that began before the bytes read is marked
    `…[cut N+ bytes]` (N bytes of it, and perhaps more, are not shown)."""
    try:
        with open_regular(path) as (fd, size):
            if n <= 0:
                return [], size
            floor = max(0, size - max_bytes)
            end = size
            blocks: list[bytes] = []
            newlines = 0
            while end > floor and newlines <= n:  # each block read and counted once
                start = max(floor, end - block_size)
                block = read_at(fd, start, end - start)
                blocks.append(block)
                newlines += block.count(b"\n")
                end = start
            # Is the first line (or redraw) whole? Only if the byte before the window
            # ends one; if not, that byte is part of it: at least one more is cut.
            cut_first = end > 0 and read_at(fd, end - 1, 1) not in (b"\n", b"\r")
    except OSError:
        return [], 0
    lines = b"".join(reversed(blocks)).split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the file ends with a newline (or is empty)
    first_kept = max(0, len(lines) - n)
    return ([_clean_line(line, cut=cut_first and i == 0, max_line=max_line)
             for i, line in enumerate(lines[first_kept:], start=first_kept)], size)


def _clean_line(line: bytes, *, cut: bool, max_line: int) -> str:
    """One line for display: its last visible `\\r` redraw, at most `max_line` bytes."""
    if b"\r" in line:
        redraws = line.split(b"\r")
        shown = next((i for i in range(len(redraws) - 1, -1, -1) if redraws[i].strip()),
                     len(redraws) - 1)
        cut = cut and shown == 0  # a redraw after a \r starts whole
        line = redraws[shown]
    dropped = max(0, len(line) - max_line)
    if dropped or cut:
        kept = line[dropped:]
        skip = 0
        while skip < min(3, len(kept)) and kept[skip] & 0xC0 == 0x80:
            skip += 1  # do not start inside a UTF-8 character
        text = kept[skip:].decode("utf-8", errors="replace")
        if cut:
            return f"…[cut {dropped + skip + 1}+ bytes]{text}"
        return f"…[cut {dropped + skip} bytes]{text}"
    return line.decode("utf-8", errors="replace")


def read_from(path: str | os.PathLike[str], offset: int, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes from `offset`, and the offset after them. Stops at the last
    newline when there is one, so a follower never prints half a line twice."""
    try:
        with open_regular(path) as (fd, size):
            data = read_at(fd, offset, min(limit, size - offset)) if offset < size else b""
    except OSError:
        return b"", offset
    cut = data.rfind(b"\n")
    if 0 <= cut < len(data) - 1:
        data = data[: cut + 1]
    return data, offset + len(data)
