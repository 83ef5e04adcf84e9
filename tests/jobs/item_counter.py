"""argv: OUT PIDS STOP. Appends its pid to `PIDS/<JOBSUP_JOB_ID>`, then until the file
STOP exists writes a 100-byte item `OUT/item_NNNNN.txt` every 0.2 s and reports the count
in the progress file (`JOBSUP_PROGRESS_FILE`: no total, unit `items`, a `step` metric)."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    out, pids, stop = (sys.argv[1:] if argv is None else argv)[:3]
    with open(os.path.join(pids, os.environ["JOBSUP_JOB_ID"]), "a") as f:
        f.write(f"{os.getpid()}\n")
    progress = os.environ["JOBSUP_PROGRESS_FILE"]
    done = 0
    while not os.path.exists(stop):
        done += 1
        with open(os.path.join(out, f"item_{done:05d}.txt"), "w") as f:
            f.write("x" * 100)
        with open(progress + ".tmp", "w") as f:
            json.dump({"done": done, "total": None, "unit": "items", "metrics": {"step": done}},
                      f)
        os.replace(progress + ".tmp", progress)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
