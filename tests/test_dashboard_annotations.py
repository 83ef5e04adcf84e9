"""Grafana marks crashes and restarts on every panel's time axis (#32 item 12: what
Grafana users of the anchors would miss): two Prometheus annotation queries in the
dashboard, through its data-source variable, filtered as every panel is, on series the
daemon exports, parsed by promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from tests.test_dashboards import (
    CONTRACT_METRICS,
    DASHBOARD_JSON,
    DATASOURCE,
    DEFAULT_SUBSTITUTIONS,
    INSTANCE_SELECTORS,
    JOB_SELECTOR,
)

VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def annotations() -> dict[str, dict]:
    listed = json.loads(DASHBOARD_JSON.read_text())["annotations"]["list"]
    return {a["name"]: a for a in listed if a.get("expr")}


def test_crashes_and_restarts_are_annotated(tmp_path: Path) -> None:
    found = annotations()
    assert set(found) == {"Crashes", "Restarts"}  # before: Grafana's built-in one only
    crashes, restarts = found["Crashes"], found["Restarts"]
    # a crash is marked at the job's end, not at each scrape that sees it failed
    assert crashes["useValueForTime"] and "jobsup_job_ended_timestamp_seconds" in crashes["expr"]
    assert 'state=~"failed|lost"' in crashes["expr"]
    assert "changes(jobsup_job_restarts" in restarts["expr"]
    exprs = []
    for annotation in found.values():
        assert annotation["datasource"] == DATASOURCE and annotation["enable"]
        assert "{{job_name}}" in annotation["titleFormat"]
        for name, matchers in re.findall(r"\b(jobsup_\w+)\b\s*(\{[^}]*\})", annotation["expr"]):
            assert name in CONTRACT_METRICS, name
            assert all(s in matchers for s in (*INSTANCE_SELECTORS, JOB_SELECTOR)), matchers
        exprs.append(VARIABLE.sub(lambda m: DEFAULT_SUBSTITUTIONS[m[1] or m[2]],
                                   annotation["expr"]))
    rules = tmp_path / "annotations.yml"
    rules.write_text(json.dumps({"groups": [{"name": "annotations", "rules": [
        {"record": f"jobsup_annotation:query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: Debian's `prometheus` package (./dev.sh test)"
    checked = subprocess.run([promtool, "check", "rules", "--lint=none", str(rules)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
