"""Ignores SIGTERM and never ends on its own: only SIGKILL stops it."""

from __future__ import annotations

import signal


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
