"""A small job for the Quickstart demo: writes N item files at a steady pace and reports
progress through JOBSUP_PROGRESS_FILE, like a cooperating worker.

`python -m supervisor.demo_job --out DIR --items 40 --seconds-per-item 0.1`
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from supervisor.fileio import atomic_write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory for the items")
    parser.add_argument("--items", type=int, default=40, help="how many items to write")
    parser.add_argument("--seconds-per-item", type=float, default=0.1)
    parser.add_argument("--item-bytes", type=int, default=64 * 1024)
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    progress_file = os.environ.get("JOBSUP_PROGRESS_FILE")
    done = len(list(args.out.glob("item-*.bin")))  # resumable: count what exists
    print(f"demo job: writing {args.items} items to {args.out} (resuming at {done})")
    while done < args.items:
        time.sleep(args.seconds_per_item)
        final = args.out / f"item-{done:05d}.bin"
        tmp = args.out / f".{final.name}.tmp"
        tmp.write_bytes(os.urandom(args.item_bytes))
        os.replace(tmp, final)
        done += 1
        if progress_file:
            atomic_write_json(progress_file, {"done": done, "total": args.items,
                                              "unit": "item", "metrics": {}})
        print(f"item {done}/{args.items}")
    print("demo job: done")


if __name__ == "__main__":
    main()
