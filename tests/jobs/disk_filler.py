"""argv: OUT. Fills OUT's filesystem with items `OUT/NNNNN.bin`: 256 kB ones, then 4 kB
ones for the last bytes; once full, waits and retries (it never ends on its own)."""

from __future__ import annotations

import contextlib
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    out = (sys.argv[1:] if argv is None else argv)[0]
    os.makedirs(out, exist_ok=True)
    i, size = 0, 262144
    while True:
        try:
            with open(os.path.join(out, f".{i}.tmp"), "wb") as f:
                f.write(b"x" * size)
            os.replace(os.path.join(out, f".{i}.tmp"), os.path.join(out, f"{i:05d}.bin"))
            i += 1
            time.sleep(0.05)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(out, f".{i}.tmp"))
            if size > 4096:
                size = 4096
            else:
                time.sleep(0.2)


if __name__ == "__main__":
    main()
