"""Reports progress forever, one step every 0.3 s, into the progress file
(`JOBSUP_PROGRESS_FILE`, total 10**6); it waits with `threading.Event().wait`."""

from __future__ import annotations

import json
import os
import threading


def main() -> None:
    path = os.environ["JOBSUP_PROGRESS_FILE"]
    for i in range(10**6):
        with open(path + ".tmp", "w") as f:
            json.dump({"done": i, "total": 10**6}, f)
        os.replace(path + ".tmp", path)
        threading.Event().wait(0.3)


if __name__ == "__main__":
    main()
