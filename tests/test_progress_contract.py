"""The progress-file contract (docs/progress-file.md): the workers' writer
(`workers.common.ProgressReporter`), run in a real process with the environment the
launcher gives a job, against the daemon's reader (`observe.progress_file`).

Renaming a field on either side, or in the docs, fails here: every field must
round-trip, the writer must write exactly the fields the reader knows, and the docs'
table must list exactly those."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.backends.launch import job_environment
from supervisor.observe import progress_file
from supervisor.observe.progress_file import COUNT_MAX, FIELDS, Reported, from_progress_file
from supervisor.spec import JobSpec

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "progress-file.md"

WRITER = r"""
import json, sys
from workers.common import ProgressReporter

case = json.loads(sys.argv[1])
reporter = ProgressReporter(total=case["total"], unit=case["unit"])
for done in range(case.get("from", case["done"]), case["done"] + 1):
    metrics = dict(case["metrics"], **({"step": done} if "from" in case else {}))
    reporter.update(done, metrics, force=True)
ours = [m for m in sys.modules if m == "supervisor" or m.startswith("supervisor.")]
assert not ours, f"the workers imported the supervisor: {ours}"
"""


def job_env(progress: Path) -> dict[str, str]:
    """What the launcher gives a job (JOBSUP_PROGRESS_FILE among it), plus the path to
    import the workers from."""
    spec = JobSpec(name="contract", command=[sys.executable, "-c", WRITER])
    env = job_environment(os.environ, spec, "c0ffee01", 1, progress)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start_writer(progress: Path, case: dict[str, Any]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(case)], cwd=REPO,
                            env=job_env(progress), stderr=subprocess.PIPE)


def run_writer(progress: Path, case: dict[str, Any]) -> None:
    proc = start_writer(progress, case)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()


@pytest.mark.parametrize("case, expected", [
    ({"done": 450, "total": 1000, "unit": "sample",
      "metrics": {"loss": 0.25, "tokens_per_s": 1234, "acc.top-1": 0.5, "ttt:0": -3}},
     Reported(450, 1000, "sample",
              {"loss": 0.25, "tokens_per_s": 1234.0, "acc.top-1": 0.5, "ttt:0": -3.0})),
    ({"done": 0, "total": None, "unit": "prompt", "metrics": {}},
     Reported(0, None, "prompt", {})),
    ({"done": COUNT_MAX, "total": COUNT_MAX, "unit": "token", "metrics": {"x": 1e300}},
     Reported(COUNT_MAX, COUNT_MAX, "token", {"x": 1e300})),
], ids=["everything", "unknown-total", "largest-counts"])
def test_every_field_the_writer_writes_the_reader_reads_back(
        tmp_path: Path, case: dict[str, Any], expected: Reported) -> None:
    progress = tmp_path / "jobs" / "c0ffee01" / "progress.json"
    progress.parent.mkdir(parents=True)
    run_writer(progress, case)

    assert from_progress_file(progress) == expected
    written = json.loads(progress.read_text(encoding="utf-8"))
    assert list(written) == list(FIELDS), "the writer and the reader name different fields"
    # nothing left beside it: no temp file the output scanner or a reader could meet
    assert [p.name for p in progress.parent.iterdir()] == ["progress.json"]


def test_a_total_of_zero_means_unknown(tmp_path: Path) -> None:
    """`ProgressReporter(total=0)` (workers.vocab) is a report with no total."""
    progress = tmp_path / "progress.json"
    run_writer(progress, {"done": 7, "total": 0, "unit": "sample", "metrics": {}})
    assert from_progress_file(progress) == Reported(7, None, "sample", {})


def test_the_reader_never_sees_a_torn_report(tmp_path: Path) -> None:
    """A writer replacing the file as fast as it can, read meanwhile: from the first
    report on, every read is one whole report (its metric written with its count) and
    the counts never go back."""
    progress = tmp_path / "progress.json"
    last = 3000
    proc = start_writer(progress, {"from": 0, "done": last, "total": last, "unit": "step",
                                   "metrics": {"loss": 1.5}})
    seen: list[int] = []
    try:
        while proc.poll() is None:
            reported = from_progress_file(progress)
            if reported is None:
                assert not seen, f"no report after {seen[-1]}: a torn or missing file"
                continue
            assert reported.items_total == last and reported.unit == "step"
            assert reported.metrics == {"loss": 1.5, "step": float(reported.items_done)}
            assert not seen or reported.items_done >= seen[-1]
            seen.append(reported.items_done)
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:  # an assertion above failed: stop the writer
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    assert len(seen) > 1, "the reader never overlapped the writer"
    assert from_progress_file(progress) == Reported(last, last, "step",
                                                    {"loss": 1.5, "step": float(last)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress.json"]


def test_the_docs_define_exactly_the_fields_both_sides_use() -> None:
    text = DOC.read_text(encoding="utf-8")
    fields = text.split("\n## Fields\n", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", fields, flags=re.MULTILINE)
    assert documented == list(FIELDS)
    assert "JOBSUP_PROGRESS_FILE" in text
    assert progress_file.__doc__ is not None and "docs/progress-file.md" in progress_file.__doc__
