"""Schemathesis fuzzes every operation of the live daemon's OpenAPI schema over real HTTP
on loopback, with every default check, and no request may get a 5xx.

`POST /api/v1/jobs` starts whatever it is given, and the pipeline route starts Python
workers, so the fuzzed daemon is fenced in so that nothing the fuzzer makes up can run:

- its `PATH` is one empty directory (a JobSpec's `PATH` defaults to the daemon's), so a
  bare program name never resolves and the submit answers 422;
- its cwd is another empty directory, so a relative program or path (`./x`, `dev.sh`)
  names nothing either;
- `runnable_guard` looks at every generated body before it is sent: a `command[0]` that
  would resolve to an existing file (an absolute path, a path relative to the spec's
  `cwd`, or a name on a `PATH` the spec's own `env` sets), or pipeline `prompts` that are
  an existing file, is replaced by a path that does not exist. The answer is then the
  same 422 that any missing program gets; what the fuzzer exercises is validation, which
  is where the 5xx would be;
- at the end every job the daemon knows is stopped, the test asserts that none ran,
  and `kill_jobs_of` removes any process of its data dir all the same.

The daemon has a token (the schema then declares bearer auth, and the `ignored_auth`
check sends requests without it). Examples are bounded (`MAX_EXAMPLES` per operation and
phase), so the whole run takes well under 90 s.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import Case
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from tests.helpers import REPO, Daemon, wait_for

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25
TOKEN = "fuzz-token"
MISSING_PROGRAM = "/nonexistent/jobsup-fuzz-program"


class FencedDaemon(Daemon):
    """A daemon whose cwd and PATH are empty directories (see the module docstring)."""

    def __init__(self, root: Path):
        self.empty_path = root / "empty-path"
        (root / "empty-cwd").mkdir()
        self.empty_path.mkdir()
        super().__init__(root / "data", env={
            "PATH": str(self.empty_path), "JOBSUP_TOKEN": TOKEN,
            "PYTHONPATH": str(REPO)}, cwd=root / "empty-cwd")
        self.http.headers["Authorization"] = f"Bearer {TOKEN}"


@pytest.fixture(scope="module")
def fenced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedDaemon]:
    daemon = FencedDaemon(tmp_path_factory.mktemp("fuzz"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.shut_down()


def _resolves(program: str, cwd: Path, search_path: str) -> bool:
    """Whether the daemon would find `program` (mirrors `launcher.check_runnable`,
    generously: any existing file counts, executable or not)."""
    try:
        if "/" in program:
            path = Path(program) if Path(program).is_absolute() else cwd / program
            return path.exists()
        return shutil.which(program, path=search_path) is not None or program in ("", ".")
    except (OSError, ValueError):
        return True  # unknowable: treat as runnable, replace it


def runnable_guard(case: Case, fenced: FencedDaemon) -> None:
    """Make sure the generated body cannot start a real program (module docstring)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/api/v1/jobs":
        command, env, cwd = body.get("command"), body.get("env"), body.get("cwd")
        if not (isinstance(command, list) and command and isinstance(command[0], str)):
            return
        base = fenced.cwd
        if isinstance(cwd, str) and "\x00" not in cwd:
            base = fenced.cwd / cwd
        search = str(fenced.empty_path)
        if isinstance(env, dict) and isinstance(env.get("PATH"), str):
            search = env["PATH"]
        if _resolves(command[0], base, search):
            command[0] = MISSING_PROGRAM
    elif case.path == "/api/v1/pipelines/eagle3":
        prompts = body.get("prompts")
        if isinstance(prompts, str) and ("\x00" in prompts or _exists(fenced.cwd / prompts)):
            body["prompts"] = MISSING_PROGRAM


def _exists(path: Path) -> bool:
    """`path.exists()`, False for a name the OS refuses (too long, bad bytes)."""
    try:
        return path.exists()
    except OSError:
        return False


SEMANTIC_422 = ["2xx", 401, 403, 404, 409, 422]
"""A schema-valid submit can still be refused with 422: the program, cwd, model or
prompts must exist on this machine, which no schema can say."""

