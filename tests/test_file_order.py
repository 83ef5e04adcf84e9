"""The suite's start order (`tests/file_order.py`): longest files first, tests in
their order within a file, times read back from a real pytest junit report."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tests.file_order import longest_files_first, refreshed, seconds_from_junit


@dataclass
class _Item:
    nodeid: str


def test_files_start_longest_first_and_keep_their_tests_order() -> None:
    items = [_Item(n) for n in ("tests/test_a.py::one", "tests/test_b.py::one",
                                "tests/test_a.py::two", "tests/test_new.py::one",
                                "tests/test_b.py::two", "tests/test_c.py::one")]
    longest_files_first(cast(Any, items), {"tests/test_a.py": 5.0, "tests/test_b.py": 50.0,
                                           "tests/test_c.py": 5.0})
    assert [item.nodeid for item in items] == [
        "tests/test_b.py::one", "tests/test_b.py::two",  # 50 s
        "tests/test_new.py::one",  # unknown: NEW_FILE_S (10 s)
        "tests/test_a.py::one", "tests/test_a.py::two",  # 5 s, collected before test_c
        "tests/test_c.py::one"]


def test_times_come_from_a_real_junit_report(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "test_x.py").write_text(
        "import time\n"
        "import pytest\n"
        "def test_plain():\n    time.sleep(0.3)\n"
        "class TestGroup:\n"
        "    @pytest.mark.parametrize('n', [1, 2])\n"
        "    def test_param(self, n):\n        time.sleep(0.1)\n")
    (tmp_path / "tests" / "test_broken.py").write_text("import no_such_module\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "no:xdist", "--continue-on-collection-errors", f"--junitxml={report}",
                    "--rootdir", str(tmp_path), "tests"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seconds = seconds_from_junit(report)
    # the collection error's entry names no file; the class's tests count for their file
    assert list(seconds) == ["tests/test_x.py"]
    assert 0.5 <= seconds["tests/test_x.py"] < 5


def test_a_refresh_keeps_the_files_a_report_lacks_while_they_exist(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / "tests" / name).write_text("")
    known = {"tests/test_a.py": 10.0, "tests/test_b.py": 20.0, "tests/test_gone.py": 30.0}
    assert refreshed(known, {"tests/test_a.py": 12.5}, tmp_path) == {
        "tests/test_a.py": 12.5, "tests/test_b.py": 20.0}
