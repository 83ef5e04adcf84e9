"""Forecast functions on synthetic traces sampled every 2 s; no processes needed."""

from __future__ import annotations

import math
import random

import pytest

from supervisor.observe.forecast import (
    DiskRunway,
    JobDiskDemand,
    disk_demand,
    disk_runway,
    forecast_job,
    preflight,
    with_runway,
)
from supervisor.observe.forecaster import RATE_REFRESH_S, JobForecaster
from supervisor.observe.rates import (
    Observation,
    estimate_bytes_per_item,
    estimate_rate,
    progress_history,
)

T0 = 1_700_000_000.0
SAMPLE_S = 2.0
LOAD_S = 24 * 60
MB = 1_000_000
GB = 1_000_000_000


def steady_trace(
    *,
    rate: float,
    until_items: int,
    load_s: float = LOAD_S,
    burst: int = 1,
    bytes_per_item: int = 0,
    time_jitter_s: float = 0.0,
    seed: int = 0,
) -> list[Observation]:
    """Readings every 2 s: `load_s` with no items, then `rate` items/s landing `burst` at a time."""
    rng = random.Random(seed)
    trace: list[Observation] = []
    k = 0
    while True:
        t = T0 + k * SAMPLE_S
        produced = int(max(t - T0 - load_s, 0.0) * rate)
        done = produced // burst * burst
        jitter = rng.uniform(-time_jitter_s, time_jitter_s)
        trace.append(Observation(t + jitter, done, done * bytes_per_item))
        if done >= until_items:
            return trace
        k += 1


def finish_time(rate: float, items_total: int, load_s: float = LOAD_S) -> float:
    return T0 + load_s + items_total / rate


# (a) a 24-minute load, then a steady rate


def test_load_phase_is_ignored_and_rate_and_eta_are_accurate() -> None:
    trace = steady_trace(rate=2.5, until_items=1000)
    now = trace[-1].t

    forecast = forecast_job(trace, items_total=10_000, now=now, disk_free_bytes=None)

    assert forecast.rate_items_per_s == pytest.approx(2.5, rel=0.03)
    true_eta_s = finish_time(2.5, 10_000) - now
    assert forecast.eta_s == pytest.approx(true_eta_s, rel=0.05)
    assert forecast.eta_at == pytest.approx(now + forecast.eta_s)
    naive_eta_s = (now - T0) / 1000 * 9000  # what elapsed-since-start would say
    assert naive_eta_s > 1.3 * true_eta_s


def test_first_item_is_where_the_rate_starts() -> None:
    history = progress_history(steady_trace(rate=2.5, until_items=100))
    assert history is not None
    assert history.baseline.items_done == 0
    assert history.baseline.t == pytest.approx(T0 + LOAD_S)  # the warm-up's last reading
    assert history.points[0].t == pytest.approx(T0 + LOAD_S + SAMPLE_S)


# (b) bursts of 32 files landing at once


def test_bursts_of_32_files() -> None:
    trace = steady_trace(rate=2.5, until_items=800, burst=32)
    assert estimate_rate(trace) == pytest.approx(2.5, rel=0.05)


def test_eta_counts_down_between_bursts_and_holds_when_progress_stops() -> None:
    trace = steady_trace(rate=2.5, until_items=800, burst=32)
    last = trace[-1]
    at_burst = forecast_job(trace, items_total=2000, now=last.t, disk_free_bytes=None)
    later = forecast_job(trace, items_total=2000, now=last.t + 6, disk_free_bytes=None)
    stalled = forecast_job(trace, items_total=2000, now=last.t + 3600, disk_free_bytes=None)

    assert at_burst.eta_s is not None and later.eta_s is not None and stalled.eta_s is not None
    assert later.eta_s == pytest.approx(at_burst.eta_s - 6, abs=0.5)
    assert stalled.eta_s == pytest.approx(at_burst.eta_s - 32 / 2.5, rel=0.05)  # one burst gap
    assert stalled.eta_at == pytest.approx(last.t + 3600 + stalled.eta_s)  # the end slips


# (c) a rate change


