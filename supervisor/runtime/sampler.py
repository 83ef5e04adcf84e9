"""One reading per job per tick: process tree, GPU memory, output files, progress.

The process part is one pass over /proc for all jobs (a ppid map built once per tick),
not one `children(recursive=True)` walk per job, which re-reads every /proc/*/stat for
each job; and the pass skips the processes it found to be no job's (`ProcessScan`).
Readings are frozen snapshots; a process that vanishes mid-read is skipped, and a
missing GPU gives None, never an exception.
"""

from __future__ import annotations

import os
import resource
import time
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from supervisor.runtime.gpu import GpuDevice, GpuReader
from supervisor.runtime.procfs import (
    CLOCK_TICKS,
    PAGE_SIZE,
    ProcStat,
    all_stats,
    is_started_at,
    parse_stat,
    read_small,
    read_stat,
)

STATUS_NAMES = {"R": "running", "S": "sleeping", "D": "disk-sleep", "Z": "zombie",
                "T": "stopped", "t": "tracing-stop", "X": "dead", "I": "idle",
                "P": "parked", "W": "waking", "K": "wakekill"}


@dataclass
class ProcessTable:
    """Every process of the machine at one moment, with a children map."""

    procs: dict[int, ProcStat] = field(default_factory=dict)
    children: dict[int, list[int]] = field(default_factory=dict)
    _trees: dict[int, list[ProcStat]] = field(default_factory=dict, repr=False,
                                              compare=False)
    """`tree` answers, kept: the pass asks for each root's tree twice (`ProcessScan`);
    `add`, the table's only writer, clears them."""

    @classmethod
    def read(cls, proc_root: str = "/proc") -> ProcessTable:
        table = cls()
        for stat in all_stats(proc_root):  # one listing; a process gone meanwhile skipped
            table.add(stat)
        return table

    def add(self, stat: ProcStat) -> None:
        self._trees.clear()
        self.procs[stat.pid] = stat
        self.children.setdefault(stat.ppid, []).append(stat.pid)

    def tree(self, root: int) -> list[ProcStat]:
        """`root` and all its descendants present in the table."""
        if root in self._trees:
            return self._trees[root]
        if root not in self.procs:
            return []
        out: list[ProcStat] = []
        stack = [root]
        while stack:
            pid = stack.pop()
            stat = self.procs.get(pid)
            if stat is None:
                continue
            out.append(stat)
            stack.extend(self.children.get(pid, ()))
        self._trees[root] = out
        return out


NO_INODE = 1
"""The inode /proc's listing gives an entry it could not instantiate: no identity."""

JUST_READ_S = 0.5
"""How old a stat `ProcessScan.current_stat` read may be for the next pass to take it."""

KEEP_OPEN_MAX = 4096
"""Most processes whose /proc files a `ProcessScan` keeps open (8,192 descriptors)."""


