"""The monitoring artefacts in dashboards/ (and docker/prometheus.yml), checked by the tools
that load them: promtool for the alert rules, their unit tests, the Prometheus configs and
every PromQL query of the Grafana dashboard; amtool for the Alertmanager example.

promtool and amtool come from Debian's `prometheus` and `prometheus-alertmanager`
packages, which the project's test setup installs. A missing tool fails these tests with
that hint: nothing here is skipped.

`dashboard_queries()` lists the dashboard's queries with Grafana's variables filled in, for
a test that runs them against a real Prometheus scraping a live daemon.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DASHBOARDS = REPO / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "grafana" / "jobsup.json"
PROMETHEUS_DIR = DASHBOARDS / "prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
RULES_TEST = PROMETHEUS_DIR / "rules_test.yml"
ALERTMANAGER_YML = DASHBOARDS / "alertmanager" / "alertmanager.yml"
DOCKER = REPO / "docker"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""Every panel and target queries through the dashboard's data-source variable."""

JOB_SELECTOR = 'job_name=~"$job_name"'
INSTANCE_SELECTORS = ('job=~"$job"', 'instance=~"$instance"')
"""Every series a panel reads is filtered by the scrape job and the daemons chosen: one
Grafana, one Prometheus, many machines."""

CONTRACT_METRICS = frozenset({
    # API.md "Prometheus metric names"
    "jobsup_job_state", "jobsup_job_items_done", "jobsup_job_items_expected", "jobsup_job_files",
    "jobsup_job_bytes_written", "jobsup_job_rate_items_per_second", "jobsup_job_eta_seconds",
    "jobsup_job_last_progress_timestamp_seconds", "jobsup_job_cpu_percent",
    "jobsup_job_rss_bytes", "jobsup_job_gpu_memory_bytes", "jobsup_job_disk_full_in_seconds",
    "jobsup_job_metric", "jobsup_filesystem_free_bytes", "jobsup_alerts_firing",
    "jobsup_tick_duration_seconds_bucket", "jobsup_tick_duration_seconds_count",
    "jobsup_tick_duration_seconds_sum",
    # also exported by supervisor/api/metrics.py
    "jobsup_job_projected_total_bytes", "jobsup_job_will_fit", "jobsup_job_stalled",
    "jobsup_job_exit_code", "jobsup_job_restarts", "jobsup_job_gpu_device_memory_bytes",
    "jobsup_notifications_sent_total",
    "jobsup_notifications_failed_total", "jobsup_notifications_retries_total",
    "jobsup_job_ended_timestamp_seconds", "jobsup_job_first_started_timestamp_seconds",
    "jobsup_build_info", "jobsup_host_info",
})
"""Series names users script against: a typo here would be a panel or alert that is
silently empty forever."""

REQUIRED_ALERTS = ("JobsupJobStalled", "JobsupJobCrashed", "JobsupJobRestartLoop",
                   "JobsupDiskFillsBeforeJobEnds", "JobsupDaemonDown")
"""Alert names people route on in Alertmanager."""

DEFAULT_SUBSTITUTIONS = {
    "job": "jobsup",
    "instance": ".*",
    "job_name": ".*",
    "metric": ".*",
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
}
"""What Grafana puts in for each variable the dashboard's queries use by default ("All"
is `.*`; the scrape job is the one the example configs name)."""

