"""How every surface writes times, sizes and durations: the API and webhooks (ISO 8601
UTC), and what people read (the CLI, the live table, Slack, alert messages, warnings).
One place, so that a job's ETA or output size reads the same in a terminal and in Slack.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import overload

MISSING = "-"
"""What a value not known yet reads as."""

_TERMINAL_CONTROLS = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"            # CSI: colours, cursor moves, erase (ESC [ ... m)
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: window titles, hyperlinks
    r"|\x1b[ -/]*[0-~]?"                    # other escapes (ESC ( B, ESC 7, a lone ESC)
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # other C0 controls and DEL: NUL, BEL, ...
"""What a terminal interprets instead of showing. The page's log pane removes the same
(supervisor/api/static/job.js, TERMINAL_CONTROLS)."""


def terminal_text(text: str) -> str:
    """`text` as a terminal shows it, less its layout: escape sequences (ANSI colours,
    cursor moves, OSC titles and links) and control characters other than tab, newline
    and carriage return removed (a NUL or a colour code is noise in Slack, a webhook or
    an alert's cause). Carriage returns stay: tqdm's redraws are read by `log_line`."""
    return _TERMINAL_CONTROLS.sub("", text)


_BYTE_UNITS = (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def iso(t: float | None) -> str | None:
    """Seconds since the epoch -> ISO 8601 UTC (`2026-11-29T14:18:15.123456Z`)."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


@overload
def from_iso(text: str) -> float: ...
@overload
def from_iso(text: None) -> None: ...
def from_iso(text: str | None) -> float | None:
    """ISO 8601 (as `iso` writes it, or with an offset) -> seconds since the epoch."""
    if text is None:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def format_bytes(n: float | None) -> str:
    """Decimal units (1 GB = 10**9 bytes), as `df -H` and disk vendors count:
    `512 B`, `83.0 MB`, `3.2 TB`."""
    if n is None or not math.isfinite(n):
        return MISSING
    for unit, size in _BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_duration(seconds: float | None) -> str:
    """A span for people, two units at most: `45s`, `4m10s`, `1h05m`, `2d07h`.
    Negative spans read as 0s."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"
    return f"{hours // 24}d{hours % 24:02d}h"


def format_number(value: float | None, spec: str = "%.3g") -> str:
    """A reading for people in `%`-style `spec` (`%.0f`, `%.6g`), `-` where it is not
    known or not finite: a cell's missing value never fails the page around it."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        return MISSING
    return spec % value