def test_rate_change_is_followed() -> None:
    slow = steady_trace(rate=2.0, until_items=2000)
    switch_t = slow[-1].t
    trace = list(slow)
    for k in range(1, 10_000):
        t = switch_t + k * SAMPLE_S
        done = 2000 + int((t - switch_t) * 4.0)
        trace.append(Observation(t, done, 0))
        if done >= 2600:  # 600 new items: under a quarter of what the job has done
            break

    assert estimate_rate(trace) == pytest.approx(4.0, rel=0.10)
    assert estimate_rate(slow) == pytest.approx(2.0, rel=0.03)


def test_rate_change_in_bursts_with_noise_is_followed() -> None:
    rng = random.Random(7)
    trace: list[Observation] = []
    t, done = T0 + LOAD_S, 0
    while done < 3000:
        rate = 2.0 if done < 2000 else 4.0
        t += 32 / rate * rng.lognormvariate(0, 0.2)
        done += 32
        trace.append(Observation(t, done, 0))
    trace.insert(0, Observation(T0, 0, 0))

    assert estimate_rate(trace) == pytest.approx(4.0, rel=0.10)


# (d) two jobs filling one disk


def test_two_jobs_share_a_disk() -> None:
    free = 100 * GB
    demands = [
        JobDiskDemand("a", bytes_per_s=100 * MB, remaining_bytes=40 * GB),
        JobDiskDemand("b", bytes_per_s=150 * MB, remaining_bytes=50 * GB),
    ]

    runway = disk_runway(demands, free_bytes=free)

    assert runway.bytes_per_s == pytest.approx(250 * MB)
    assert runway.remaining_bytes == 90 * GB
    assert runway.disk_full_in_s == pytest.approx(400.0)
    assert runway.will_fit is True
    assert runway.fills_in_s is None
    assert [(j.job_id, j.will_fit) for j in runway.jobs] == [("a", True), ("b", True)]


def test_two_jobs_that_each_fit_alone_do_not_fit_together() -> None:
    free = 100 * GB
    demands = [
        JobDiskDemand("a", bytes_per_s=100 * MB, remaining_bytes=60 * GB),
        JobDiskDemand("b", bytes_per_s=100 * MB, remaining_bytes=60 * GB),
    ]
    for alone in demands:
        assert disk_runway([alone], free_bytes=free).will_fit is True

    runway = disk_runway(demands, free_bytes=free)

    assert runway.will_fit is False
    assert runway.disk_full_in_s == pytest.approx(500.0)
    assert runway.fills_in_s == pytest.approx(500.0)  # both still writing then (600 s each)
    assert [j.will_fit for j in runway.jobs] == [False, False]


def test_a_job_that_finishes_before_the_disk_fills_fits() -> None:
    free = 100 * GB
    demands = [
        JobDiskDemand("short", bytes_per_s=100 * MB, remaining_bytes=10 * GB),  # done at 100 s
        JobDiskDemand("long", bytes_per_s=100 * MB, remaining_bytes=95 * GB),
    ]

    runway = disk_runway(demands, free_bytes=free)

    assert runway.will_fit is False
    assert runway.disk_full_in_s == pytest.approx(500.0)  # at today's summed rate
    assert runway.fills_in_s == pytest.approx(100 + 80 * GB / (100 * MB))  # 900 s
    assert {j.job_id: j.will_fit for j in runway.jobs} == {"short": True, "long": False}


def test_unknown_demands() -> None:
    free = 100 * GB
    unknown = JobDiskDemand("u", bytes_per_s=None, remaining_bytes=None)
    small = JobDiskDemand("s", bytes_per_s=None, remaining_bytes=10 * GB)
    big = JobDiskDemand("b", bytes_per_s=None, remaining_bytes=200 * GB)

    assert disk_runway([unknown, small], free_bytes=free).will_fit is None
    assert disk_runway([unknown, big], free_bytes=free).will_fit is False
    quiet = disk_runway([small], free_bytes=free)
    assert quiet.disk_full_in_s is None and quiet.will_fit is True
    assert disk_runway([], free_bytes=free) == DiskRunway(free, 0.0, 0, None, None, True, ())


