"""argv: PIDS SECONDS. Appends its pid to `PIDS/<JOBSUP_JOB_ID>` and sleeps SECONDS."""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    pids, seconds = (sys.argv[1:] if argv is None else argv)[:2]
    with open(os.path.join(pids, os.environ["JOBSUP_JOB_ID"]), "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(seconds))


if __name__ == "__main__":
    main()
