"""The file side of reading a job, run in the observer's threads: its output scan, its
progress (the progress file, else the log) and the free space of its filesystem, as one
`FileReading`. A job's `FileSide` is used by one thread at a time (its scanner is not
thread-safe)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.observe import progress_file
from supervisor.observe.view import disk_free
from supervisor.runtime.dirwatch import DirWatcher
from supervisor.runtime.files import log_path, progress_path
from supervisor.runtime.outputs import OutputScanner
from supervisor.runtime.outputs_state import ScanResult
from supervisor.runtime.sampler import TreeReading
from supervisor.spec import JobSpec


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True, kw_only=True)
class ObservedJob:
    """What the observer needs of a running job (keywords only: three of its fields
    are pids and times that a positional call would swap unseen)."""

    job_id: str
    spec: JobSpec
    attempt: int
    root_pid: int
    root_create_time: float | None
    worker_pid: int | None
    started_at: float | None = None
    root_start_ticks: int | None = None
    root_boot_id: str | None = None
    remote: bool = False
    """Its shim publishes its readings (`observed.jsonl`), which the observer reads
    instead of /proc and the output directory: a job on another node
    (`Backend.observes_locally` False), or any job under `JOBSUP_OBSERVE=shim`."""
    scheduler_job_id: str | None = None
    """The cluster scheduler's id of the attempt (a SLURM job id), None for a local job."""
    queued: bool = False
    """It waits in the cluster scheduler's queue (`Backend.queued`)."""
    running_since: float | None = None
    """When it left that queue and began running on its node (`Backend.running_since`);
    None while queued, and for a job that never waited in one."""


@dataclass(frozen=True)
class ShimReading:
    """One line of a shim's `observed.jsonl`, on the daemon's clock."""

    t: float
    seq: int
    node: str
    interval_s: float
    tree: TreeReading
    files: int | None
    bytes_written: int | None
    free_bytes: int | None
    device: int | None
    """The output filesystem's key for the disk runway (`device_key`)."""
    final: bool
    error: str | None


class Scanner(Protocol):
    """What the observer needs of an output scanner (`OutputScanner`)."""

    def scan(self, now: float, *, final: bool = False) -> ScanResult: ...

    def watched(self) -> bool: ...

    def close(self) -> None: ...


ScannerFactory = Callable[[str, str], Scanner]
"""(output_dir, pattern) -> the job's scanner."""


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class FileReading:
    """The file side of one reading of a job (in the tick thread or a worker thread:
    `Observer._reads_inline`)."""

    t: float
    """The tick time it was taken for (what the scan was given as `now`)."""
    files: int
    bytes_written: int
    scanned: bool  # the job has an output directory
    reported: progress_file.Reported | None  # from the progress file, else the log
    source: str | None  # "progress_file", "log", or None when neither reports
    free_bytes: int | None
    device: int | None
    waiting: bool = False
    """Output files whose size may still change were not statted this time (the
    scanner's `waiting`): a final reading after the job's end is worth taking."""
    shim: tuple[ShimReading, ...] = ()
    """A remote job's readings new since the last file reading, oldest first (the
    newest gave the figures above); () for a local job."""
    stale: str | None = None
    """A remote job: why its shim's figures are old (it has gone silent); None if not."""
    took_s: float | None = None
    """How long the reading took (wall clock, seconds); None where not timed."""
    log_free_bytes: int | None = None
    """Free bytes on the filesystem of the job's log (the data dir's) when it is not the
    one `free_bytes` is of: a job's log has no cap, and fills the disk under the
    database and every job's status file; None when it is the same, or unknown."""


class LogsDisk:
    """The free space of the filesystem holding the jobs' logs (the jobs dir), read at
    most once per tick time for all jobs: a statvfs and a stat per job per tick cost
    ~11 us each on the 2-core VM, 0.1 s a tick with 10,000 jobs. Shared by the jobs'
    readings, in the tick thread and the worker threads (a race reads it twice)."""

    def __init__(self, jobs_dir: Path) -> None:
        self.jobs_dir = str(jobs_dir)
        self._read: tuple[float, int | None, int | None] | None = None

    def free(self, now: float) -> tuple[int | None, int | None]:
        """(free bytes, device) of the jobs dir's filesystem at tick time `now`."""
        read = self._read
        if read is None or read[0] != now:
            read = (now, *disk_free(self.jobs_dir))
            self._read = read
        return read[1], read[2]


