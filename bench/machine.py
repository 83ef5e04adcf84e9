"""What machine a benchmark ran on, for its printed table (shared by the scripts here)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe(*extra: str) -> str:
    """`2-core VM (AMD EPYC ...), Linux 6.x, Python 3.11.7[, extra...]`."""
    parts = [f"{os.cpu_count()}-core VM ({cpu_model()})", f"Linux {platform.release()}",
             f"Python {platform.python_version()}", *extra]
    return ", ".join(parts)
