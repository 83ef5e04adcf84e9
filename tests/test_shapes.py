"""Internal shapes are not API shapes (#31): the API's response models live in
`api/models.py` and are built in `api/views.py` only; `spec.py` holds the request
contract and the enums; the alerts' messages and the stored progress own their shapes,
so nothing below the API imports it. Read from the source (AST), no daemon needed."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

from supervisor.observe.view import ProgressRecord, progress_json, stored_progress

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor"

RESPONSE_MODELS = ("Progress", "Forecast", "GpuDeviceUse", "Resources", "AlertOut",
                   "JobOut", "SampleOut", "EventOut", "HealthOut", "ErrorOut")
"""The API's response models (docs/api.md): they left `spec.py` and `routes.py`."""

BUILT_OUTSIDE_VIEWS = {"HealthOut": "api/routes.py"}
"""The answer of `/healthz` is built from the engine's tick times, which no record holds
(views.py's docstring says so)."""


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def supervisor_imports(path: Path) -> set[str]:
    """The `supervisor.*` modules (and names under them) that `path` imports."""
    out: set[str] = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in out if name.startswith("supervisor.")}


def test_the_alerts_and_the_stored_progress_do_not_import_the_api() -> None:
    climbing = {f"{path.relative_to(PACKAGE)}: {name}"
                for folder in ("alerting", "observe", "storage")
                for path in sorted((PACKAGE / folder).rglob("*.py"))
                for name in supervisor_imports(path)
                if name == "supervisor.api" or name.startswith("supervisor.api.")}
    assert climbing == set()


def test_spec_defines_no_response_model_and_api_models_defines_them_all() -> None:
    spec_classes = {node.name for node in ast.walk(parsed(PACKAGE / "spec.py"))
                    if isinstance(node, ast.ClassDef)}
    assert {name for name in spec_classes
            if name.endswith("Out") or name in RESPONSE_MODELS} == set()
    spec = importlib.import_module("supervisor.spec")
    assert [name for name in RESPONSE_MODELS if hasattr(spec, name)] == []  # no re-export
    models = importlib.import_module("supervisor.api.models")
    assert [name for name in RESPONSE_MODELS if not hasattr(models, name)] == []


def test_response_models_are_built_in_views_only() -> None:
    built = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call):
                name = (node.func.id if isinstance(node.func, ast.Name) else
                        node.func.attr if isinstance(node.func, ast.Attribute) else None)
                if name in RESPONSE_MODELS and where not in (
                        "api/views.py", BUILT_OUTSIDE_VIEWS.get(name)):
                    built.add(f"{where}:{node.lineno} {name}")
    assert built == set()


OLD_STORED_PROGRESS = (
    '{"items_done":7,"items_total":10,"files":7,"bytes_written":7340032,'
    '"source":"progress_file","last_progress_at":"2026-11-29T14:18:15Z",'
    '"metrics":{"loss":0.25},"observed_at":"2026-11-29T14:18:17.500000Z",'
    '"observation_error":null}')
"""A row's `progress_json` as the daemon stored it while it was the API's `Progress`."""


def test_stored_progress_reads_and_writes_the_rows_of_before() -> None:
    record = stored_progress(OLD_STORED_PROGRESS)
    assert record == ProgressRecord(
        items_done=7, items_total=10, files=7, bytes_written=7340032, source="progress_file",
        last_progress_at=1_795_961_895.0, metrics={"loss": 0.25},
        observed_at=1_795_961_897.5, observation_error=None)
    assert progress_json(record) == OLD_STORED_PROGRESS  # the stored JSON is unchanged
    assert stored_progress('{"items_done":3}') == ProgressRecord(items_done=3)
    assert stored_progress('{"files":"many"}') is None  # unreadable: shown as none yet


def test_a_message_tells_an_alert_as_the_api_shows_it() -> None:
    """The message's own alert shape (`MessageAlert`, from the row) is the API's Alert:
    the webhook's `alert` (docs/api.md) did not change when it stopped being built by
    the API."""
    from supervisor.alerting.recorder import message_alert
    from supervisor.api.views import alert_out
    from supervisor.storage.tables import Alert

    for row in (Alert(id=3, job_id="j1", rule="crashed", severity="critical", state="firing",
                      started_at=1_795_961_895.25, resolved_at=None, message="j1 failed"),
                Alert(id=4, job_id="j1", rule="stalled", severity="warning",
                      state="resolved", started_at=1_795_961_895.0,
                      resolved_at=1_795_961_999.5, message="no new item")):
        assert json.dumps(message_alert(row)) == json.dumps(
            alert_out(row).model_dump(mode="json"))
