"""The daemon's clock: wall-clock seconds that never jump.

Every timeout and backoff of the daemon (stall, startup, stop backstop, restart backoff,
notification retries) is a difference of two readings of one clock. Read from the
system clock, a step of that clock (NTP, a VM resumed, an admin's `date -s`) would fire
false stalls and SIGKILLs at once when it jumps forward and hold them back by the jump
when it jumps backward. `SteadyClock` reads the system clock once, when the daemon
starts, and advances from there by the boot-time clock (monotonic, suspend included):
its readings look like Unix times (they are stored, compared with stored times, and
shown), but move only as real time passes. A step of the system clock while the daemon
runs shows up in `offset_s()`, and in no timeout; the next daemon start takes the clock
as it is then (so times stored before a step are off by it, once). What another
machine compares with (a webhook signature's timestamp, a `Retry-After` date) and file
mtimes (the output scan) use the system clock itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def boot_time_clock() -> float:
    """Seconds since boot, suspend included (CLOCK_BOOTTIME): a suspended machine's
    hours count as time passed, as they do for the jobs' alerts and for the clock the
    next daemon starts from. Unaffected by steps of the system clock, like
    CLOCK_MONOTONIC (which it falls back to where it does not exist)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


class SteadyClock:
    def __init__(self, wall: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] | None = None):
        self._wall = wall
        self._monotonic = monotonic or boot_time_clock
        self._monotonic_at_start = self._monotonic()
        self._wall_at_start = wall()

    def __call__(self) -> float:
        """Seconds since the epoch as of the daemon's start, advanced monotonically."""
        return self._wall_at_start + (self._monotonic() - self._monotonic_at_start)

    def offset_s(self) -> float:
        """How far the system clock has stepped away from this clock since the start
        (positive: the system clock is ahead)."""
        return self._wall() - self()
