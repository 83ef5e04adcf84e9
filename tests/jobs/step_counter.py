"""Counts steps forever, one every 0.2 s, into the progress file (`JOBSUP_PROGRESS_FILE`:
done = the step, no total, unit `steps`)."""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    path = os.environ["JOBSUP_PROGRESS_FILE"]
    i = 0
    while True:
        i += 1
        with open(path + ".tmp", "w") as f:
            json.dump({"done": i, "total": None, "unit": "steps"}, f)
        os.replace(path + ".tmp", path)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
