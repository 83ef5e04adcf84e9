"""argv: PIDS_FILE. Ignores SIGTERM, starts a child that ignores it too, writes `PID
CHILD_PID` to PIDS_FILE, and sleeps 600 s: only SIGKILL of both ends the tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> None:
    pids_file = (sys.argv[1:] if argv is None else argv)[0]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(pids_file, "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


if __name__ == "__main__":
    main()
