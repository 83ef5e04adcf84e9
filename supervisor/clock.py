"""The daemon's clock: wall-clock seconds that never jump, the same for every daemon of
one boot.

Every timeout and backoff of the daemon (stall, startup, stop backstop, restart backoff,
notification retries) is a difference of two readings of one clock, and many of those
readings are stored (a job's start, its samples, a restart's due time) and compared by
the next daemon after a restart. Read from the system clock, a step of that clock (NTP,
a VM resumed, an admin's `date -s`) would fire false stalls and SIGKILLs at once when it
jumps forward and hold them back by the jump when it jumps backward.

`SteadyClock` is the boot-time clock (CLOCK_BOOTTIME: monotonic, suspend included,
system-wide) plus a fixed epoch, `boot_epoch_s`: the system clock minus the boot-time
clock, taken when the boot's first daemon started (`SteadyClock.of_boot`). Its readings
look like Unix times (they are stored, compared with stored times, and shown), but move
only as real time passes. The epoch is kept in `DATA_DIR/clock.json` with the boot's id
(`procfs.this_boot_id`), so a daemon restarted in the same boot continues the clock the
stored times were taken on: a step between two daemons of one boot moves no timeout
either (#46). After a reboot the boot-time clock starts again from zero and the next
daemon takes the system clock as it is then; times stored in the earlier boot are off by
whatever the system clock was off then, once (`lifecycle.wait_over` bounds what that
does to a restart's due time).

A step of the system clock since the boot's first daemon start shows up in `offset_s()`
(logged when a daemon starts), and in no timeout: shown times stay on this clock until
the next boot, or until `clock.json` is deleted with no job running or waiting for a
restart. What another machine compares with (a webhook signature's timestamp, a
`Retry-After` date) and file mtimes (the output scan) use the system clock itself.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from supervisor.formatting import format_duration
from supervisor.runtime.fileio import atomic_write_json, read_json
from supervisor.runtime.procfs import this_boot_id

log = logging.getLogger(__name__)

CLOCK_FILE = "clock.json"
"""`DATA_DIR/clock.json` (`BootClock`): the epoch of this boot's daemon clock."""
OFFSET_LOGGED_S = 1.0
"""A daemon whose clock is this far from the system clock at its start says so."""


class BootClock(TypedDict):
    """`clock.json`."""

    boot_id: str
    """The boot it is valid in (`procfs.this_boot_id`)."""
    boot_epoch_s: float
    """The daemon clock's reading minus the boot-time clock's, in seconds."""


def boot_time_clock() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME): a suspended machine's
    hours count as time passed, as they do for the jobs' alerts and for the clock the
    next daemon starts from. Unaffected by steps of the system clock, like
    CLOCK_MONOTONIC (which it falls back to where it does not exist)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


class SteadyClock:
    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] | None = None, *,
                 boot_epoch_s: float | None = None):
        """`boot_epoch_s`: this boot's epoch as an earlier daemon took it; None: the
        system clock now (a clock of its own, as for a test's in-process engine)."""
        self._wall = wall
        self._monotonic = monotonic or boot_time_clock
        self.boot_epoch_s = (wall() - self._monotonic() if boot_epoch_s is None
                             else boot_epoch_s)

    @classmethod
    def of_boot(cls, data_dir: Path, *, boot_id: str | None = None,
                wall: Callable[[], float] = time.time,
                monotonic: Callable[[], float] | None = None) -> SteadyClock:
        """The clock of this boot on `data_dir`: the epoch `clock.json` records for this
        boot (`boot_id`, default `procfs.this_boot_id`), else the system clock now,
        recorded there for the next daemon of the boot. Where the boot has no id, or the
        file cannot be written (a read-only data dir), the next daemon takes the system
        clock again, as before #46."""
        boot_id = boot_id or this_boot_id()
        path = data_dir / CLOCK_FILE
        stored = read_json(path)
        if (boot_id is not None and isinstance(stored, dict)
                and stored.get("boot_id") == boot_id
                and isinstance(stored.get("boot_epoch_s"), (int, float))
                and math.isfinite(stored["boot_epoch_s"])):
            clock = cls(wall, monotonic, boot_epoch_s=float(stored["boot_epoch_s"]))
        else:
            clock = cls(wall, monotonic)
            if boot_id is not None:
                try:
                    atomic_write_json(path, BootClock(boot_id=boot_id,
                                                      boot_epoch_s=clock.boot_epoch_s))
                except OSError as exc:
                    log.warning("cannot record this boot's clock in %s (%s): a daemon "
                                "restarted in this boot takes the system clock again",
                                path, exc)
        offset_s = clock.offset_s()
        if abs(offset_s) >= OFFSET_LOGGED_S:
            log.warning("the system clock is %s %s the daemon's clock, which it has been "
                        "stepped by since this boot's first daemon start: timeouts and "
                        "shown times stay on the daemon's clock until the next boot "
                        "(docs/reliability.md)", format_duration(abs(offset_s)),
                        "ahead of" if offset_s > 0 else "behind")
        return clock

    def __call__(self) -> float:
        """Seconds since the epoch as of this boot's first daemon start, advanced
        monotonically."""
        return self.boot_epoch_s + self._monotonic()

    def offset_s(self) -> float:
        """How far the system clock has stepped away from this clock (positive: the
        system clock is ahead)."""
        return self._wall() - self()
