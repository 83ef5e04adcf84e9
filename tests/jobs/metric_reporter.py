"""argv: OUT N DELAY. Writes N 1000-byte items `OUT/itemNNNN.bin`, DELAY seconds apart,
reporting each in the progress file (`JOBSUP_PROGRESS_FILE`) with `loss` and `accuracy`
metrics, and printing `step i/N loss=...` to stdout."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    out, n, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    os.makedirs(out, exist_ok=True)
    progress = os.environ["JOBSUP_PROGRESS_FILE"]
    for i in range(1, n + 1):
        time.sleep(delay)
        with open(os.path.join(out, f"item{i:04d}.bin"), "wb") as f:
            f.write(b"x" * 1000)
        loss, accuracy = 2.0 / i, 1.0 - 1.0 / (i + 1)
        with open(progress + ".tmp", "w") as f:
            json.dump({"done": i, "total": n, "unit": "item",
                       "metrics": {"loss": loss, "accuracy": accuracy}}, f)
        os.replace(progress + ".tmp", progress)
        print(f"step {i}/{n} loss={loss:.4f}")


if __name__ == "__main__":
    main()
