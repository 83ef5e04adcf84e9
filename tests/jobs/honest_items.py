"""argv: OUT N. Writes N one-byte items `OUT/item-NNN`, 0.15 s apart, reporting each in
the progress file (`JOBSUP_PROGRESS_FILE`), then lingers 1.5 s (three sample intervals:
the last report is seen before the exit)."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    out, n = args[0], int(args[1])
    progress = os.environ["JOBSUP_PROGRESS_FILE"]
    for i in range(1, n + 1):
        with open(os.path.join(out, f"item-{i:03d}"), "w") as f:
            f.write("x")
        with open(progress + ".tmp", "w") as f:
            json.dump({"done": i, "total": n}, f)
        os.replace(progress + ".tmp", progress)
        time.sleep(0.15)
    time.sleep(1.5)


if __name__ == "__main__":
    main()
