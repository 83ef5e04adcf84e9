"""argv: FLAG [EXIT_CODE]. Waits until the file FLAG exists, then exits EXIT_CODE (0)."""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    while not os.path.exists(args[0]):
        time.sleep(0.05)
    return int(args[1]) if len(args) > 1 else 0


if __name__ == "__main__":
    sys.exit(main())