def test_forecast_takes_its_filesystem_runway() -> None:
    trace = steady_trace(rate=2.5, until_items=500, burst=32, bytes_per_item=83 * MB)
    free = 1000 * GB
    forecast = forecast_job(trace, items_total=10_000, now=trace[-1].t, disk_free_bytes=free)
    demand = disk_demand("a", forecast, bytes_written=trace[-1].bytes_written)
    other = JobDiskDemand("b", bytes_per_s=demand.bytes_per_s, remaining_bytes=400 * GB)

    assert demand.bytes_per_s == pytest.approx(2.5 * 83 * MB, rel=0.05)
    assert demand.remaining_bytes == (10_000 - 512) * 83 * MB
    assert forecast.will_fit is True
    runway = disk_runway([demand, other], free_bytes=free)
    shared = with_runway(forecast, runway, "a")
    assert shared.will_fit is False
    assert shared.disk_full_in_s == pytest.approx(forecast.disk_full_in_s / 2, rel=1e-6)
    assert with_runway(forecast, runway, "not-here") == forecast


# disk outlook of one job


def test_bytes_per_item_and_single_job_disk_outlook() -> None:
    trace = [
        Observation(o.t, o.items_done, o.bytes_written + 5 * GB)
        for o in steady_trace(rate=2.5, until_items=640, burst=32, bytes_per_item=83 * MB)
    ]  # 5 GB were there before the job: not the job's items
    now = trace[-1].t

    assert estimate_bytes_per_item(trace) == pytest.approx(83 * MB)
    fits = forecast_job(trace, items_total=10_000, now=now, disk_free_bytes=1000 * GB)
    assert fits.projected_total_bytes == pytest.approx(5 * GB + 10_000 * 83 * MB, rel=1e-9)
    assert fits.disk_full_in_s == pytest.approx(1000 * GB / (2.5 * 83 * MB), rel=0.05)
    assert fits.will_fit is True
    short = forecast_job(trace, items_total=10_000, now=now, disk_free_bytes=700 * GB)
    assert short.will_fit is False  # 9,360 items x 83 MB = 777 GB still to come


def test_a_count_lagging_its_files_does_not_inflate_bytes_per_item() -> None:
    """Seen on 2 x H200: ranks write files, then report; the parent sums the reports a
    moment later. At the first count of 4 items, 20 files were on disk: charged to those
    4 items, the job "needed" 121 GB of a 116.7 GB disk and disk_will_fill fired."""
    lag_items, per_item = 16, 47_600_000
    trace = [Observation(o.t, o.items_done, (o.items_done + lag_items) * per_item
                         if o.items_done else 0)
             for o in steady_trace(rate=33.0, until_items=512, load_s=20, burst=4)]
    first_count = next(i for i, o in enumerate(trace) if o.items_done)
    for end in range(first_count + 1, len(trace) + 1):
        f = forecast_job(trace[:end], items_total=512, now=trace[end - 1].t,
                         disk_free_bytes=int(116.7 * GB))
        assert f.will_fit is not False, f"false alarm at {trace[end - 1].items_done} items"
        if f.bytes_per_item is not None:
            assert f.bytes_per_item == pytest.approx(per_item, rel=0.01)
    assert forecast_job(trace[:first_count + 1], items_total=512, now=trace[first_count].t,
                        disk_free_bytes=GB).bytes_per_item is None  # one count: no estimate


def test_declared_bytes_per_item_until_measured() -> None:
    loading = steady_trace(rate=2.5, until_items=0, load_s=600)
    forecast = forecast_job(
        loading,
        items_total=10_000,
        now=loading[-1].t,
        disk_free_bytes=500 * GB,
        declared_bytes_per_item=83 * MB,
    )
    assert forecast.bytes_per_item == 83 * MB
    assert forecast.projected_total_bytes == 830 * GB
    assert forecast.will_fit is False
    assert forecast.disk_full_in_s is None  # nothing grows yet


# edge cases


def test_no_items_yet() -> None:
    loading = steady_trace(rate=2.5, until_items=0, load_s=LOAD_S)[:-1]
    forecast = forecast_job(loading, items_total=100, now=T0 + 1000, disk_free_bytes=GB)

    assert estimate_rate(loading) is None
    assert forecast.rate_items_per_s is None and forecast.eta_s is None
    assert forecast.eta_at is None and forecast.bytes_per_item is None


