"""argv: OUT N DELAY. Starts a child that keeps a quarter of a core busy (10 ms of work
in every 40 ms), then writes N 1000-byte items `OUT/itemNNNN.bin` (each through a `.tmp`
file and a rename) DELAY seconds apart, then sleeps until it is stopped: a job of two
processes with CPU, memory, output files and a hang after its last item."""

from __future__ import annotations

import os
import subprocess
import sys
import time

SPIN = """
import time
while True:
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass
    time.sleep(0.03)
"""


def main() -> None:
    out, n, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    subprocess.Popen([sys.executable, "-c", SPIN])
    os.makedirs(out, exist_ok=True)
    for i in range(n):
        time.sleep(delay)
        tmp = os.path.join(out, f".item{i}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
        os.replace(tmp, os.path.join(out, f"item{i:04d}.bin"))
    time.sleep(3600)


if __name__ == "__main__":
    main()
