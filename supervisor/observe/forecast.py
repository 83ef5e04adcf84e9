"""Forecasts for one job and for one filesystem: ETA, projected bytes, disk runway.

Pure functions: observations in, frozen dataclasses out. No I/O and no clock reads; "now"
is always an argument, so any forecast can be recomputed from stored samples. The rate
and bytes per item they build on are read in `rates.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from supervisor.formatting import format_bytes
from supervisor.observe.rates import (
    Observation,
    ProgressHistory,
    RateEstimate,
    history_bytes_per_item,
    history_rate,
    progress_history,
)


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class JobForecast:
    """Field names follow the `forecast` object of docs/api.md."""

    rate_items_per_s: float | None
    eta_s: float | None
    eta_at: float | None  # seconds since the epoch; the API formats it as ISO 8601
    bytes_per_item: float | None  # in bytes
    projected_total_bytes: int | None  # bytes the job's output will have at the end
    disk_free_bytes: int | None
    disk_full_in_s: float | None
    will_fit: bool | None


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class JobDiskDemand:
    """What one running job still wants from its filesystem."""

    job_id: str
    bytes_per_s: float | None  # current write rate; None when unknown
    remaining_bytes: int | None  # bytes still to be written; None when unknown


@dataclass(frozen=True)
class JobRunway:
    job_id: str
    will_fit: bool | None  # True when this job finishes writing before the disk fills


@dataclass(frozen=True)
class DiskRunway:
    """One filesystem shared by several jobs."""

    free_bytes: int
    bytes_per_s: float  # summed write rate of the jobs still writing
    remaining_bytes: int | None  # summed; None when a job's is unknown and the rest fits
    disk_full_in_s: float | None  # free / summed rate; None when nothing grows
    fills_in_s: float | None  # when it fills as jobs finish one by one; None: never
    will_fit: bool | None  # every job's remaining bytes fit together
    jobs: tuple[JobRunway, ...]


def forecast_job(
    observations: Sequence[Observation],
    *,
    items_total: int | None,
    now: float,
    disk_free_bytes: int | None,
    declared_bytes_per_item: float | None = None,
    stall_timeout_s: float | None = None,
) -> JobForecast:
    """Rate, ETA and disk outlook of one job, as if it had its filesystem to itself.

    ETA: remaining items / rate, counted from the last progress point, less the time
    already spent waiting for the next one, but never less than one typical gap between
    points. So between bursts the ETA counts down one second per second as expected, and
    when progress pauses it holds still (`eta_at` slips) instead of falling to 0.

    Once no new item has come for `stall_timeout_s` (the job's own, as the `stalled`
    alert counts it after the first item), the job is stalled and the forecast says so:
    rate 0, no ETA, no disk-full time (nothing grows). Before, a stalled job kept its last
    rate and an ETA that slid forever, in the API, the table, the page and the stall
    alert's own text (#32). A new item brings the rate back.

    `declared_bytes_per_item` (e.g. from the job's spec) is used until the job's own
    output gives a measured value.
    """
    history = progress_history(observations)
    return forecast_from(history, history_rate(history) if history else None,
                         items_total=items_total, now=now, disk_free_bytes=disk_free_bytes,
                         declared_bytes_per_item=declared_bytes_per_item,
                         stall_timeout_s=stall_timeout_s)


def is_stalled(history: ProgressHistory | None, *, now: float,
               stall_timeout_s: float | None) -> bool:
    """No new item for more than `stall_timeout_s` since the last one (after the first
    item: before it there is no rate to hold, and the `stalled` rule watches activity)."""
    return (stall_timeout_s is not None and history is not None and bool(history.points)
            and now - history.points[-1].t > stall_timeout_s)


def forecast_from(history: ProgressHistory | None, estimate: RateEstimate | None, *,
                  items_total: int | None, now: float, disk_free_bytes: int | None,
                  declared_bytes_per_item: float | None = None,
                  stall_timeout_s: float | None = None) -> JobForecast:
    """`forecast_job` from a job's history and a rate estimated from it (perhaps a few
    seconds earlier: see `JobForecaster`)."""
    if estimate is not None and is_stalled(history, now=now, stall_timeout_s=stall_timeout_s):
        estimate = replace(estimate, rate_items_per_s=0.0)
    rate = estimate.rate_items_per_s if estimate else None
    items_done = history.items_done if history else None
    remaining_items = None
    if items_total is not None and items_done is not None:
        remaining_items = max(items_total - items_done, 0)

    eta_s: float | None = None
    if remaining_items == 0:
        eta_s = 0.0
    elif remaining_items is not None and history and estimate and estimate.rate_items_per_s > 0:
        waited_s = min(max(now - history.points[-1].t, 0.0), estimate.step_s)
        eta_s = max(remaining_items / estimate.rate_items_per_s - waited_s, 0.0)

    measured = history_bytes_per_item(history) if history else None
    bytes_per_item = measured if measured is not None else declared_bytes_per_item
    projected_total_bytes = remaining_bytes = None
    if remaining_items is not None and bytes_per_item is not None and history:
        remaining_bytes = round(remaining_items * bytes_per_item)
        projected_total_bytes = history.latest.bytes_written + remaining_bytes

    disk_full_in_s = will_fit = None
    if disk_free_bytes is not None:
        bytes_per_s = bytes_per_item * rate if bytes_per_item is not None and rate else 0.0
        disk_full_in_s = disk_free_bytes / bytes_per_s if bytes_per_s > 0 else None
        if remaining_bytes is not None:
            will_fit = remaining_bytes <= disk_free_bytes
    return JobForecast(
        rate_items_per_s=rate,
        eta_s=eta_s,
        eta_at=now + eta_s if eta_s is not None else None,
        bytes_per_item=bytes_per_item,
        projected_total_bytes=projected_total_bytes,
        disk_free_bytes=disk_free_bytes,
        disk_full_in_s=disk_full_in_s,
        will_fit=will_fit,
    )


def disk_demand(job_id: str, forecast: JobForecast, *, bytes_written: int) -> JobDiskDemand:
    """A job's forecast, as the demand `disk_runway` sums over its filesystem."""
    bytes_per_s = None
    if forecast.rate_items_per_s is not None and forecast.bytes_per_item is not None:
        bytes_per_s = forecast.rate_items_per_s * forecast.bytes_per_item
    remaining_bytes = None
    if forecast.projected_total_bytes is not None:
        remaining_bytes = max(forecast.projected_total_bytes - bytes_written, 0)
    return JobDiskDemand(job_id, bytes_per_s, remaining_bytes)