def test_no_progress_source_and_no_observations() -> None:
    unknown = [Observation(T0 + k, None, k * MB) for k in range(10)]
    assert progress_history(unknown) is None
    assert estimate_rate(unknown) is None
    assert estimate_bytes_per_item(unknown) is None
    empty = forecast_job([], items_total=10, now=T0, disk_free_bytes=None)
    assert empty.rate_items_per_s is None and empty.eta_s is None


def test_one_progress_point_is_not_a_rate() -> None:
    trace = [Observation(T0, 0, 0), Observation(T0 + 2, 0, 0), Observation(T0 + 4, 32, 0)]
    assert estimate_rate(trace) is None
    assert estimate_rate([*trace, Observation(T0 + 20, 64, 0)]) == pytest.approx(2.0)


def test_unknown_total_has_no_eta() -> None:
    trace = steady_trace(rate=2.5, until_items=500)
    forecast = forecast_job(trace, items_total=None, now=trace[-1].t, disk_free_bytes=GB)

    assert forecast.rate_items_per_s == pytest.approx(2.5, rel=0.03)
    assert forecast.eta_s is None and forecast.eta_at is None
    assert forecast.projected_total_bytes is None and forecast.will_fit is None


def test_done_job_has_zero_eta() -> None:
    trace = steady_trace(rate=2.5, until_items=500)
    forecast = forecast_job(trace, items_total=500, now=trace[-1].t + 60, disk_free_bytes=None)
    assert forecast.eta_s == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_noisy_sample_times(seed: int) -> None:
    trace = steady_trace(rate=2.5, until_items=1500, burst=32, time_jitter_s=0.8, seed=seed)
    now = trace[-1].t
    forecast = forecast_job(trace, items_total=10_000, now=now, disk_free_bytes=None)

    assert forecast.rate_items_per_s == pytest.approx(2.5, rel=0.05)
    assert forecast.eta_s == pytest.approx(finish_time(2.5, 10_000) - now, rel=0.05)


def test_restart_starts_a_new_run() -> None:
    first = steady_trace(rate=1.0, until_items=300)
    resumed_at = first[-1].t + 10
    second = [  # resumed from item 256 after a 5-minute load, now at 3 items/s
        Observation(resumed_at + k * SAMPLE_S, 256 + int(max(k * SAMPLE_S - 300, 0) * 3), 0)
        for k in range(400)
    ]

    history = progress_history(first + second)
    assert history is not None and history.baseline.items_done == 256
    assert estimate_rate(first + second) == pytest.approx(3.0, rel=0.03)


def test_preflight() -> None:
    assert preflight(expected_items=1000, bytes_per_item=83 * MB, free_bytes=500 * GB) is None
    assert preflight(expected_items=None, bytes_per_item=83 * MB, free_bytes=GB) is None
    assert preflight(expected_items=10, bytes_per_item=None, free_bytes=GB) is None

    message = preflight(expected_items=10_000, bytes_per_item=83 * MB, free_bytes=500 * GB)
    assert message == (
        "projected output 830.0 GB (10,000 items x 83.0 MB) exceeds the 500.0 GB free "
        "on its filesystem by 330.0 GB"
    )
    crowded = preflight(
        expected_items=5000,
        bytes_per_item=83 * MB,
        free_bytes=500 * GB,
        other_remaining_bytes=200 * GB,
    )
    assert crowded is not None
    assert "415.0 GB" in crowded and "plus 200.0 GB" in crowded and "by 115.0 GB" in crowded


def test_long_trace_is_fast_enough_for_every_tick() -> None:
    """Three days of per-item progress sampled every 2 s: one forecast well under a tick.
    In CPU seconds, not wall seconds: on 2 loaded cores the wall time was 8x the CPU time
    (1.3-1.7 s against 0.15-0.22 s, load average 7), and this bound is on our work."""
    import time

    trace = steady_trace(rate=0.5, until_items=130_000, load_s=0)
    started = time.process_time()
    forecast = forecast_job(trace, items_total=200_000, now=trace[-1].t, disk_free_bytes=GB)
    assert time.process_time() - started < 2.0
    assert forecast.rate_items_per_s == pytest.approx(0.5, rel=0.01)
    assert math.isfinite(forecast.eta_s or math.nan)


