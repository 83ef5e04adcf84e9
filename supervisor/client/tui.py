"""Terminal rendering of jobs for `jobsup watch` and `jobsup show` (rich)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from supervisor.client.outcome import ended_well
from supervisor.formatting import format_bytes, format_duration, from_iso

STATE_STYLE = {"pending": "yellow", "running": "cyan", "succeeded": "green",
               "failed": "bold red", "stopped": "magenta", "lost": "red"}
SPARK_CHARS = "▁▂▃▄▅▆▇█"



def gpu_memory_text(resources: dict[str, Any]) -> str:
    """The job's GPU memory and its split over devices, each against the device's size:
    `32.1 GB  (gpu0 16.0 GB of 143.8 GB, gpu1 16.1 GB of 143.8 GB)`. Device names are
    NVML indexes, which need not match CUDA's numbering."""
    text = format_bytes(resources["gpu_memory_bytes"])
    devices = resources.get("gpu_devices") or []  # absent from a daemon older than the field
    if devices:
        split = ", ".join(f"gpu{d['index']} {format_bytes(d['memory_bytes'])} of "
                          f"{format_bytes(d['device_total_bytes'])}" for d in devices)
        text += f"  ({split})"
    return text


def gpu_cell(resources: dict[str, Any]) -> str:
    """The job's GPU memory for a table column: the total, and how many GPUs it spans
    when more than one (`32.1 GB (2 GPUs)`)."""
    text = format_bytes(resources["gpu_memory_bytes"])
    devices = resources.get("gpu_devices") or []
    return f"{text} ({len(devices)} GPUs)" if len(devices) > 1 else text


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def rate_text(rate: float | None) -> str:
    if rate is None:
        return "-"
    if rate == 0:  # stalled (`forecast.is_stalled`)
        return "0/s"
    return f"{rate:.2f}/s" if rate >= 0.1 else f"{rate * 3600:.1f}/h"


def progress_cell(job: dict[str, Any], narrow: bool = False) -> RenderableType:
    """A bar and `done/total (pct%)`; on a narrow terminal a shorter bar and no pct."""
    p = job["progress"]
    done, total = p["items_done"], p["items_total"]
    if done is None:
        return Text("-")
    if not total:
        return Text(f"{done}")
    bar = ProgressBar(total=total, completed=min(done, total), width=10 if narrow else 20)
    label = Text(f" {done}/{total}" if narrow else f" {done}/{total} ({100 * done / total:.0f}%)")
    grid = Table.grid()
    grid.add_row(bar, label)
    return grid


def runway_text(forecast: dict[str, Any]) -> Text:
    free, full_in = forecast["disk_free_bytes"], forecast["disk_full_in_s"]
    if free is None:
        return Text("-")
    text = Text(f"{format_bytes(free)} free")
    if full_in is not None:
        text.append(f", full in {format_duration(full_in)}")
    if forecast["will_fit"] is False:
        text.append(" WON'T FIT", style="bold red")
    return text


NARROW_COLUMNS = ("ID", "NAME", "STATE", "PROGRESS", "RATE", "ETA", "ALERTS")
"""What a terminal narrower than WIDE_COLUMNS_MIN shows."""
WIDE_COLUMNS_MIN = 150


SHRINKING_COLUMNS = ("NAME", "ALERTS")
"""The columns that give way when the table is wider than the terminal (NAME first, the
widest): a long name ends in `…` on its one line; the other columns keep their width."""
NAME_MIN_WIDTH = 24
"""A name keeps this many characters on a terminal of WIDE_COLUMNS_MIN or more (it was 8,
and at 160 columns names were cut to 11); 8 on a narrower one."""