def disk_runway(demands: Sequence[JobDiskDemand], *, free_bytes: int) -> DiskRunway:
    """Disk outlook of one filesystem, summed over all the jobs writing to it.

    `disk_full_in_s` is free bytes over the summed write rate of the jobs still writing
    (the runway "at this rate"). `will_fit` asks whether all remaining bytes fit together.
    Per job, `will_fit` is finer: jobs stop writing when they finish, so the disk fills
    later than the summed rate says, and a job that finishes before that moment fits even
    when the filesystem as a whole does not. With one job both answers are the same.
    """
    writing = [d for d in demands if d.remaining_bytes != 0]
    bytes_per_s = sum(d.bytes_per_s for d in writing if d.bytes_per_s and d.bytes_per_s > 0)
    disk_full_in_s = free_bytes / bytes_per_s if bytes_per_s > 0 else None
    known = [d.remaining_bytes for d in demands if d.remaining_bytes is not None]
    known_total = sum(known)
    all_known = len(known) == len(demands)
    will_fit = known_total <= free_bytes if all_known or known_total > free_bytes else None
    fills_in_s = _fill_time_s(writing, free_bytes)
    jobs = tuple(JobRunway(d.job_id, _job_fits(d, fills_in_s, will_fit)) for d in demands)
    return DiskRunway(
        free_bytes=free_bytes,
        bytes_per_s=bytes_per_s,
        remaining_bytes=known_total if all_known else None,
        disk_full_in_s=disk_full_in_s,
        fills_in_s=fills_in_s,
        will_fit=will_fit,
        jobs=jobs,
    )


def with_runway(forecast: JobForecast, runway: DiskRunway, job_id: str) -> JobForecast:
    """The job's forecast with its filesystem's shared disk outlook put in."""
    for job in runway.jobs:
        if job.job_id == job_id:
            return with_share(forecast, runway, job)
    return forecast


def with_share(forecast: JobForecast, runway: DiskRunway, job: JobRunway) -> JobForecast:
    """`with_runway` for the job's own entry of `runway.jobs`."""
    return replace(forecast, disk_free_bytes=runway.free_bytes,
                   disk_full_in_s=runway.disk_full_in_s, will_fit=job.will_fit)


def preflight(
    *,
    expected_items: int | None,
    bytes_per_item: float | None,
    free_bytes: int | None,
    other_remaining_bytes: int = 0,
) -> str | None:
    """A warning at submit when the projected output does not fit; None if it fits or unknown."""
    if expected_items is None or bytes_per_item is None or free_bytes is None:
        return None
    projected = expected_items * bytes_per_item
    needed = projected + other_remaining_bytes
    if needed <= free_bytes:
        return None
    others = ""
    if other_remaining_bytes:
        others = f" plus {format_bytes(other_remaining_bytes)} still to come from other jobs"
    return (
        f"projected output {format_bytes(projected)} ({expected_items:,} items x "
        f"{format_bytes(bytes_per_item)}){others} exceeds the {format_bytes(free_bytes)} free "
        f"on its filesystem by {format_bytes(needed - free_bytes)}"
    )


def _fill_time_s(demands: Sequence[JobDiskDemand], free_bytes: int) -> float | None:
    """When the disk fills if every job keeps its rate until its remaining bytes are out."""
    ends = sorted(
        (
            (d.remaining_bytes / d.bytes_per_s if d.remaining_bytes is not None else math.inf),
            d.bytes_per_s,
        )
        for d in demands
        if d.bytes_per_s and d.bytes_per_s > 0
    )
    used, t, rate = 0.0, 0.0, sum(bytes_per_s for _, bytes_per_s in ends)
    for end_s, bytes_per_s in ends:
        if used + rate * (end_s - t) >= free_bytes:
            return t + (free_bytes - used) / rate
        used, t, rate = used + rate * (end_s - t), end_s, rate - bytes_per_s
    return None


def _job_fits(demand: JobDiskDemand, fills_in_s: float | None, fs_fits: bool | None) -> bool | None:
    if demand.remaining_bytes is None:
        return None
    if demand.remaining_bytes == 0 or (fills_in_s is None and fs_fits is not False):
        return True
    if not demand.bytes_per_s or demand.bytes_per_s <= 0 or fills_in_s is None:
        return fs_fits
    return demand.remaining_bytes / demand.bytes_per_s <= fills_in_s
