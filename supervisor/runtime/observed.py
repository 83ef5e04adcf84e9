"""One line of `observed.jsonl` (`Observed`, `parse_observed`): a reading of the job as
its shim saw it, written by `runtime/publish.py` and read by `observe/remote.py`; and the
checks of job-written values (`int_or_none`, `float_or_none`, `str_or_none`, and for
this file's figures `_count`, `_size`, `_finite`) that every reader of an attempt's files
(`files.py`) applies: they trust no type. Stdlib only: the shim imports it.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypedDict


class ObservedGpu(TypedDict):
    """The tree's memory on one GPU, with the device's own figures (NVML index order)."""

    index: int
    name: str | None
    uuid: str | None
    memory_bytes: int
    used_bytes: int
    total_bytes: int


class Observed(TypedDict):
    """One line of `observed.jsonl`: the job as its shim saw it at `t`. The tree is the
    shim's descendants (the worker and what it spawned; the shim itself, whose own work
    includes taking these readings, is left out, but `cpu_time_s` counts what the shim
    reaped: the worker's and adopted orphans' time once they ended)."""

    seq: int
    """1, 2, ... per shim: a gap is a reading that could not be written."""
    t: float
    """The node's wall clock (seconds since the epoch) when the reading was taken."""
    node: str
    """The node's host name."""
    interval_s: float
    status: str | None
    """The worker's process state (running, sleeping, ...); None once it is gone."""
    num_procs: int
    num_threads: int
    cpu_time_s: float
    """Cumulative CPU seconds of the tree, with its reaped children."""
    rss_bytes: int
    read_bytes: int
    write_bytes: int
    gpu_memory_bytes: int | None
    """None: GPU reading off, or NVML absent or failing on the node."""
    gpu_devices: list[ObservedGpu] | None
    files: int | None
    """Items under `Observe.output_dir` matching its pattern; None without a scan."""
    bytes_written: int | None
    waiting: int
    """Output files still settling that this scan did not stat."""
    disk_free_bytes: int | None
    """Free bytes for unprivileged writers on the output (else cwd) filesystem."""
    disk_total_bytes: int | None
    disk_device: int | None
    """That filesystem's device number on the node (`st_dev`)."""
    final: bool
    """Taken after the worker ended, every settling file statted."""
    error: str | None
    """What part of the reading failed (its figures are then zero or None)."""

def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def float_or_none(value: Any) -> float | None:
    return (float(value) if isinstance(value, int | float) and not isinstance(value, bool)
            else None)


def str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None

def parse_observed(line: bytes) -> Observed | None:
    """One line of `observed.jsonl`, None unless it is a JSON object with a sequence
    number, a time and a node (a torn or foreign line). Fields of the wrong type or out
    of range (negative, NaN, beyond what a database column holds) read as zero or None:
    the job's node writes this file, and one bad figure must not fail the tick's insert
    of every job's samples."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    seq, t, node = _size(data.get("seq")), _finite(data.get("t")), str_or_none(data.get("node"))
    if seq is None or t is None or node is None:
        return None
    devices = data.get("gpu_devices")
    gpus = None if not isinstance(devices, list) else [
        ObservedGpu(index=_count(d.get("index")) or 0, name=str_or_none(d.get("name")),
                    uuid=str_or_none(d.get("uuid")), memory_bytes=_size(d.get("memory_bytes")) or 0,
                    used_bytes=_size(d.get("used_bytes")) or 0,
                    total_bytes=_size(d.get("total_bytes")) or 0)
        for d in devices if isinstance(d, dict)]
    return Observed(
        seq=seq, t=t, node=node[:255], interval_s=_finite(data.get("interval_s")) or 2.0,
        status=(str_or_none(data.get("status")) or "")[:32] or None,
        num_procs=_count(data.get("num_procs")) or 0,
        num_threads=_count(data.get("num_threads")) or 0,
        cpu_time_s=_finite(data.get("cpu_time_s")) or 0.0,
        rss_bytes=_size(data.get("rss_bytes")) or 0,
        read_bytes=_size(data.get("read_bytes")) or 0,
        write_bytes=_size(data.get("write_bytes")) or 0,
        gpu_memory_bytes=_size(data.get("gpu_memory_bytes")), gpu_devices=gpus,
        files=_count(data.get("files")), bytes_written=_size(data.get("bytes_written")),
        waiting=_count(data.get("waiting")) or 0,
        disk_free_bytes=_size(data.get("disk_free_bytes")),
        disk_total_bytes=_size(data.get("disk_total_bytes")),
        disk_device=_size(data.get("disk_device")), final=data.get("final") is True,
        error=(str_or_none(data.get("error")) or "")[:300] or None)


def _count(value: Any) -> int | None:
    """A count the job's node wrote: an int in [0, 2**31), else None (a database int4)."""
    whole = int_or_none(value)
    return whole if whole is not None and 0 <= whole < 2**31 else None


def _size(value: Any) -> int | None:
    """A byte figure or id the job's node wrote: an int in [0, 2**63), else None."""
    whole = int_or_none(value)
    return whole if whole is not None and 0 <= whole < 2**63 else None


def _finite(value: Any) -> float | None:
    """A time or duration the job's node wrote: a finite number >= 0, else None (NaN
    would be NULL in a NOT NULL column and fail the tick's whole insert)."""
    number = float_or_none(value)
    return number if number is not None and math.isfinite(number) and number >= 0 else None
