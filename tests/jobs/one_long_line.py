"""Writes `start`, then one line of 50 MiB of `A`s ending `END`, to stdout; sleeps 120 s."""

from __future__ import annotations

import os
import time


def main() -> None:
    os.write(1, b"start\n" + b"A" * (50 * 2**20) + b"END\n")
    time.sleep(120)


if __name__ == "__main__":
    main()