def jobs_table(jobs: Sequence[dict[str, Any]], width: int | None = None) -> Group:
    """One row per job; on a terminal narrower than WIDE_COLUMNS_MIN (`width`), only
    NARROW_COLUMNS, so the progress bars stay readable. The disk runway, a fact of the
    filesystem that its jobs share, is a line under the table per runway, not a column
    repeating it on every row (`disk_lines`)."""
    columns = ("ID", "NAME", "STATE", "PROGRESS", "RATE", "ETA", "WRITTEN",
               "CPU", "RSS", "GPU", "ALERTS")
    narrow = width is not None and width < WIDE_COLUMNS_MIN
    table = Table(box=None, header_style="bold", expand=False)
    for column in columns:
        table.add_column(column, no_wrap=column not in SHRINKING_COLUMNS,
                         min_width=None if column != "NAME" else 8 if narrow
                         else NAME_MIN_WIDTH)
    for job in jobs:
        f, p, r = job["forecast"], job["progress"], job["resources"]
        alerts = ", ".join(a["rule"] for a in job.get("alerts", []))
        written = format_bytes(p["bytes_written"]) if p["files"] else "-"
        if f["projected_total_bytes"]:
            written += f" / {format_bytes(f['projected_total_bytes'])}"
        running = job["state"] == "running"
        table.add_row(
            job["id"], Text(job["name"], no_wrap=True, overflow="ellipsis"),
            state_text(job["state"]), progress_cell(job, narrow),
            rate_text(f["rate_items_per_s"]), format_duration(f["eta_s"]), written,
            f"{r['cpu_percent']:.0f}%" if running else "-",
            format_bytes(r["rss_bytes"]) if running else "-",
            gpu_cell(r),
            Text(alerts, style="bold red") if alerts else "",
        )
    if narrow:
        keep = [columns.index(name) for name in NARROW_COLUMNS]
        table.columns = [table.columns[i] for i in keep]
    return Group(table, *disk_lines(jobs))


def disk_lines(jobs: Sequence[dict[str, Any]]) -> list[Text]:
    """`disk: 93.5 GB free, full in 4h05m — 3 jobs` once per distinct runway of the
    running jobs (the API names no filesystem: jobs showing the same runway share one),
    with the names of the jobs whose output will not fit."""
    runways: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        if job["state"] == "running" and job["forecast"]["disk_free_bytes"] is not None:
            forecast = {**job["forecast"], "will_fit": None}
            runways.setdefault(runway_text(forecast).plain, []).append(job)
    lines = []
    for text, members in runways.items():
        line = Text(f"disk: {text} — {len(members)} job{'s' * (len(members) != 1)}")
        short = [j["name"] for j in members if j["forecast"]["will_fit"] is False]
        if short:
            line.append(f"; WON'T FIT: {', '.join(short)}", style="bold red")
        lines.append(line)
    return lines


def sparkline(values: Sequence[float]) -> str:
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARK_CHARS[0] * len(values)
    return "".join(SPARK_CHARS[min(7, int(v / top * 7.999))] for v in values)


def rates_from_samples(samples: Sequence[dict[str, Any]], buckets: int = 40) -> list[float]:
    """Items per second between consecutive samples, averaged into `buckets` bins."""
    points = [(from_iso(s["t"]),
               s["items_done"]) for s in samples if s["items_done"] is not None]
    rates = []
    for (t0, n0), (t1, n1) in zip(points, points[1:], strict=False):
        if t1 > t0:
            rates.append(max(0.0, (n1 - n0) / (t1 - t0)))
    if len(rates) <= buckets:
        return rates
    size = len(rates) / buckets
    return [sum(rates[int(i * size):int((i + 1) * size)]) / max(1, int((i + 1) * size)
            - int(i * size)) for i in range(buckets)]


def job_detail(job: dict[str, Any], samples: Sequence[dict[str, Any]],
               width: int | None = None) -> Group:
    """The watch row of one job (for a terminal `width` wide) plus a sparkline of its
    rate."""
    rates = rates_from_samples(samples)
    line = Text("rate ", style="bold")
    line.append(sparkline(rates) or "(no progress yet)")
    if rates:
        line.append(f"  max {rate_text(max(rates))}")
    return Group(jobs_table([job], width), line)


def follow_jobs(client: Any, ids: Sequence[str], console: Console,
                interval_s: float = 1.0) -> bool:
    """A live table of these jobs until all have ended. True when every job ended well
    (`outcome.ended_well`)."""
    def fetch() -> list[dict[str, Any]]:
        return [client.get(f"/api/v1/jobs/{job_id}") for job_id in ids]

    jobs = fetch()
    with Live(jobs_table(jobs, console.width), console=console, auto_refresh=False) as live:
        while any(j["state"] in ("pending", "running") for j in jobs):
            time.sleep(interval_s)
            jobs = fetch()
            live.update(jobs_table(jobs, console.width), refresh=True)
    return all(ended_well(j) for j in jobs)
