"""Time formatting of the public contract: ISO 8601 UTC strings in JSON."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(t: float | None) -> str | None:
    """Seconds since the epoch -> ISO 8601 UTC (`2026-11-29T14:18:15.123456Z`)."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
