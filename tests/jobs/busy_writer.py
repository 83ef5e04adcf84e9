"""argv: OUT N DELAY. Starts a child that keeps a quarter of a core busy (10 ms of work
in every 40 ms), then writes N 1000-byte items `OUT/itemNNNN.bin` (each through a `.tmp`
file and a rename) DELAY seconds apart, then sleeps until it is stopped: a job of two
processes with CPU, memory, output files and a hang after its last item."""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import item_writer  # noqa: E402 - the sibling job: the same items, written the same way

SPIN = """
import time
while True:
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass
    time.sleep(0.03)
"""


def main() -> None:
    out, n, delay = sys.argv[1:4]
    subprocess.Popen([sys.executable, "-c", SPIN])
    item_writer.main([out, n, delay, "files", "3600"])  # the items, then the hang


if __name__ == "__main__":
    main()
