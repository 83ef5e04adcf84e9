"""A remote job's readings, from the lines its shim appends to the attempt's
`observed.jsonl` (`runtime/publish.py`; the line is `observed.Observed`): the daemon cannot
read a compute node's /proc, NVML or (cheaply) its output files, so the observer turns
these lines into the `TreeReading` and `FileReading` it would have taken itself, and
samples, progress, forecasts and alerts follow unchanged.

`ShimFeed` reads the file incrementally (its inode and offset; across a rotation, the rest
of `observed.jsonl.1` first) and keeps the lines with a sequence number past the last one
seen. The first read, after a launch or a daemon restart, reads both files whole: the
backlog of a daemon that was away. `ShimFileSide` is a job's `FileSide` for such a job:
the output scan, the free space and the process tree come from the newest line, the
progress file and the log are read by the daemon as for a local job (they are small files
in the data dir, which the daemon and the node share anyway). Every new line but the
newest becomes a sample of its own, at its own time (the observer's `backlog`).

Times: a line's `t` is the node's wall clock; it is moved onto the daemon's clock by the
daemon's current offset between the two (`time.time() - now`), so a node whose clock is
off by a few seconds puts its samples off by as much. Staleness is not judged by those
times but by when a new line last arrived (`STALE_AFTER_INTERVALS`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from supervisor.formatting import iso
from supervisor.observe.readings import (
    FileReading,
    FileSide,
    ObservedJob,
    ScannerFactory,
    ShimReading,
)
from supervisor.runtime import files, observed
from supervisor.runtime.fileio import open_regular, read_at
from supervisor.runtime.gpu import GpuDevice
from supervisor.runtime.sampler import TreeGpuMemory, TreeReading
from supervisor.storage.tables import SampleRecord

log = logging.getLogger(__name__)

STALE_AFTER_INTERVALS = 5
"""A shim with no new line for this many of its intervals has gone silent (a node down,
a hung filesystem, a stopped shim): its figures are shown as stale, never as zeros."""
STALE_MIN_S = 5.0
"""... and for at least this many seconds (a filesystem's attribute cache may hold a
line back for a second or two)."""
READ_MAX_BYTES = 4 << 20
"""Most bytes read from the file in one reading; the rest waits for the next."""

NO_TREE = TreeReading(t=0.0, status=None, num_procs=0, num_threads=0, cpu_time_s=0.0,
                      cpu_percent=0.0, rss_bytes=0, read_bytes=0, write_bytes=0,
                      gpu_memory_bytes=None)
"""A remote job's process figures before its shim's first reading."""


def device_key(node: str, device: int | None) -> int | None:
    """The filesystem a node reports, as the observer groups jobs by for the disk runway:
    its device number on this machine, else a negative number derived from (node, device)
    (another node's device numbers say nothing here; jobs on two nodes writing to one
    shared filesystem therefore count as on two)."""
    if device is None or node == socket.gethostname():
        return device
    return -1 - zlib.crc32(f"{node}:{device}".encode())


def _tree(line: observed.Observed, t: float, cpu_percent: float) -> TreeReading:
    devices = None if line["gpu_devices"] is None else tuple(
        TreeGpuMemory(GpuDevice(index=d["index"], name=d["name"], uuid=d["uuid"],
                                used_bytes=d["used_bytes"], total_bytes=d["total_bytes"]),
                      d["memory_bytes"]) for d in line["gpu_devices"])
    fraction = None if devices is None else max(
        (d.device.used_bytes / d.device.total_bytes for d in devices
         if d.device.total_bytes), default=None)
    return TreeReading(
        t=t, status=line["status"], num_procs=line["num_procs"],
        num_threads=line["num_threads"], cpu_time_s=line["cpu_time_s"],
        cpu_percent=cpu_percent, rss_bytes=line["rss_bytes"], read_bytes=line["read_bytes"],
        write_bytes=line["write_bytes"], gpu_memory_bytes=line["gpu_memory_bytes"],
        gpu_memory_fraction=fraction, gpu_devices=devices)


def _complete_lines(path: Path, offset: int) -> tuple[list[bytes], int]:
    """Whole lines of `path` from `offset` (at most `READ_MAX_BYTES`), and the offset
    after them: a line still being written is left for the next read."""
    try:
        with open_regular(path) as (fd, size):
            if size < offset:  # not the file we were reading: from its start
                offset = 0
            data = read_at(fd, offset, min(READ_MAX_BYTES, size - offset))
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].splitlines(), offset + end


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class ShimFeed:
    """A job's `observed.jsonl`, read from where the last read stopped."""

    def __init__(self, attempt_dir: Path, clock: Callable[[], float] = time.time) -> None:
        """`clock`: the daemon's (`supervisor.clock.SteadyClock`), on which the lines'
        times are put."""
        self.clock = clock
        self.path = attempt_dir / files.OBSERVED
        self.rotated = attempt_dir / files.OBSERVED_ROTATED
        self._inode: int | None = None
        self._offset = 0
        self._read_before = False
        self.last_seq = 0
        self.newest: ShimReading | None = None
        self.newest_seen_at: float | None = None
        """When the newest line arrived, on the daemon's clock (the first read: the
        line's own time, which a silent node leaves in the past)."""
        self._cpu_mark: tuple[float, float] | None = None
        """(node time, CPU seconds) of the last line: a line's CPU % is since it."""

    def read(self, now: float) -> list[ShimReading]:
        """The lines new since the last read, oldest first."""
        # the node's clock (if it is ours) minus the daemon's, both read now: `now` is
        # the tick's start, and its age is no offset (it put every line that much early)
        offset_s = time.time() - self.clock()
        new: list[ShimReading] = []
        for raw in self._new_lines():
            line = observed.parse_observed(raw)
            if line is None or line["seq"] <= self.last_seq:
                continue
            self.last_seq = line["seq"]
            mark, self._cpu_mark = self._cpu_mark, (line["t"], line["cpu_time_s"])
            cpu_percent = 0.0
            if mark is not None and line["t"] > mark[0]:
                cpu_percent = max(0.0, (line["cpu_time_s"] - mark[1]) / (line["t"] - mark[0])
                                  * 100.0)
            t = line["t"] - offset_s
            new.append(ShimReading(
                t=t, seq=line["seq"], node=line["node"], interval_s=line["interval_s"],
                tree=_tree(line, t, cpu_percent), files=line["files"],
                bytes_written=line["bytes_written"], free_bytes=line["disk_free_bytes"],
                device=device_key(line["node"], line["disk_device"]), final=line["final"],
                error=line["error"]))
        if new:
            self.newest_seen_at = now if self.newest is not None else min(now, new[-1].t)
            self.newest = new[-1]
        return new

    def stale(self, now: float) -> str | None:
        """Why the newest figures are old, or None while the shim publishes."""
        newest, seen_at = self.newest, self.newest_seen_at
        if newest is None or seen_at is None or newest.final:
            return None
        limit_s = max(STALE_AFTER_INTERVALS * newest.interval_s, STALE_MIN_S)
        if now - seen_at <= limit_s:
            return None
        return (f"no reading from the shim on {newest.node} for over {limit_s:.0f} s "
                f"(its last at {iso(newest.t)}): these figures are its last")

    def _new_lines(self) -> list[bytes]:
        current = _inode(self.path)
        lines: list[bytes] = []
        if not self._read_before:  # a launch or a daemon restart: the whole backlog
            self._read_before = True
            lines += _complete_lines(self.rotated, 0)[0]
        elif self._inode is not None and current != self._inode:  # rotated meanwhile
            offset = self._offset if _inode(self.rotated) == self._inode else 0
            lines += _complete_lines(self.rotated, offset)[0]
            self._inode, self._offset = None, 0
        if current is not None:
            more, self._offset = _complete_lines(
                self.path, self._offset if current == self._inode else 0)
            self._inode = current
            lines += more
        return lines


