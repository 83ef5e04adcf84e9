"""argv: RUNS FLAG [EXIT_CODE]. Appends its pid to `RUNS/<JOBSUP_JOB_ID>` as it starts
(one line per run of the command: what a test counts), waits until the file FLAG exists,
then exits EXIT_CODE (0)."""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    with open(os.path.join(args[0], os.environ["JOBSUP_JOB_ID"]), "a") as f:
        f.write(f"{os.getpid()}\n")
    while not os.path.exists(args[1]):
        time.sleep(0.05)
    return int(args[2]) if len(args) > 2 else 0


if __name__ == "__main__":
    sys.exit(main())