_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_JSON.read_text())


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that queries, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def dashboard_queries(substitutions: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel of the Grafana dashboard, with
    Grafana's variables (`$name` or `${name}`) replaced by `substitutions[name]` (keys with
    or without the `$`; DEFAULT_SUBSTITUTIONS covers them all). A variable without a
    substitution raises KeyError, so no query ever reaches Prometheus with a `$` in it."""
    values = {name.lstrip("$"): text for name, text in substitutions.items()}

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no substitution for Grafana variable ${name}")
        return values[name]

    queries = []
    for panel in _panels(_dashboard()):
        for target in panel.get("targets", []):
            expr = _VARIABLE.sub(substitute, target["expr"])
            if "$" in expr:
                raise ValueError(f"unsupported variable syntax in {panel['title']!r}: {expr}")
            queries.append((panel["title"], expr))
    return queries


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: run the project's test setup, which installs "
                    f"Debian's {package} package (apt-get install {package})", pytrace=False)
    return path


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                            timeout=60, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited {result.returncode}:\n{output}")
    return output


# --- alert rules -------------------------------------------------------------------------

def test_rules_pass_promtool_check() -> None:
    promtool = _tool("promtool", "prometheus")
    output = _run(promtool, "check", "rules", "--lint=all", "--lint-fatal", RULES)
    assert "SUCCESS" in output, output


def test_rules_unit_tests_pass() -> None:
    promtool = _tool("promtool", "prometheus")
    output = _run(promtool, "test", "rules", RULES_TEST.name, cwd=PROMETHEUS_DIR)
    assert "SUCCESS" in output, output


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)\s*$", RULES.read_text(), re.MULTILINE))
    assert set(REQUIRED_ALERTS) <= alerts
    checks = re.findall(r"alertname: (\w+)\s*\n\s*exp_alerts:(.*)\n\s*(- exp_labels)?",
                        RULES_TEST.read_text())
    quiet = {name for name, inline, _ in checks if inline.strip() == "[]"}
    firing = {name for name, inline, labels in checks if not inline.strip() and labels}
    assert alerts - quiet == set(), "alerts without a test that they stay quiet"
    assert alerts - firing == set(), "alerts without a test that they fire"


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_names_the_machine_and_the_job() -> None:
    """127.0.0.1:8765 is the same on every host (#16): each alert gets the daemon's
    hostname, joined from jobsup_host_info, and says it; a job's alert names the job."""
    rules = _alert_rules()
    assert {r["alert"] for r in rules} >= set(REQUIRED_ALERTS)
    for rule in rules:
        name, expr, annotations = rule["alert"], rule["expr"], rule["annotations"]
        assert "group_left (hostname)" in expr and "jobsup_host_info" in expr, name
        for key in ("summary", "description"):
            assert "$labels.hostname" in annotations[key], f"{name} {key}"
        if "jobsup_job_" in expr:
            assert "$labels.job_name" in annotations["summary"], name
            assert "$labels.job_id" in annotations["description"], name


# --- Prometheus and Alertmanager configs -------------------------------------------------

def test_example_prometheus_config_passes_promtool() -> None:
    promtool = _tool("promtool", "prometheus")
    # rule_files are relative to the config: this also loads rules.yml
    output = _run(promtool, "check", "config", PROMETHEUS_DIR / "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in output, output


def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """docker/prometheus.yml as the container sees it: rules.yml beside it, the token in
    /run/secrets (promtool insists that the credentials file exists)."""
    promtool = _tool("promtool", "prometheus")
    token = tmp_path / "jobsup_token"
    token.write_text("test-token\n")
    config = (DOCKER / "prometheus.yml").read_text()
    assert "/run/secrets/jobsup_token" in config
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/run/secrets/jobsup_token", str(token)))
    shutil.copy(RULES, tmp_path / "rules.yml")
    output = _run(promtool, "check", "config", tmp_path / "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in output, output


def test_alertmanager_config_passes_amtool() -> None:
    amtool = _tool("amtool", "prometheus-alertmanager")
    _run(amtool, "check-config", ALERTMANAGER_YML)
    # a crash is an event: its receiver does not send "resolved"
    for receiver, labels in (("slack-events", ["alertname=JobsupJobCrashed", "severity=critical"]),
                             ("slack", ["alertname=JobsupJobStalled", "severity=warning"]),
                             ("slack", ["alertname=JobsupDaemonDown", "severity=critical"])):
        _run(amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}",
             f"--verify.receivers={receiver}", *labels)


def _render(amtool: str, template: str, data: dict[str, Any], tmp_path: Path) -> str:
    """An Alertmanager template rendered by amtool for one notification's data."""
    data_file = tmp_path / "data.json"
    data_file.write_text(json.dumps(data))
    return _run(amtool, "template", "render", f"--template.glob={tmp_path / 'none'}/*.tmpl",
                f"--template.text={template}", f"--template.data={data_file}")


def _notification(receiver: str, labels: dict[str, str], status: str = "firing") -> dict[str, Any]:
    alert = {"status": status, "labels": labels,
             "annotations": {"summary": "the summary", "description": "the description"},
             "startsAt": "2026-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "http://prometheus:9090/graph", "fingerprint": "0123456789abcdef"}
    return {"receiver": receiver, "status": status, "alerts": [alert],
            "groupLabels": {"alertname": labels["alertname"]}, "commonLabels": labels,
            "commonAnnotations": alert["annotations"], "externalURL": "http://alertmanager:9093"}


def test_alertmanager_titles_name_the_job_and_the_machine(tmp_path: Path) -> None:
    amtool = _tool("amtool", "prometheus-alertmanager")
    receivers = {r["name"]: r["slack_configs"][0]
                 for r in yaml.safe_load(ALERTMANAGER_YML.read_text())["receivers"]}
    assert set(receivers) == {"slack", "slack-events"}
    crash = {"alertname": "JobsupJobCrashed", "severity": "critical", "job": "jobsup",
             "instance": "127.0.0.1:8765", "hostname": "gpu-a", "job_id": "a1",
             "job_name": "extract", "state": "failed"}
    down = {"alertname": "JobsupDaemonDown", "severity": "critical", "job": "jobsup",
            "instance": "10.0.0.9:8765"}
    for name, config in receivers.items():
        title = config["title"]
        assert _render(amtool, title, _notification(name, crash), tmp_path) == (
            "[FIRING:1] JobsupJobCrashed extract on gpu-a")
        # a daemon that never exported its hostname: the scrape address
        assert _render(amtool, title, _notification(name, down), tmp_path) == (
            "[FIRING:1] JobsupDaemonDown on 10.0.0.9:8765")
        text = _render(amtool, config["text"], _notification(name, crash), tmp_path)
        assert text.startswith("*the summary*\nthe description"), text
    assert _render(amtool, receivers["slack"]["title"],
                   _notification("slack", down, status="resolved"), tmp_path) == (
        "[RESOLVED] JobsupDaemonDown on 10.0.0.9:8765")


def test_alertmanager_escapes_what_a_job_is_named(tmp_path: Path) -> None:
    """A job name is anyone's text: Slack must show it, not act on it (#32 item 7). Its
    `<!channel>` would notify everyone, and `<URL|text>` would be a disguised link."""
    amtool = _tool("amtool", "prometheus-alertmanager")
    hostile = "<!channel> <https://evil.example|click me> & co"
    escaped = "&lt;!channel&gt; &lt;https://evil.example|click me&gt; &amp; co"
    labels = {"alertname": "JobsupJobStalled", "severity": "warning", "job": "jobsup",
              "instance": "127.0.0.1:8765", "hostname": "<!here>", "job_id": "a1",
              "job_name": hostile}
    data = _notification("slack", labels)
    data["alerts"][0]["annotations"] = {"summary": f"{hostile} is stalled",
                                        "description": f"job {hostile} on <!here>"}
    for config in (r["slack_configs"][0]
                   for r in yaml.safe_load(ALERTMANAGER_YML.read_text())["receivers"]):
        title = _render(amtool, config["title"], data, tmp_path)
        assert title == f"[FIRING:1] JobsupJobStalled {escaped} on &lt;!here&gt;", title
        text = _render(amtool, config["text"], data, tmp_path)
        assert text.startswith(f"*{escaped} is stalled*\njob {escaped} on &lt;!here&gt;"), text
        assert "<" not in title + text and ">" not in title + text


def test_compose_file_mounts_exist() -> None:
    compose = (DOCKER / "compose.yaml").read_text()
    paths = re.findall(r"^\s*- (\.\.?/[^:\s]+):", compose, re.MULTILINE)
    assert len(paths) >= 5, paths
    missing = [p for p in paths if not (DOCKER / p).exists()]
    assert missing == [], f"compose.yaml mounts paths that do not exist: {missing}"
    assert "dockerfile: docker/Dockerfile" in compose
    assert (DOCKER / "Dockerfile").is_file()


# --- Grafana dashboard -------------------------------------------------------------------

def test_dashboard_is_importable() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [p["id"] for p in dashboard["panels"]] + [
        p["id"] for row in dashboard["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert panel["title"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert list(variables) == ["datasource", "job", "instance", "job_name", "metric"]
    queries = {}
    for name, variable in variables.items():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, name
            query = variable["query"]
            queries[name] = query["query"] if isinstance(query, dict) else query
            assert variable["definition"] == queries[name], name
    # the scrape job: one, "jobsup" by default; daemons by their build info; jobs and
    # worker metrics of the chosen daemons
    assert queries["job"] == "label_values(jobsup_build_info, job)"
    assert not variables["job"]["multi"] and variables["job"]["current"]["value"] == "jobsup"
    assert queries["instance"] == 'label_values(jobsup_build_info{job=~"$job"}, instance)'
    assert queries["job_name"] == (
        'label_values(jobsup_job_state{job=~"$job", instance=~"$instance"}, job_name)')
    assert all(selector in queries["metric"] for selector in (*INSTANCE_SELECTORS, JOB_SELECTOR))
    for name in ("instance", "job_name", "metric"):
        variable = variables[name]
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"


def test_every_panel_queries_through_the_datasource_variable() -> None:
    panels = list(_panels(_dashboard()))
    assert len(panels) >= 8
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"] == DATASOURCE, title
        assert panel["targets"], f"{title}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{title}: empty expr"
            assert target["datasource"] == DATASOURCE, title


def test_every_query_follows_the_instance_and_job_selectors() -> None:
    """Every selector of every query is filtered by the $job and $instance variables (no
    hard-coded `up{job="jobsup"}`), and every selector of a job series by $job_name."""
    selectors = 0
    for panel in _panels(_dashboard()):
        for target in panel["targets"]:
            expr = target["expr"]
            found = re.findall(r"\b(jobsup_\w+|up)\b\s*(\{[^}]*\})?", expr)
            assert found, f"{panel['title']}: no series in {expr}"
            for name, matchers in found:
                selectors += 1
                wanted = [*INSTANCE_SELECTORS, *([JOB_SELECTOR] if name.startswith("jobsup_job_")
                                                 else [])]
                missing = [w for w in wanted if w not in matchers]
                assert missing == [], f"{panel['title']}: {name} without {missing}: {expr}"
    assert selectors >= 33


def test_filesystem_legend_names_the_machine() -> None:
    """/data on two hosts is two filesystems: the legend says whose."""
    (panel,) = [p for p in _panels(_dashboard()) if p["title"] == "Free space per filesystem"]
    (target,) = panel["targets"]
    assert "group_left (hostname)" in target["expr"] and "jobsup_host_info" in target["expr"]
    assert "{{hostname}}" in target["legendFormat"] and "{{mountpoint}}" in target["legendFormat"]
    assert "{{instance}}" in target["legendFormat"]


def test_jobs_table_merges_instant_queries_by_job() -> None:
    (table,) = [p for p in _panels(_dashboard()) if p["title"] == "Jobs"]
    assert table["type"] == "table" and table["transformations"][0]["id"] == "merge"
    for target in table["targets"]:
        assert target["instant"] and target["format"] == "table", target["refId"]
        # the merge joins rows on the labels every query has: the daemon (job ids are
        # unique per daemon only), job_id and job_name
        assert "by (instance, job_id, job_name" in target["expr"], target["expr"]


def test_daemons_table_names_each_machine_and_build() -> None:
    (table,) = [p for p in _panels(_dashboard()) if p["title"] == "Daemons"]
    (target,) = table["targets"]
    assert target["instant"] and target["format"] == "table"
    assert "max by (instance, hostname, version, python)" in target["expr"]
    assert "jobsup_build_info" in target["expr"] and "jobsup_host_info" in target["expr"]


def test_only_contract_metric_names() -> None:
    texts = [*dashboard_queries(DEFAULT_SUBSTITUTIONS), ("rules.yml", RULES.read_text()),
             ("rules_test.yml", RULES_TEST.read_text())]
    for where, text in texts:
        unknown = set(re.findall(r"\bjobsup_[a-z0-9_]+", text)) - CONTRACT_METRICS
        assert unknown == set(), f"{where}: not metric names jobsup exports: {unknown}"


def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """promtool (2.42) has no PromQL linter, but `check rules` parses every expr: each
    query becomes a recording rule (the file is JSON, which is YAML)."""
    promtool = _tool("promtool", "prometheus")
    queries = dashboard_queries(DEFAULT_SUBSTITUTIONS)
    # the selector inside each variable's label_values(...) must parse too
    for variable in _dashboard()["templating"]["list"]:
        query = variable.get("definition", "")
        match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
        if match:
            selector = _VARIABLE.sub(lambda m: DEFAULT_SUBSTITUTIONS[m[1] or m[2]], match[1])
            queries.append((f"variable {variable['name']}", selector))
    rules = [{"record": f"jobsup_dashboard:query_{i}", "expr": expr}
             for i, (_, expr) in enumerate(queries)]
    rules_file = tmp_path / "dashboard_queries.yml"
    rules_file.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    index = "\n".join(f"  query_{i}: {title}: {expr}" for i, (title, expr) in enumerate(queries))
    result = subprocess.run([promtool, "check", "rules", "--lint=none", str(rules_file)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\nqueries:\n{index}"
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_dashboard_queries_substitute_every_variable() -> None:
    queries = dashboard_queries(DEFAULT_SUBSTITUTIONS)
    assert queries and all("$" not in expr for _, expr in queries)
    assert any('job_name=~".*"' in expr for _, expr in queries)
    assert dashboard_queries({f"${k}": v for k, v in DEFAULT_SUBSTITUTIONS.items()}) == queries
    for variable in ("job", "instance", "job_name"):
        partial = {k: v for k, v in DEFAULT_SUBSTITUTIONS.items() if k != variable}
        with pytest.raises(KeyError, match=rf"variable \${variable}'$"):
            dashboard_queries(partial)