def test_the_per_tick_forecaster_matches_the_pure_forecast() -> None:
    """`JobForecaster` (the observer's: one reading at a time, the rate re-read every
    RATE_REFRESH_S or when the points double) gives what `forecast_job` over every
    reading gives: the same counts and bytes every tick, a rate from the same tick on
    (the live table's test waits for it to reach the screen), within 2 % once a few
    hundred items are in, and it reads a restart at once."""
    trace = steady_trace(rate=2.5, until_items=3000, bytes_per_item=83 * MB,
                         time_jitter_s=0.3, seed=7)
    forecaster = JobForecaster()
    compared = 0
    for i, obs in enumerate(trace):
        forecaster.add(obs)
        got = forecaster.forecast(items_total=5000, now=obs.t, disk_free_bytes=900 * GB)
        want = forecast_job(trace[:i + 1], items_total=5000, now=obs.t,
                            disk_free_bytes=900 * GB)
        assert got.projected_total_bytes == want.projected_total_bytes  # the newest count
        assert got.bytes_per_item == want.bytes_per_item
        # a rate from the first tick the pure forecast has one, not RATE_REFRESH_S later
        assert (got.rate_items_per_s is None) == (want.rate_items_per_s is None), i
        if (obs.items_done or 0) >= 300:
            assert got.rate_items_per_s == pytest.approx(want.rate_items_per_s, rel=0.02)
            assert got.eta_s == pytest.approx(want.eta_s, rel=0.02, abs=SAMPLE_S)
            compared += 1
    assert compared > 500
    assert RATE_REFRESH_S > SAMPLE_S  # so most of those ticks used a held rate
    restart = Observation(trace[-1].t + SAMPLE_S, 0, 0)
    forecaster.add(restart)
    again = forecaster.forecast(items_total=5000, now=restart.t, disk_free_bytes=900 * GB)
    assert again.rate_items_per_s is None  # a new run: no rate read from the old one


def test_a_stalled_job_has_rate_0_and_no_eta() -> None:
    """No new item for longer than the job's stall timeout: rate 0, no ETA, no disk-full
    time (#32: the last rate and a sliding ETA were shown beside the `stalled` badge); a
    pause shorter than that keeps the rate and holds the ETA; a new item brings it back."""
    trace = steady_trace(rate=2.0, until_items=100, bytes_per_item=MB, time_jitter_s=0.0,
                         seed=3)
    last = trace[-1]
    paused = forecast_job(trace, items_total=1000, now=last.t + 19, disk_free_bytes=GB,
                          stall_timeout_s=20)
    assert paused.rate_items_per_s == pytest.approx(2.0, rel=0.05)
    assert paused.eta_s is not None and paused.disk_full_in_s is not None
    stalled = forecast_job(trace, items_total=1000, now=last.t + 21, disk_free_bytes=GB,
                           stall_timeout_s=20)
    assert stalled.rate_items_per_s == 0.0
    assert stalled.eta_s is None and stalled.eta_at is None and stalled.disk_full_in_s is None
    assert stalled.projected_total_bytes == paused.projected_total_bytes  # what is known
    forecaster = JobForecaster()
    for obs in trace:
        forecaster.add(obs)
    held = forecaster.forecast(items_total=1000, now=last.t + 21, disk_free_bytes=GB,
                               stall_timeout_s=20)
    assert held.rate_items_per_s == 0.0 and held.eta_s is None  # the per-tick one too
    again = Observation(last.t + 22, (last.items_done or 0) + 1, last.bytes_written + MB)
    forecaster.add(again)
    resumed = forecaster.forecast(items_total=1000, now=again.t, disk_free_bytes=GB,
                                  stall_timeout_s=20)
    assert resumed.rate_items_per_s and resumed.rate_items_per_s > 0 and resumed.eta_s