CONFIG = {
    "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
    "continue-on-failure": True,
    "headers": {"Authorization": f"Bearer {TOKEN}"},
    "operations": [{
        "include-method": "POST", "include-path": ["/api/v1/jobs", "/api/v1/pipelines/eagle3"],
        "checks": {"positive_data_acceptance": {"expected-statuses": SEMANTIC_422}},
    }],
}


def fuzz(daemon: FencedDaemon) -> tuple[dict[str, str], Counter[tuple[str, int]], set[str]]:
    """Run schemathesis's engine (the `schemathesis run` phases: examples, coverage,
    fuzzing, stateful) against the daemon: (each distinct failure with a curl command
    that reproduces it, answers per operation and status, checks that ran)."""
    schema = schemathesis.openapi.from_url(
        f"{daemon.url}/openapi.json", config=SchemathesisConfig.from_dict(CONFIG),
        headers={"Authorization": f"Bearer {TOKEN}"})
    failures: dict[str, str] = {}
    answers: Counter[tuple[str, int]] = Counter()
    checks: set[str] = set()

    def guard(_context: Any, case: Case, _kwargs: dict[str, Any]) -> None:
        runnable_guard(case, daemon)

    schemathesis.hook("before_call")(guard)  # a global hook: unregistered below
    try:
        for event in from_schema(schema).execute():
            if isinstance(event, events.ScenarioFinished):
                recorder = event.recorder
                for nodes in recorder.checks.values():
                    for node in nodes:
                        checks.add(node.name)
                        info = node.failure_info
                        if info is not None:
                            what = f"{recorder.label}: {node.name}: {info.failure}"
                            failures.setdefault(what, info.code_sample)
                for interaction in recorder.interactions.values():
                    if interaction.response is not None:
                        answers[(recorder.label, interaction.response.status_code)] += 1
            elif isinstance(event, events.NonFatalError):
                failures.setdefault(f"{event.label}: error: {event.info.format()}", "")
            elif isinstance(event, events.FatalError):
                failures.setdefault(f"fatal: {event.exception!r}", "")
            elif isinstance(event, events.EngineFinished):
                failures.update((f"after run: {f}", "") for f in event.failures)
    finally:
        schemathesis.hooks.unregister(guard)
    return failures, answers, checks


def stop_all(daemon: FencedDaemon) -> list[dict[str, Any]]:
    """Stop every job the daemon knows; wait until all have ended; return them."""
    ended = {"succeeded", "failed", "stopped", "lost"}
    jobs = daemon.http.get("/api/v1/jobs").json()
    for job in jobs:
        if job["state"] not in ended:
            daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    wait_for(lambda: all(j["state"] in ended for j in daemon.http.get("/api/v1/jobs").json()),
             30, what="every job ended")
    return jobs


@pytest.mark.timeout(180)
def test_fuzz_every_operation_no_5xx_and_nothing_runs(fenced: FencedDaemon) -> None:
    started = time.monotonic()
    try:
        failures, answers, checks = fuzz(fenced)
    finally:
        jobs = stop_all(fenced)
    elapsed = time.monotonic() - started
    print(f"fuzzed in {elapsed:.1f} s: {sum(answers.values())} requests; checks: "
          f"{', '.join(sorted(checks))}")
    for (label, status), count in sorted(answers.items()):
        print(f"  {label}: {status} x{count}")

    assert not failures, "\n\n".join(f"{what}\n{curl}" for what, curl in failures.items())
    assert [key for key in answers if key[1] >= 500] == []
    assert {"not_a_server_error", "status_code_conformance", "response_schema_conformance",
            "content_type_conformance", "positive_data_acceptance",
            "negative_data_rejection", "ignored_auth"} <= checks
    operations = {f"{method.upper()} {path}"
                  for path, methods in fenced.http.get("/openapi.json").json()["paths"].items()
                  for method in methods}
    assert operations <= {label for label, _ in answers}, "every operation was exercised"
    # nothing the fuzzer sent ran: no job, no attempt directory, nothing written
    assert [(j["name"], j["spec"]["command"]) for j in jobs] == []
    assert not list(fenced.data_dir.glob("jobs/*/attempt-*"))
    assert os.listdir(fenced.cwd) == [] and os.listdir(fenced.empty_path) == []
    assert httpx.get(f"{fenced.url}/healthz").status_code == 200
    assert elapsed < 90