def backlog_samples(job_id: str, readings: Sequence[ShimReading], *,
                    items_total: int | None, counted: bool) -> list[SampleRecord]:
    """A sample of each of a job's readings (those older than its newest), at its own
    time. `counted`: the job's items are its files; else their `items_done` is None (its
    progress file or log was not read then)."""
    return [SampleRecord(
        job_id=job_id, t=r.t, items_done=r.files if counted else None,
        items_total=items_total, files=r.files or 0, bytes_written=r.bytes_written or 0,
        cpu_percent=r.tree.cpu_percent, cpu_time_s=r.tree.cpu_time_s,
        rss_bytes=r.tree.rss_bytes, read_bytes=r.tree.read_bytes,
        write_bytes=r.tree.write_bytes, num_procs=r.tree.num_procs,
        num_threads=r.tree.num_threads, gpu_memory_bytes=r.tree.gpu_memory_bytes,
        disk_free_bytes=r.free_bytes) for r in readings]


class ShimFileSide(FileSide):
    """The `FileSide` of a remote job: its scan, free space and process tree from its
    shim's newest line, its progress file and log read here."""

    def __init__(self, jobs_dir: Path, make_scanner: ScannerFactory,
                 attempt_dir: Path, clock: Callable[[], float] = time.time) -> None:
        super().__init__(jobs_dir, make_scanner)
        self.feed = ShimFeed(attempt_dir, clock)

    def read(self, job: ObservedJob, now: float, *, final: bool = False) -> FileReading:
        """`final`: the job ended; its shim's final reading is the last line."""
        new = self.feed.read(now)
        newest = self.feed.newest
        reported, source = self.progress(job)
        if newest is None:
            return FileReading(now, 0, 0, bool(job.spec.output_dir), reported, source,
                               None, None, waiting=True,
                               stale="no reading from the job's shim yet")
        stale = self.feed.stale(now)
        if stale is None and newest.error is not None:
            stale = f"the shim's reading on {newest.node} failed in part: {newest.error}"
        return FileReading(
            now, newest.files or 0, newest.bytes_written or 0,
            bool(job.spec.output_dir) and newest.files is not None, reported, source,
            newest.free_bytes, newest.device, waiting=not newest.final, shim=tuple(new),
            stale=stale)
