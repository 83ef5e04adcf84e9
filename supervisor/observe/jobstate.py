"""What the observer (`observer.py`) keeps of each job from tick to tick (`KeptJobState`):
its file side and forecaster, its item counts and activity marks, the file reading in
flight (`InflightReading`) and its outcome, the last error logged; and the final reading of a
job that ended while its reading still ran (`EndingReading`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from supervisor.observe import rates
from supervisor.observe.forecaster import JobForecaster
from supervisor.observe.readings import FileReading, FileSide, ObservedJob
from supervisor.runtime.sampler import TreeReading

HISTORY_MAX_POINTS = 20_000
"""Above this many progress points the older half of a job's history is thinned by two."""

ACTIVITY_CPU_S = 0.05
"""CPU seconds a tree must use between two readings to count as active (a sleeping
Python process still wakes up now and then)."""


@dataclass(frozen=True)
class InflightReading:
    """A file reading handed to the workers and not picked up yet."""

    future: Future[FileReading]
    started: float  # time.monotonic() when it was handed over
    tick: int  # the observer's tick that started it


@dataclass
class KeptJobState:
    """What the observer keeps of one job from tick to tick."""

    files: FileSide
    forecaster: JobForecaster = field(
        default_factory=lambda: JobForecaster(HISTORY_MAX_POINTS))
    last_kept: rates.Observation | None = None
    """The last reading given to the forecaster."""
    last_items: int | None = None
    last_progress_at: float | None = None
    baseline_items: int | None = None
    first_item_at: float | None = None
    activity_at: float | None = None
    activity_mark: tuple[float, int, int, int | None] | None = None
    """(cpu_time_s, read_bytes, bytes_written, gpu_memory_bytes) at the last reading."""
    job: ObservedJob | None = None
    inflight: InflightReading | None = None
    outcome: FileReading | BaseException | None = None
    """A file reading finished since the last tick used one (or what it raised)."""
    reading: FileReading | None = None
    """The last file reading used: the figures the view shows."""
    start_error: str | None = None
    """Why no file reading could be started (the workers are closed)."""
    slow: bool = False
    """The last file reading outlived its tick's scan budget: the next one gets a
    thread's batch of its own (`Observer._start_readings`)."""
    logged_error: str | None = None
    """The last observation error logged, so that a lasting one is logged once."""
    tick_at: tuple[float, float] = (0.0, 0.0)
    """(now, time.monotonic()) of the last tick that observed the job."""
    shim_tree: TreeReading | None = None
    """A remote job: the process figures of its shim's newest reading."""
    node: str | None = None
    """A remote job: the node its shim's readings come from."""
    last_sample_t: float | None = None
    """When the job's last sample was taken (a remote job's older readings become
    samples of their own only if newer)."""

    def note_items(self, items_done: int | None, now: float) -> None:
        if items_done is None:
            return
        if self.baseline_items is None or (
                self.first_item_at is None and items_done < self.baseline_items):
            # what a resumed job starts from; a count going down before the first new
            # item was a stale reading (the last attempt's progress file): start over
            self.baseline_items = items_done
        elif self.first_item_at is None and items_done > self.baseline_items:
            self.first_item_at = now
        if items_done != self.last_items:
            if self.last_items is not None:
                self.last_progress_at = now
            self.last_items = items_done

    def note_activity(self, tree: TreeReading, bytes_written: int, now: float) -> None:
        mark = (tree.cpu_time_s, tree.read_bytes, bytes_written, tree.gpu_memory_bytes)
        previous = self.activity_mark
        self.activity_mark = mark
        if previous is None:
            return
        if (mark[0] - previous[0] >= ACTIVITY_CPU_S or mark[1] != previous[1]
                or mark[2] != previous[2] or mark[3] != previous[3]):
            self.activity_at = now

    def pick_up(self, tick: int) -> None:
        """Take the in-flight reading's result if it is done (the newest one wins); one
        that outlived the tick that started it marks the job `slow`."""
        inflight = self.inflight
        if inflight is None or not inflight.future.done():
            return
        self.inflight = None
        self.slow = inflight.tick < tick
        if inflight.future.cancelled():
            self.outcome = RuntimeError("the reading was cancelled")
            return
        error = inflight.future.exception()
        self.outcome = error if error is not None else inflight.future.result()


@dataclass(frozen=True)
class EndingReading:
    """The final file reading of a job that ended while its reading was still running."""

    future: Future[FileReading]
    job: ObservedJob


def describe_error(error: BaseException) -> str:
    """An error as a reading's failure shows it: its type, and its text if it has one."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
