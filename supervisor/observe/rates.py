"""A job's rate, read from its progress: the readings (`Observation`), the progress points
they leave (`ProgressHistory`, built one reading at a time by `HistoryBuilder`), and the
rate and bytes per item estimated from those points. The ETA and the disk runway built
on them live in `forecast.py`.

Pure functions: no I/O and no clock reads. The rate is read from *progress points*: the
times at which each item count was first seen. Flat stretches between points carry no
information about the rate (files land 32 at a time, the sampler ticks every 2 s), and
the warm-up before the first item (a model load can take 24 minutes) is not part of the
rate at all.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MIN_WINDOW_ITEMS = 64
"""Smallest rate window, in items: two bursts of 32 files. Fewer items is mostly noise."""

RECENT_STEPS = 4096
"""Noise and sampling-interval medians read at most this many recent steps: plenty for a
stable median, and a 3-day trace then costs about what a 3-hour one does."""

CONSISTENCY_Z = 3.0
"""A longer window is trusted while its rate stays within this many standard errors of
every shorter window's rate (see `rate_from_points`). 3 keeps false alarms on a steady
job rare, so a steady job gets the long, quiet window."""


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class Observation:
    """One reading of a job."""

    t: float  # seconds since the epoch
    items_done: int | None  # None when no progress source reports items yet
    bytes_written: int  # bytes of the job's output files, in bytes


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class ProgressPoint:
    t: float  # when `items_done` was first seen, seconds since the epoch
    items_done: int
    bytes_written: int  # in bytes, at that reading


@dataclass(frozen=True)
class ProgressHistory:
    """The progress of a job's current run: the baseline and the points after it.

    `baseline` is the last reading before the first new item of this run: the count (0,
    or where a resumed job restarts from) and bytes already there when the warm-up ended.
    `points` holds one entry per count first seen after it, oldest first; `points[0]` is
    the first item. A count that goes down (the job restarted) starts a new run.
    """

    baseline: ProgressPoint
    points: Sequence[ProgressPoint]
    latest: Observation  # the newest reading with a count
    sample_interval_s: float | None  # median time between readings of this run

    @property
    def items_done(self) -> int:
        return self.points[-1].items_done if self.points else self.baseline.items_done


@dataclass(frozen=True)
class RateEstimate:
    rate_items_per_s: float
    window_items: int  # items in the window the rate was read from
    step_s: float  # typical time between progress points in that window, in seconds


def progress_history(observations: Sequence[Observation]) -> ProgressHistory | None:
    """Split readings into baseline and progress points; None when no reading has a count."""
    builder = HistoryBuilder()
    for obs in observations:
        builder.add(obs)
    return builder.history()


class HistoryBuilder:
    """`progress_history` one reading at a time: O(1) per reading, where rebuilding the
    history from every reading each tick costs O(readings) (a 5-hour job at a 2 s tick:
    9,000 readings a tick)."""

    def __init__(self, max_points: int | None = None) -> None:
        """`max_points`: above this many points the older half is thinned by two (each
        point is a count first seen; a job of a million items would keep them all)."""
        self.max_points = max_points
        self.baseline: Observation | None = None
        self.latest: Observation | None = None
        self.gaps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self.points: list[ProgressPoint] = []
        self.runs = 0
        """Runs seen (a count that went down started a new one)."""

    def add(self, obs: Observation) -> None:
        latest = self.latest
        if obs.items_done is None:
            return
        if latest is None or obs.items_done < (latest.items_done or 0):
            self.baseline, self.points = obs, []  # first reading, or the job restarted
            self.gaps.clear()
            self.runs += 1
        else:
            if obs.t > latest.t:
                self.gaps.append(obs.t - latest.t)
            if obs.items_done > (latest.items_done or 0):
                self.points.append(ProgressPoint(obs.t, obs.items_done, obs.bytes_written))
                if self.max_points is not None and len(self.points) > self.max_points:
                    half = len(self.points) // 2
                    self.points[:half] = self.points[:half:2]
            elif not self.points:
                self.baseline = obs  # still warming up: the baseline moves with it
        self.latest = obs

    def history(self, sample_interval_s: float | None = None) -> ProgressHistory | None:
        """The history so far. Its `points` is this builder's list (not copied: read
        it before the next `add`). `sample_interval_s`: a median of the gaps computed
        earlier, else it is computed now."""
        baseline, latest = self.baseline, self.latest
        if baseline is None or latest is None:
            return None
        start = ProgressPoint(baseline.t, baseline.items_done or 0, baseline.bytes_written)
        if sample_interval_s is None and self.gaps:
            sample_interval_s = statistics.median(self.gaps)
        return ProgressHistory(start, self.points, latest, sample_interval_s)


def estimate_rate(observations: Sequence[Observation]) -> float | None:
    """Items per second from the progress since the first item; None before 2 points."""
    history = progress_history(observations)
    estimate = history_rate(history) if history else None
    return estimate.rate_items_per_s if estimate else None


def rate_from_points(
    points: Sequence[ProgressPoint], *, sample_interval_s: float | None = None
) -> RateEstimate | None:
    """The rate over the longest recent window, in items, that looks like one steady rate.

    Why not one fixed window: a steady job is best served by all of its items (the error
    of a rate read from N items shrinks like 1/sqrt(N), and item times vary a lot with
    sequence length), while a job whose rate changed needs only the items since the
    change. So windows of the last 64, 128, 256, ... items up to all of them are each
    read, with a standard error, and the longest one whose rate agrees with every shorter
    one (within `CONSISTENCY_Z` standard errors) wins: Lepski's method.

    Windows are counted in items, not seconds, so a burst of 32 files weighs the same as
    32 single files, and they end at progress points, so flat stretches between bursts
    never enter a rate. Within a window, see `_median_long_slope`. `sample_interval_s`
    (from `progress_history`) is how precisely a point's time is known.
    """
    if len(points) < 2:
        return None
    counts = [p.items_done for p in points]
    items_total = counts[-1] - counts[0]
    noise_rel = _noise_per_item(points[-RECENT_STEPS:])  # relative sd of one item's time
    starts: list[int] = []  # first point of each window, shortest window first
    size = MIN_WINDOW_ITEMS
    while True:
        start = bisect.bisect_left(counts, counts[-1] - min(size, items_total))
        start = min(start, len(points) - 2)
        if not starts or start < starts[-1]:
            starts.append(start)
        if size >= items_total:
            break
        size *= 2
    rates: list[float] = []
    std_errors: list[float] = []
    for start in starts:
        window = points[start:]
        rate = _median_long_slope(window)
        if any(abs(rate - r) > CONSISTENCY_Z * e for r, e in zip(rates, std_errors, strict=True)):
            break  # this window reaches back into a different rate
        # Standard error: item times add up over the window (noise / sqrt(items)), and its
        # ends are known to one sampling interval, or one burst gap if that is shorter.
        span_s = window[-1].t - window[0].t
        items = counts[-1] - counts[start]
        resolution_s = min(_median_gap_s(window), sample_interval_s or math.inf)
        resolution = resolution_s / span_s if span_s > 0 else 1.0
        rates.append(rate)
        std_errors.append(rate * math.hypot(noise_rel / math.sqrt(items), resolution))
    start = starts[len(rates) - 1]
    return RateEstimate(rates[-1], counts[-1] - counts[start], _median_gap_s(points[start:]))


def estimate_bytes_per_item(observations: Sequence[Observation]) -> float | None:
    """Bytes per item from the growth of bytes vs items since the first counted item.

    A ratio of totals, not a median of per-burst ratios: item sizes are skewed (sequence
    lengths), and the disk fills with the sum, not the typical item. Bytes there at the
    first count (a resumed job's earlier output, a config dump, files the count lags
    behind) are left out. None before two counts (a job whose items come hours apart
    relies on the declared or learned size until then), or when bytes went down (the
    job deleted output).
    """
    history = progress_history(observations)
    return history_bytes_per_item(history) if history else None


def history_rate(history: ProgressHistory) -> RateEstimate | None:
    """Items per second over a history's points (`rate_from_points`)."""
    return rate_from_points(history.points, sample_interval_s=history.sample_interval_s)


