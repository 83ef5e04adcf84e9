"""Makes stdout (its log) one 300 MB line (a hole: NULs on no disk) ending with an error
message, touches `$JOBSUP_PROGRESS_FILE.exiting`, and exits 3."""

from __future__ import annotations

import os
import sys


def main() -> int:
    os.ftruncate(1, 300 * 2**20)
    os.write(1, b"RuntimeError: the end of a very long line")
    open(os.environ["JOBSUP_PROGRESS_FILE"] + ".exiting", "w").close()
    return 3


if __name__ == "__main__":
    sys.exit(main())
