"""argv: LOG READY. Records every catchable signal it gets (SIGTERM, SIGINT, SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2: one number a line in LOG), touches READY once set up, and
never ends on its own: a stranger process that must not be signalled."""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType


def main(argv: list[str] | None = None) -> None:
    log, ready = (sys.argv[1:] if argv is None else argv)[:2]

    def note(signum: int, _frame: FrameType | None) -> None:
        with open(log, "a") as f:
            f.write(f"{signum}\n")

    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), note)
    open(ready, "w").close()
    while True:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
