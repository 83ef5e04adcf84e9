"""A job's forecast kept from tick to tick: its history built one reading at a time
(`forecast.HistoryBuilder`) and its rate re-read now and then, over the pure functions of
`forecast.py` (`forecast_job` over a whole list of readings is the reference the tests
hold this to)."""

from __future__ import annotations

from supervisor.observe.forecast import JobForecast, forecast_from
from supervisor.observe.rates import (
    HistoryBuilder,
    Observation,
    RateEstimate,
    rate_from_points,
)

RATE_REFRESH_S = 10.0
"""How long `JobForecaster` keeps a rate estimate: reading it from every point of a
long job's history is the costly part of a forecast, and a rate read from hundreds of
items barely moves in 10 s. A new run (a restart) or a history that doubled since is
read at once."""


class JobForecaster:
    """`forecast_job` for one job as its readings come in, at a small cost per tick: the
    history is built one reading at a time, and the rate (with the median gap between
    readings) is re-estimated every `RATE_REFRESH_S`, not every tick. The ETA, bytes and
    disk outlook are recomputed every call from the newest count and time."""

    def __init__(self, max_points: int | None = None) -> None:
        self.builder = HistoryBuilder(max_points)
        self._estimate: RateEstimate | None = None
        self._sample_interval_s: float | None = None
        self._estimated_at: float | None = None
        self._estimated_points = 0
        self._estimated_run = 0

    def add(self, obs: Observation) -> None:
        self.builder.add(obs)

    def forecast(self, *, items_total: int | None, now: float, disk_free_bytes: int | None,
                 declared_bytes_per_item: float | None = None,
                 stall_timeout_s: float | None = None) -> JobForecast:
        builder = self.builder
        points = len(builder.points)
        stale = (self._estimated_at is None or now - self._estimated_at >= RATE_REFRESH_S
                 or now < self._estimated_at or builder.runs != self._estimated_run
                 or points >= 2 * self._estimated_points)
        if stale:
            history = builder.history()
            self._estimate = (rate_from_points(history.points,
                                               sample_interval_s=history.sample_interval_s)
                              if history else None)
            self._sample_interval_s = history.sample_interval_s if history else None
            self._estimated_at, self._estimated_points = now, points
            self._estimated_run = builder.runs
        else:
            history = builder.history(self._sample_interval_s)
        return forecast_from(history, self._estimate, items_total=items_total, now=now,
                             disk_free_bytes=disk_free_bytes,
                             declared_bytes_per_item=declared_bytes_per_item,
                             stall_timeout_s=stall_timeout_s)
