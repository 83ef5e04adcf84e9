"""argv: OUT N DELAY MODE [LINGER]. Writes N 1000-byte items `OUT/itemNNNN.bin` (each
through a `.tmp` file and a rename), DELAY seconds apart, then sleeps LINGER seconds.
MODE `report` also writes the progress file (`JOBSUP_PROGRESS_FILE`) after each item,
with a loss metric; `tqdm` prints a tqdm-style bar on stdout; anything else neither."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    out, n, delay, mode = args[0], int(args[1]), float(args[2]), args[3]
    os.makedirs(out, exist_ok=True)
    progress = os.environ["JOBSUP_PROGRESS_FILE"] if mode == "report" else None
    for i in range(n):
        time.sleep(delay)
        tmp = os.path.join(out, f".item{i}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"x" * 1000)
        os.replace(tmp, os.path.join(out, f"item{i:04d}.bin"))
        if progress:
            with open(progress + ".tmp", "w") as f:
                json.dump({"done": i + 1, "total": n, "unit": "item",
                           "metrics": {"loss": 1.0 / (i + 1)}}, f)
            os.replace(progress + ".tmp", progress)
        if mode == "tqdm":
            print(f"\r{i + 1}/{n} |###| {i + 1}/{n} [00:01<00:02, 5.00it/s]", end="")
    time.sleep(float(args[4]) if len(args) > 4 else 0)


if __name__ == "__main__":
    main()
