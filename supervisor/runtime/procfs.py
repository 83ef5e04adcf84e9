"""Process identity and state read straight from /proc: the one parser of
`/proc/<pid>/stat` (stdlib only: the shim imports it).

A pid alone names a process only until it is reused; jobsup identifies a process by
(pid, start_ticks, boot id): its start time after boot in clock ticks, which the kernel
fixes at fork and no clock adjustment moves, and the boot it started in (`this_boot_id`),
since start ticks count again from zero at every boot. The create time (boot time plus
start ticks, computed exactly as psutil does) is kept beside them for people and for
files written before start ticks were recorded; it is not an identity across processes:
/proc/stat's boot time is the wall clock minus the time since boot, so it moves whenever
the wall clock is stepped or slewed (NTP), and two processes that read it at different
times compute create times seconds, or a step's hours, apart for one process.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Iterator
from functools import cache
from typing import NamedTuple

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""Clock ticks per second (USER_HZ, 100 on Linux): the unit of the start time and CPU
times in /proc/<pid>/stat."""
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
"""Bytes per page: the unit of the resident set size in /proc/<pid>/stat."""
CREATE_TIME_TOLERANCE_S = 0.015
"""Seconds by which two create times of one process may differ and still name it.

A create time is boot time + start ticks / CLOCK_TICKS, rounded to 0.01 s (as psutil
does): one process read twice gives the same value, but one computed elsewhere (psutil,
an older daemon, a float through JSON) may land one 10 ms tick or rounding step away.
0.015 s accepts that one step and nothing more: a process under the same pid whose
start is two ticks (20 ms) or more away is another one. (A pid reused within one tick of its
last holder's start would pass; cycling through pid_max that fast does not happen.)"""


OTHER_BOOT_S = 3600.0
"""For a record with start ticks but no boot id (written by a shim or daemon older than
boot ids): start ticks count from boot, so after a reboot a stranger may hold a recorded
pid with the same start tick (early boot services start alike each boot). Its create time
is then off by the previous boot's whole uptime plus the downtime: a process whose create
time is this far from the recorded one is taken for one of another boot. A wall-clock
step of more than this moves create times as far, and such a record's process is then
taken for a stranger too; a record with a boot id is compared by it instead
(`is_started_at`), whatever the clock did."""

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""A random UUID the kernel makes at each boot (the same in every container of the
machine): with start ticks, it tells a process of this boot from one of another."""


class ProcStat(NamedTuple):
    """The fields of /proc/<pid>/stat that jobsup uses (proc(5); the field numbers
    below count from 1, as there). The first five keep their tuple positions."""

    state: str
    """(3) R, S, D, Z, T, t, X, I, ..."""
    ppid: int
    """(4)"""
    pgid: int
    """(5) process group id."""
    session: int
    """(6)"""
    start_ticks: int
    """(22) start time after boot, in clock ticks (`start_ticks_to_time`)."""
    cpu_ticks: int
    """(14-17) utime + stime + cutime + cstime: own CPU time plus that of reaped
    children, in clock ticks (`CLOCK_TICKS`)."""
    num_threads: int
    """(20)"""
    rss_pages: int
    """(24) resident set size in pages (`PAGE_SIZE`)."""
    pid: int
    """(1), or the pid the caller read it under (a /proc seen through another mount)."""


def parse_stat(raw: bytes, pid: int | None = None) -> ProcStat | None:
    """The record of the bytes of /proc/<pid>/stat, None when they are not one.

    The command name sits in parentheses and may itself contain spaces or ')', so the
    fields are split after its last ')'. `pid` defaults to the file's first field."""
    end = raw.rfind(b")")
    if end < 0:
        return None
    f = raw[end + 2 :].split(b" ", 22)  # fields 3..24 (+ the rest, unsplit): what is used
    try:
        return ProcStat(  # positional: a sampler's pass builds one per process
            chr(f[0][0]), int(f[1]), int(f[2]), int(f[3]), int(f[19]),
            int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]), int(f[17]), int(f[21]),
            pid if pid is not None else int(raw.split(b" ", 1)[0]),
        )
    except (IndexError, ValueError):
        return None