class DisksOfTick:
    """`disk_free` of each path read at most once per tick time, for all jobs: a job
    without an output directory is read on its cwd, which many jobs share (a statvfs and
    a stat each, ~11 us on the 2-core VM: 1,000 sleeping jobs in one directory read it
    1,000 times a tick; #30). Shared by the tick thread and the worker threads: a race
    reads a path twice; a reading for an earlier tick time (a final reading) is not
    kept."""

    def __init__(self) -> None:
        self._tick: tuple[float, dict[str, tuple[int | None, int | None]]] = (-math.inf, {})

    def free(self, path: str | None, now: float) -> tuple[int | None, int | None]:
        """(free bytes, device) of the filesystem holding `path`, as `disk_free`."""
        if not path:
            return None, None
        tick_now, reads = self._tick
        if now != tick_now:
            if now < tick_now:
                return disk_free(path)
            reads = {}
            self._tick = (now, reads)
        found = reads.get(path)
        if found is None:
            found = reads[path] = disk_free(path)
        return found


class FileSide:
    """A job's output scanner and where it reports progress. Used by one worker thread
    at a time (see `jobstate.KeptJobState.inflight`): the scanner is not thread-safe."""

    def __init__(self, jobs_dir: Path, make_scanner: ScannerFactory,
                 logs_disk: LogsDisk | None = None, disks: DisksOfTick | None = None) -> None:
        self.jobs_dir = jobs_dir
        self.logs_disk = logs_disk or LogsDisk(jobs_dir)
        self.disks = disks or DisksOfTick()
        self.make_scanner = make_scanner
        self.scanner: Scanner | None = None
        self.log = progress_file.LogReader()  # the log's progress, read as it grows
        self.progress_file = progress_file.ProgressFileReader()

    def read(self, job: ObservedJob, now: float, *, final: bool = False) -> FileReading:
        """`final`: the job has ended; every output file still settling is statted."""
        begun = time.monotonic()
        spec = job.spec
        files = bytes_written = 0
        waiting = False
        if spec.output_dir:
            if self.scanner is None:  # here, not in the tick: an invalid pattern raises
                self.scanner = self.make_scanner(spec.output_dir, spec.pattern)
            # file mtimes are system-clock times: the scanner compares them with that
            # clock, not with the daemon's steady one (clock.py)
            scan = self.scanner.scan(time.time(), final=final)
            files, bytes_written, waiting = scan.files, scan.bytes, scan.waiting > 0
        free_bytes, device = self.disks.free(spec.output_dir or spec.cwd, now)
        log_free_bytes, log_device = self.logs_disk.free(now)
        reported, source = self.progress(job)
        return FileReading(now, files, bytes_written, bool(spec.output_dir), reported,
                           source, free_bytes, device, waiting,
                           took_s=time.monotonic() - begun,
                           log_free_bytes=None if log_device == device else log_free_bytes)

    def watched(self, job: ObservedJob) -> bool:
        """Its next reading costs what changed since the last, not a walk: it has no
        output directory, or its scanner watches all of it (`OutputScanner.watched`)."""
        if not job.spec.output_dir:
            return True
        return self.scanner is not None and self.scanner.watched()

    def close(self) -> None:
        """The job is done with: its scanner's directory watches go."""
        if self.scanner is not None:
            self.scanner.close()

    def progress(self, job: ObservedJob) -> tuple[progress_file.Reported | None, str | None]:
        """(what the job reports, "progress_file" or "log"), (None, None) if nothing."""
        reported = self.progress_file.read(progress_path(self.jobs_dir, job.job_id))
        if reported is not None:
            return reported, "progress_file"
        reported = self.log.read(log_path(self.jobs_dir, job.job_id, job.attempt))
        return reported, "log" if reported is not None else None


def output_scanner(root: str, pattern: str, watcher: DirWatcher | None = None) -> Scanner:
    return OutputScanner(root, pattern, watcher=watcher)


def items_from(spec: JobSpec, reading: FileReading
           ) -> tuple[int | None, int | None, dict[str, float], str | None]:
    """(items_done, items_total, metrics, source) from the best source of a reading."""
    reported = reading.reported
    if reported is not None:
        return (reported.items_done, reported.items_total or spec.expected_items,
                reported.metrics, reading.source)
    if reading.scanned:
        return reading.files, spec.expected_items, {}, "files"
    return None, spec.expected_items, {}, None
