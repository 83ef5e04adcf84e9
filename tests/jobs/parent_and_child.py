"""Starts a child that sleeps 60 s, prints the child's pid, and sleeps 60 s itself."""

from __future__ import annotations

import subprocess
import sys
import time


def main() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)


if __name__ == "__main__":
    main()