StatReader = Callable[[int], "ProcStat | None"]
"""pid -> its `ProcStat`, None when it is gone (`read_stat`, or a reader of kept files)."""


@cache
def _boot_time() -> float:
    """Seconds since the epoch at boot (`btime` of /proc/stat)."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime"):
                return float(line.split()[1])
    raise RuntimeError("/proc/stat has no btime line")


@cache
def this_boot_id() -> str | None:
    """The id of the boot this process runs in (`BOOT_ID_PATH`), None where it cannot be
    read (then identities fall back to create times). Read once: a process never
    outlives its boot."""
    try:
        with open(BOOT_ID_PATH, "rb") as f:
            return boot_id_or_none(f.read(64).decode("ascii", "replace").strip())
    except OSError:
        return None


def boot_id_or_none(value: object) -> str | None:
    """`value` if it has the form of a boot id (a lower-case UUID, 36 characters), else
    None: the attempt's files are the job's to write, and the database column holds 36."""
    if (isinstance(value, str) and len(value) == 36
            and all(c in "0123456789abcdef-" for c in value)):
        return value
    return None


def start_ticks_to_time(start_ticks: int) -> float:
    """Clock ticks since boot -> seconds since the epoch, rounded like psutil."""
    return round(_boot_time() + start_ticks / CLOCK_TICKS, 2)


def start_ticks_of(pid: int) -> int | None:
    """The process's start time after boot in clock ticks, None if it is gone."""
    stat = read_stat(pid)
    return stat.start_ticks if stat else None


def is_started_at(stat: ProcStat, start_ticks: int | None, create_time: float | None,
                  boot_id: str | None = None) -> bool:
    """`stat` is of the process recorded with these start ticks in this boot (exact, and
    the recorded boot id is this boot's: no wall-clock time is compared), or, for a record
    without a boot id, within OTHER_BOOT_S of its create time (not a namesake from another
    boot); for a record without start ticks (written by an older shim), with this create
    time."""
    if start_ticks is not None:
        if stat.start_ticks != start_ticks:
            return False
        here = this_boot_id()
        if boot_id is not None and here is not None:
            return boot_id == here
        return create_time is None or abs(
            start_ticks_to_time(stat.start_ticks) - create_time) < OTHER_BOOT_S
    return create_time is not None and same_create_time(
        start_ticks_to_time(stat.start_ticks), create_time)


def same_create_time(a: float, b: float) -> bool:
    """Two create times name the same process (`CREATE_TIME_TOLERANCE_S`)."""
    return abs(a - b) < CREATE_TIME_TOLERANCE_S


def read_small(path: str) -> bytes:
    """The bytes of a small /proc file (one read of up to 4 KiB: /proc/<pid>/stat and io
    fit). `os.open`/`os.read` rather than `open()`: no buffered file object, half the
    CPU of a sampler's pass over every process. OSError when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def read_stat(pid: int | str, proc_root: str = "/proc") -> ProcStat | None:
    """`parse_stat` of <proc_root>/<pid>/stat, None when the process is gone."""
    try:
        return parse_stat(read_small(f"{proc_root}/{pid}/stat"), int(pid))
    except (OSError, ValueError):
        return None


def all_stats(proc_root: str = "/proc") -> Iterator[ProcStat]:
    """The record of every process, in one listing of `proc_root`; processes that
    vanish during the pass are skipped."""
    for name in os.listdir(proc_root):
        if name.isdigit():
            stat = read_stat(name, proc_root)
            if stat is not None:
                yield stat


def create_time(pid: int) -> float | None:
    """The process's create time in seconds since the epoch, None if it is gone."""
    stat = read_stat(pid)
    return start_ticks_to_time(stat.start_ticks) if stat else None


def process_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, D, Z, ...), None if gone."""
    stat = read_stat(pid)
    return stat.state if stat else None


def is_same_process(pid: int | None, expected_create_time: float | None,
                    expected_start_ticks: int | None = None,
                    expected_boot_id: str | None = None) -> bool:
    """True when `pid` is alive, not a zombie, and is the process recorded with these
    start ticks and boot id (or, without them, this create time: `is_started_at`)."""
    if pid is None:
        return False
    stat = read_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return False
    return is_started_at(stat, expected_start_ticks, expected_create_time, expected_boot_id)


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