def history_bytes_per_item(history: ProgressHistory) -> float | None:
    """Bytes per item from the first counted item to the latest reading, so None
    before two points. Not from the baseline: a worker's count lags its files (it reports
    after a batch is written; a parent of ranks sums their reports a moment later), and
    the files written before the first count would be charged to the first few items.
    On a 2-GPU extraction that read 5x the true size for a second: a false
    `disk_will_fill`."""
    if len(history.points) < 2:
        return None
    first = history.points[0]
    items = history.items_done - first.items_done
    grown = history.latest.bytes_written - first.bytes_written
    return grown / items if grown >= 0 and items > 0 else None


def _median_long_slope(points: Sequence[ProgressPoint]) -> float:
    """Median of the slopes between each point and the one three quarters of a window later.

    Item times add up, so the plain items/time of the whole window is the most precise
    rate (a least-squares fit through all points is noisier); long pairs keep most of that
    precision, and the median keeps any one odd point from moving the result.
    """
    span = max(len(points) * 3 // 4, 1)
    slopes = [
        (b.items_done - a.items_done) / (b.t - a.t)
        for a, b in zip(points, points[span:], strict=False)
        if b.t > a.t
    ]
    return statistics.median(slopes) if slopes else 0.0  # 0.0: the clock went backwards


def _median_gap_s(points: Sequence[ProgressPoint]) -> float:
    recent = points[-RECENT_STEPS:]
    return statistics.median(b.t - a.t for a, b in zip(recent, recent[1:], strict=False))


def _noise_per_item(points: Sequence[ProgressPoint]) -> float:
    """Relative sd of one item's time, from successive steps between progress points.

    Differences of neighbouring steps' seconds per item (scaled to unit variance) cancel
    a slow change of rate, so a job that sped up does not look noisy; the median of their
    absolute values ignores odd steps. 0 with fewer than 3 points.
    """
    steps = [
        ((b.t - a.t) / n, n)
        for a, b in zip(points, points[1:], strict=False)
        if (n := b.items_done - a.items_done) > 0
    ]
    if len(steps) < 2:
        return 0.0
    diffs = [
        abs(s2 - s1) / math.sqrt(1 / n1 + 1 / n2)
        for (s1, n1), (s2, n2) in zip(steps, steps[1:], strict=False)
    ]
    mean_s = statistics.median(s for s, _ in steps)
    return 1.4826 * statistics.median(diffs) / mean_s if mean_s > 0 else 0.0
