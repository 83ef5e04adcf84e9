"""argv: OUT. Writes up to 10,000 random 4 kB samples `OUT/NNNNN.bin` (each through a
`.tmp` file and a rename), one every 0.2 s, and reports each in the progress file
(`JOBSUP_PROGRESS_FILE`: unit `sample`, loss and lr metrics)."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    out = (sys.argv[1:] if argv is None else argv)[0]
    progress = os.environ["JOBSUP_PROGRESS_FILE"]
    os.makedirs(out, exist_ok=True)
    for i in range(10_000):
        with open(os.path.join(out, f".{i}.tmp"), "wb") as f:
            f.write(os.urandom(4096))
        os.replace(os.path.join(out, f".{i}.tmp"), os.path.join(out, f"{i:05d}.bin"))
        with open(progress + ".tmp", "w") as f:
            json.dump({"done": i + 1, "total": 10_000, "unit": "sample",
                       "metrics": {"loss": 2.0 / (1 + i), "lr": 1e-4}}, f)
        os.replace(progress + ".tmp", progress)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