class ProcessScan:
    """The process table tick after tick, without re-reading the strangers: processes
    found last time in no job's tree. A process never joins a tree it was not born in
    (an orphan goes to its nearest subreaper ancestor: the shim, or init), so a stranger
    stays one for life. Its life is told by the inode of its /proc entry in the listing:
    each process gets a new one, so a pid reused by a new process is read again. Only
    the roots asked for count: when a root is a stranger (a job's shim read before its
    job was known), the whole table is read again. On a machine with more processes
    than its jobs have (a shared node), most of the pass's reads are spared."""

    def __init__(self, proc_root: str = "/proc", *, keep_open: int | None = None) -> None:
        """`keep_open`: most processes whose /proc files stay open (`_ProcFiles`);
        default a sixteenth of the soft limit on open files (two files each: an eighth
        of the descriptors), at most KEEP_OPEN_MAX."""
        self.proc_root = proc_root
        self._strangers: dict[int, int] = {}  # pid -> inode of /proc/<pid>
        self.reads = 0  # /proc/<pid>/stat reads in the last pass (tests, benchmarks)
        self._open: dict[int, _ProcFiles] = {}
        self._members: set[int] = set()  # the roots' trees of the last pass
        self.keep_open = (keep_open if keep_open is not None else min(
            KEEP_OPEN_MAX, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 16))
        self._just_read: dict[int, tuple[float, ProcStat]] = {}
        """Stats `current_stat` read from kept files since the last pass, with when
        (`time.monotonic()`): the tick checks each job's shim just before its pass, which
        takes them instead of reading them again (#30: 1,000 shims, 1,000 reads a
        tick); at most JUST_READ_S old."""
        # a scan dropped without `close` (a test, a shim's publisher) closes its files
        weakref.finalize(self, _close_all, self._open)

    def read(self, roots: Collection[int]) -> ProcessTable:
        with os.scandir(self.proc_root) as entries:
            listing = {int(entry.name): entry.inode() for entry in entries
                       if entry.name.isdigit()}
        strangers = self._strangers
        if any(strangers.get(root, NO_INODE) == listing.get(root) for root in roots):
            strangers = {}
        table = ProcessTable()
        skipped: dict[int, int] = {}
        kept = self._open
        just_read, self._just_read = self._just_read, {}
        fresh_since = time.monotonic() - JUST_READ_S
        for pid, inode in listing.items():
            if inode != NO_INODE and strangers.get(pid) == inode:
                skipped[pid] = inode
                continue
            files = kept.get(pid)
            if files is not None and files.inode == inode:
                read_at, stat = just_read.get(pid, (0.0, None))
                if stat is None or read_at < fresh_since:
                    stat = files.stat(pid)
            else:
                stat = read_stat(pid, self.proc_root)
            if stat is not None:
                table.add(stat)
        self.reads = len(table.procs)
        members = {stat.pid for root in roots for stat in table.tree(root)}
        verdicts: dict[int, bool] = {}
        skipped.update((pid, listing[pid]) for pid in table.procs
                       if pid not in members and listing[pid] != NO_INODE
                       and self._stranger(pid, table, skipped, verdicts))
        self._strangers = skipped
        self._keep(members, listing)
        return table

    @property
    def kept(self) -> set[int]:
        """The pids whose /proc files are kept open."""
        return set(self._open)

    def current_stat(self, pid: int) -> ProcStat | None:
        """The process's stat now, from its kept file if any (it names the very process
        the pass found: reaped, it reads None, even with its pid reused), else read."""
        files = self._open.get(pid)
        if files is not None:
            stat = files.stat(pid)
            if stat is not None:
                self._just_read[pid] = (time.monotonic(), stat)
            return stat
        return read_stat(pid, self.proc_root)

    def io_bytes(self, pid: int) -> tuple[int, int] | None:
        """`read_io_bytes` of a process of the last pass, from its kept file if any."""
        files = self._open.get(pid)
        if files is not None and files.io_fd >= 0:
            return files.io_bytes()
        return read_io_bytes(pid, self.proc_root)  # (an io file that would not open is
        # tried again each pass, as one never kept: not ours at that moment, no fd left)

    def close(self) -> None:
        _close_all(self._open)
        self._members = set()
        self._just_read = {}

    def _keep(self, members: set[int], listing: dict[int, int]) -> None:
        """Keep open the /proc files of the processes in the roots' trees two passes in
        a row (a job's shim and worker: not each short-lived child), so the next passes
        re-read them with one `pread` each instead of an open, a read and a close (#15);
        close those of processes gone, reused (a new inode) or out of every tree."""
        kept = self._open
        for pid in [pid for pid, files in kept.items()
                    if pid not in members or listing.get(pid) != files.inode]:
            kept.pop(pid).close()
        for pid in members & self._members:
            if len(kept) >= self.keep_open:
                break
            if pid not in kept and listing.get(pid, NO_INODE) != NO_INODE:
                files = _ProcFiles.open(self.proc_root, pid, listing[pid])
                if files is not None:
                    kept[pid] = files
        self._members = members

    @staticmethod
    def _stranger(pid: int, table: ProcessTable, strangers: dict[int, int],
                  verdicts: dict[int, bool]) -> bool:
        """`pid` (in no root's tree) is known to be in none: each of its ancestors up to
        pid 0 was read this pass or is a stranger already. A gap (a parent that exited
        before its read, its child since moved to a job's shim, the subreaper) leaves it
        to be read again next pass."""
        chain: list[int] = []
        current, verdict = pid, False
        while True:
            if current == 0 or current in strangers:
                verdict = True
                break
            if current in verdicts:
                verdict = verdicts[current]
                break
            stat = table.procs.get(current)
            if stat is None or current in chain:  # a gap (or a loop: never trusted)
                break
            chain.append(current)
            current = stat.ppid
        for walked in chain:
            verdicts[walked] = verdict
        return verdict


