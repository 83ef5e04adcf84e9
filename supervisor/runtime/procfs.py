"""Process identity read straight from /proc.

A pid alone names a process only until it is reused; jobsup identifies a process by
(pid, create_time), the create time computed exactly as psutil does (boot time plus
the start time in clock ticks), so both agree to the tick.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterator
from functools import cache


@cache
def _boot_time() -> float:
    """Seconds since the epoch at boot (`btime` of /proc/stat)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime line")


@cache
def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def parse_stat(raw: bytes) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, pgid, session, start_ticks) from the bytes of /proc/<pid>/stat.

    The command name sits in parentheses and may itself contain spaces or ')', so the
    fields are split after its last ')'.
    """
    end = raw.rfind(b")")
    if end < 0:
        return None
    fields = raw[end + 2 :].split()
    try:
        return (
            fields[0].decode(),
            int(fields[1]),
            int(fields[2]),
            int(fields[3]),
            int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def start_ticks_to_time(start_ticks: int) -> float:
    """Clock ticks since boot -> seconds since the epoch, rounded like psutil."""
    return round(_boot_time() + start_ticks / _clock_ticks(), 2)


def read_stat(pid: int | str) -> tuple[str, int, int, int, int] | None:
    """`parse_stat` of /proc/<pid>/stat, None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return parse_stat(f.read())
    except OSError:
        return None


def all_stats() -> Iterator[tuple[int, tuple[str, int, int, int, int]]]:
    """(pid, parsed stat) of every process, in one pass over /proc; processes that
    vanish during the pass are skipped."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            parsed = read_stat(entry.name)
            if parsed is not None:
                yield int(entry.name), parsed


def create_time(pid: int) -> float | None:
    """The process's create time in seconds since the epoch, None if it is gone."""
    parsed = read_stat(pid)
    return start_ticks_to_time(parsed[4]) if parsed else None


def process_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, D, Z, ...), None if gone."""
    parsed = read_stat(pid)
    return parsed[0] if parsed else None


def is_same_process(pid: int | None, expected_create_time: float | None) -> bool:
    """True when `pid` is alive, not a zombie, and is the process created at that time."""
    if pid is None or expected_create_time is None:
        return False
    parsed = read_stat(pid)
    if parsed is None or parsed[0] in ("Z", "X"):
        return False
    return abs(start_ticks_to_time(parsed[4]) - expected_create_time) < 0.015


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send `sig` to a process group; False when the group is already gone (ESRCH)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as exc:  # a reused pgid of another user: never ours
        if exc.errno == errno.EPERM:
            return False
        raise
    return True


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists (signal 0 probes without sending)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
