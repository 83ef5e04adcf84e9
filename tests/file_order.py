"""The order in which the suite's files start: longest first (LPT scheduling).

`./dev.sh test` runs the files on 3 xdist workers, one file per worker at a time
(`--dist loadfile --no-loadscope-reorder`). A worker that starts a 2-minute file near
the end keeps the run going minutes after the others are done; started first, the long
files overlap with everything else. `FILE_SECONDS` (`tests/file_seconds.json`) holds each
file's measured seconds on the CI machine's size (2 cores); a file not listed there (a
new one) counts as `NEW_FILE_S` until the list is refreshed (files the report lacks keep
their time):

    .venv/bin/pytest -n 3 --dist loadfile --junitxml=/tmp/suite.xml
    .venv/bin/python -m tests.file_order /tmp/suite.xml

The order changes only when each file starts, never which tests run or their result."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest

FILE_SECONDS_PATH = Path(__file__).with_name("file_seconds.json")
NEW_FILE_S = 10.0
"""What a file not in `file_seconds.json` counts as: about a typical file's time."""


def file_seconds(path: Path = FILE_SECONDS_PATH) -> dict[str, float]:
    """Each test file's seconds by its path from the repository root (`tests/test_x.py`);
    empty if the list is missing."""
    try:
        return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_files_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Sort `items` in place so that files run longest first; tests keep their order
    within a file, and files of equal time their collection order."""
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        first_index.setdefault(item.nodeid.split("::", 1)[0], index)
    items.sort(key=lambda item: _file_key(item, seconds, first_index))


def _file_key(item: pytest.Item, seconds: dict[str, float],
              first_index: dict[str, int]) -> tuple[float, int]:
    name = item.nodeid.split("::", 1)[0]
    return -seconds.get(name, NEW_FILE_S), first_index[name]


def seconds_from_junit(report: Path) -> dict[str, float]:
    """Each file's total seconds (setup, call and teardown of its tests) from a pytest
    `--junitxml` report, rounded to a tenth."""
    totals: dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        # classname is `tests.test_x` or `tests.test_x.TestClass`; "" for a collection
        # error or a module-level skip, which name no test file
        parts = [part for part in case.get("classname", "").split(".")
                 if part and not part[:1].isupper()]
        if parts:
            totals["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return {name: round(total, 1) for name, total in sorted(totals.items())}


def refreshed(known: dict[str, float], measured: dict[str, float],
              root: Path) -> dict[str, float]:
    """`known` updated with `measured`: a file the report lacks (a run of a few files,
    `-m` filtered, or the file skipped) keeps its last time while it exists."""
    kept = {name: seconds for name, seconds in known.items() if (root / name).is_file()}
    return dict(sorted({**kept, **measured}.items()))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m tests.file_order JUNIT_XML  (writes tests/file_seconds.json)",
              file=sys.stderr)
        return 2
    seconds = seconds_from_junit(Path(args[0]))
    if not seconds:
        print(f"error: no test cases in {args[0]}", file=sys.stderr)
        return 1
    merged = refreshed(file_seconds(), seconds, FILE_SECONDS_PATH.parent.parent)
    FILE_SECONDS_PATH.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{len(seconds)} files measured, {len(merged)} listed, "
          f"{sum(merged.values()):.0f} s in all -> {FILE_SECONDS_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
