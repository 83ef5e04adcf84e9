"""Writes ~300 MB of tqdm redraws (`\\r`, no newline) to stdout, ending with the 100%
one, touches `$JOBSUP_PROGRESS_FILE.written`, and sleeps 120 s."""

from __future__ import annotations

import os
import time


def main() -> None:
    bar = b"".join(b"\r%3d%%|####      | %d/1000000 [00:10<00:12, 45.0it/s]" % (i // 10000, i)
                   for i in range(20000))  # ~1 MiB of redraws
    for _ in range(300 * 2**20 // len(bar)):
        os.write(1, bar)
    os.write(1, b"\r100%|##########| 1000000/1000000 [00:22<00:00, 45.0it/s]")
    open(os.environ["JOBSUP_PROGRESS_FILE"] + ".written", "w").close()
    time.sleep(120)


if __name__ == "__main__":
    main()
