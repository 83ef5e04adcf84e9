"""argv: OUT. Creates up to 10,000 empty items `OUT/itemN.bin`, one every 0.05 s, and
reports each in the progress file (`JOBSUP_PROGRESS_FILE`, total 10,000)."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    out = (sys.argv[1:] if argv is None else argv)[0]
    os.makedirs(out, exist_ok=True)
    progress = os.environ["JOBSUP_PROGRESS_FILE"]
    for i in range(10_000):
        open(os.path.join(out, f"item{i}.bin"), "wb").close()
        with open(progress + ".tmp", "w") as f:
            json.dump({"done": i + 1, "total": 10_000}, f)
        os.replace(progress + ".tmp", progress)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