def _close_all(kept: dict[int, _ProcFiles]) -> None:
    for files in kept.values():
        files.close()
    kept.clear()


class _ProcFiles:
    """A process's /proc/<pid>/stat and io, kept open: re-read with `pread`, about half
    the CPU of opening, reading and closing them (the file stays the process's: once it
    is reaped, a read fails with ESRCH, even if its pid is reused)."""

    __slots__ = ("inode", "stat_fd", "io_fd")

    def __init__(self, inode: int, stat_fd: int, io_fd: int) -> None:
        self.inode, self.stat_fd, self.io_fd = inode, stat_fd, io_fd

    @classmethod
    def open(cls, proc_root: str, pid: int, inode: int) -> _ProcFiles | None:
        try:
            stat_fd = os.open(f"{proc_root}/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            io_fd = os.open(f"{proc_root}/{pid}/io", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # not ours to read: its io figures are not had either way
            io_fd = -1
        return cls(inode, stat_fd, io_fd)

    def stat(self, pid: int) -> ProcStat | None:
        try:
            return parse_stat(os.pread(self.stat_fd, 4096, 0), pid)
        except OSError:  # reaped
            return None

    def io_bytes(self) -> tuple[int, int] | None:
        if self.io_fd < 0:
            return None
        try:
            return _io_bytes(os.pread(self.io_fd, 4096, 0))
        except OSError:
            return None

    def close(self) -> None:
        os.close(self.stat_fd)
        if self.io_fd >= 0:
            os.close(self.io_fd)


def read_io_bytes(pid: int, proc_root: str = "/proc") -> tuple[int, int] | None:
    """(read_bytes, write_bytes) that hit the storage layer, from /proc/<pid>/io."""
    try:
        data = read_small(f"{proc_root}/{pid}/io")
    except OSError:  # gone, or not ours to read
        return None
    return _io_bytes(data)


def _io_bytes(data: bytes) -> tuple[int, int]:
    fields = data.split()  # "name: value" pairs, one a line: a third of a line loop's CPU
    return _io_field(fields, b"read_bytes:"), _io_field(fields, b"write_bytes:")


def _io_field(fields: list[bytes], name: bytes) -> int:
    """The value after `name` (a whole token: not `cancelled_write_bytes:`), 0 if none."""
    try:
        return int(fields[fields.index(name) + 1])
    except (ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class TreeTarget:
    """What to sample for one job: the root of its tree (the shim, or the worker when
    the shim is gone) and the worker whose state is the job's process state."""

    job_id: str
    root_pid: int
    root_create_time: float | None
    """With `root_start_ticks` and `root_boot_id`, the root's identity; it and the start
    ticks None: whatever holds the pid."""
    worker_pid: int | None
    root_start_ticks: int | None = None
    root_boot_id: str | None = None


@dataclass(frozen=True)
class TreeGpuMemory:
    """The tree's memory on one GPU, beside that GPU's own figures of the same pass."""

    device: GpuDevice
    memory_bytes: int
    """Summed over the tree's live processes on this device."""


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class TreeReading:
    t: float
    status: str | None
    """State of the worker process (running, sleeping, disk-sleep, zombie, ...)."""
    num_procs: int
    num_threads: int
    cpu_time_s: float
    """Cumulative CPU seconds of the tree, including its reaped children."""
    cpu_percent: float
    """Over the last interval; 100 = one core busy."""
    rss_bytes: int
    read_bytes: int
    write_bytes: int
    gpu_memory_bytes: int | None
    gpu_memory_fraction: float | None = None
    """How full (0..1) the fullest GPU the tree uses is; None without NVML."""
    gpu_devices: tuple[TreeGpuMemory, ...] | None = None
    """Per GPU the tree uses, by NVML index; () for a tree on no GPU, None without NVML."""


@dataclass
class _CpuMark:
    t: float
    cpu_time_s: float


class Sampler:
    """Samples many jobs' process trees with one pass over /proc; keeps each job's
    previous CPU time to turn cumulative ticks into a CPU %."""

    def __init__(self, gpu: GpuReader | None = None, proc_root: str = "/proc"):
        self.gpu = gpu if gpu is not None else GpuReader()
        self.proc_root = proc_root
        self.processes = ProcessScan(proc_root)
        self._cpu_marks: dict[str, _CpuMark] = {}

    def sample(self, targets: Sequence[TreeTarget], now: float) -> dict[str, TreeReading]:
        if not targets:
            if self.processes.kept:  # the last jobs ended: their files go
                self.processes.close()
            return {}
        table = self.processes.read([target.root_pid for target in targets])
        gpu_by_pid = self.gpu.memory_by_pid(now)
        readings = {}
        for target in targets:
            readings[target.job_id] = self._reading(target, table, gpu_by_pid, now)
        return readings

    def forget(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            self._cpu_marks.pop(job_id, None)

    def close(self) -> None:
        """The /proc files kept open go (`ProcessScan.close`)."""
        self.processes.close()

    def _reading(self, target: TreeTarget, table: ProcessTable,
                 gpu_by_pid: dict[int, int] | None, now: float) -> TreeReading:
        root = table.procs.get(target.root_pid)
        same_root = root is not None and (
            (target.root_start_ticks is None and target.root_create_time is None)
            or is_started_at(root, target.root_start_ticks, target.root_create_time,
                             target.root_boot_id))
        procs = table.tree(target.root_pid) if same_root else []
        live: list[ProcStat] = []
        cpu_ticks = read_bytes = write_bytes = num_threads = rss_pages = 0
        for proc in procs:  # one loop: a tick runs it for every process of every job
            cpu_ticks += proc.cpu_ticks
            if proc.state in ("Z", "X"):
                continue
            live.append(proc)
            num_threads += proc.num_threads
            rss_pages += proc.rss_pages
            io = self.processes.io_bytes(proc.pid)
            if io is not None:
                read_bytes += io[0]
                write_bytes += io[1]
        cpu_time_s = cpu_ticks / CLOCK_TICKS
        worker = table.procs.get(target.worker_pid) if target.worker_pid else None
        if worker is None or worker not in procs:
            worker = root if same_root else None
        gpu = gpu_fraction = gpu_devices = None
        if gpu_by_pid is not None:
            gpu = sum(gpu_by_pid.get(p.pid, 0) for p in live)
            fractions = [self.gpu.fraction_by_pid[p.pid] for p in live
                         if p.pid in self.gpu.fraction_by_pid]
            gpu_fraction = max(fractions, default=None)
            gpu_devices = self._gpu_devices(live)
        return TreeReading(
            t=now, status=STATUS_NAMES.get(worker.state, worker.state) if worker else None,
            num_procs=len(live), num_threads=num_threads,
            cpu_time_s=cpu_time_s, cpu_percent=self._cpu_percent(target.job_id, now, cpu_time_s),
            rss_bytes=rss_pages * PAGE_SIZE,
            read_bytes=read_bytes, write_bytes=write_bytes, gpu_memory_bytes=gpu,
            gpu_memory_fraction=gpu_fraction, gpu_devices=gpu_devices,
        )

    def _gpu_devices(self, live: Sequence[ProcStat]) -> tuple[TreeGpuMemory, ...]:
        """The tree's memory per device: a job with one process per GPU, or one process
        whose model is split over GPUs, is one job on several devices."""
        by_index: dict[int, int] = {}
        for proc in live:
            for index, memory in self.gpu.device_memory_by_pid.get(proc.pid, {}).items():
                by_index[index] = by_index.get(index, 0) + memory
        return tuple(TreeGpuMemory(self.gpu.devices[index], memory)
                     for index, memory in sorted(by_index.items()))

    def _cpu_percent(self, job_id: str, now: float, cpu_time_s: float) -> float:
        mark = self._cpu_marks.get(job_id)
        self._cpu_marks[job_id] = _CpuMark(now, cpu_time_s)
        if mark is None or now <= mark.t:
            return 0.0
        return max(0.0, (cpu_time_s - mark.cpu_time_s) / (now - mark.t) * 100.0)
