"""A schema upgrade killed part way (kill -9, a power cut, Ctrl-C) never keeps the daemon
from starting again (#30, item 1).

Each case forks a child that runs the daemon's own `upgrade` and SIGKILLs itself right
after its Nth SQL statement, for every N from the first to the last (and the commit),
from a fresh database and from one at 0003 holding rows in every table; then the
daemon's start (`recovery.open_database`, and for one N a real `jobsup serve`) must
bring the schema to head, the same as a fresh database's, with every row kept. On SQLite
and on PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, event, inspect, text

from supervisor.config import Settings
from supervisor.daemon.recovery import open_database
from supervisor.storage.database import alembic_config, make_engine, upgrade
from tests.helpers import PY, REPO, Daemon, python_job
from tests.postgres import PostgresServer

pytestmark = [pytest.mark.both_databases, pytest.mark.timeout(600)]

SEEDED_AT = "0003"
"""The revision whose database gets a row in every table before the upgrade is killed:
the data migration of 0005 and the copy-and-swap of `notifications` run over rows."""

TABLES_AT_0003 = ("jobs", "job_events", "samples", "alerts", "notifications")


def head() -> str:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    revision = script.get_current_head()
    assert revision is not None
    return revision


def seed(url: str) -> dict[str, int]:
    """The database at SEEDED_AT with rows in every table; the number of rows of each."""
    engine = make_engine(url)
    cfg = alembic_config(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, SEEDED_AT)
        for n in range(3):
            conn.execute(text(
                "INSERT INTO jobs (id, name, spec_json, state, attempt, restarts, created_at,"
                " progress_json) VALUES (:id, :name, :spec, 'succeeded', 1, 0, :t, '{}')"),
                {"id": f"job{n}", "name": f"job {n}", "t": 1000.0 + n,
                 "spec": json.dumps({"name": f"job {n}", "command": ["true"]})})
            conn.execute(text(
                "INSERT INTO job_events (job_id, t, from_state, to_state) VALUES "
                "(:id, :t, 'pending', 'running')"), {"id": f"job{n}", "t": 1001.0 + n})
            conn.execute(text(
                "INSERT INTO samples (job_id, t, items_done, files, bytes_written) VALUES "
                "(:id, :t, 5, 1, 100)"), {"id": f"job{n}", "t": 1002.0 + n})
            conn.execute(text(
                "INSERT INTO alerts (job_id, rule, severity, state, started_at, message) "
                "VALUES (:id, 'stalled', 'warning', 'firing', :t, 'stalled')"),
                {"id": f"job{n}", "t": 1003.0 + n})
            for destination in ("slack", "webhook"):
                conn.execute(text(
                    "INSERT INTO notifications (destination, kind, job_id, alert_id, "
                    "payload_json, created_at, attempts, next_attempt_at) VALUES "
                    "(:d, 'firing', :id, :n, '{}', :t, 0, :t)"),
                    {"d": destination, "id": f"job{n}", "n": n + 1, "t": 1004.0 + n})
    counts = row_counts(engine, TABLES_AT_0003)
    engine.dispose()
    return counts


def row_counts(engine: Engine, tables: tuple[str, ...]) -> dict[str, int]:
    with engine.connect() as conn:
        return {table: int(conn.scalar(text(f"SELECT count(*) FROM {table}")) or 0)
                for table in tables}


def schema(engine: Engine) -> dict[str, Any]:
    """Tables with their columns (name, nullable) and index names; alembic's version."""
    found = inspect(engine)
    tables = {}
    for table in sorted(found.get_table_names()):
        columns = sorted((c["name"], c["nullable"]) for c in found.get_columns(table))
        indexes = sorted(str(i["name"]) for i in found.get_indexes(table))
        tables[table] = (columns, indexes)
    with engine.connect() as conn:
        version = conn.scalar(text("SELECT version_num FROM alembic_version"))
    return {"tables": tables, "version": version}


def upgrade_killed_after(url: str, statements: int | None) -> int:
    """Run the daemon's upgrade in a forked child that SIGKILLs itself right after its
    `statements`-th SQL statement (None: never). The number of statements it ran; for
    None, the upgrade must have ended normally."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's is used, and it never returns
        code = 1
        try:
            os.close(read)
            engine = make_engine(url)
            ran = 0

            def after(*_args: Any) -> None:
                nonlocal ran
                ran += 1
                os.write(write, b".")
                if ran == statements:
                    os.kill(os.getpid(), signal.SIGKILL)

            event.listen(engine, "after_cursor_execute", after)
            upgrade(engine)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    ran = 0
    with os.fdopen(read, "rb") as pipe:
        while chunk := pipe.read(4096):
            ran += len(chunk)
    _, status = os.waitpid(pid, 0)
    if statements is None or statements > ran:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    else:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return ran


class Databases:
    """Copies of one database, made fast: a SQLite file copied, a PostgreSQL database
    created from a template."""

    def __init__(self, kind: str, root: Path, request: pytest.FixtureRequest) -> None:
        self.kind, self.root, self.request = kind, root, request
        self.made = 0
        self.server: PostgresServer | None = (
            request.getfixturevalue("postgres_server") if kind == "postgresql" else None)
        self.to_drop: list[str] = []

    def new(self) -> tuple[str, Path]:
        """A new empty database and a data dir to go with it: (URL, data dir)."""
        self.made += 1
        data_dir = self.root / f"data{self.made}"
        data_dir.mkdir()
        if self.server is None:
            return f"sqlite:///{data_dir / 'jobsup.db'}", data_dir
        name = f"t_upgrade_{self.made}_{os.getpid()}"
        self.server.admin(f'CREATE DATABASE "{name}"')
        self.to_drop.append(name)
        return self.server.url(name), data_dir

    def copy(self, url: str) -> tuple[str, Path]:
        """A copy of the database at `url` (no connection may be open to it)."""
        self.made += 1
        data_dir = self.root / f"data{self.made}"
        data_dir.mkdir()
        if self.server is None:
            source = Path(url.removeprefix("sqlite:///"))
            shutil.copyfile(source, data_dir / "jobsup.db")
            return f"sqlite:///{data_dir / 'jobsup.db'}", data_dir
        name = f"t_upgrade_{self.made}_{os.getpid()}"
        template = url.rsplit("/", 1)[1]
        self.server.admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        self.to_drop.append(name)
        return self.server.url(name), data_dir

    def drop(self, url: str) -> None:
        if self.server is not None:
            name = url.rsplit("/", 1)[1]
            self.server.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            self.to_drop.remove(name)

    def close(self) -> None:
        for name in list(self.to_drop):
            assert self.server is not None
            self.server.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def databases(database_kind: str, tmp_path: Path,
              request: pytest.FixtureRequest) -> Iterator[Databases]:
    made = Databases(database_kind, tmp_path, request)
    try:
        yield made
    finally:
        made.close()


@contextmanager
def started(url: str, data_dir: Path) -> Iterator[Engine]:
    """The daemon's start on that database: checked, upgraded, rebuilt if lost."""
    engine = open_database(Settings(data_dir=data_dir, database_url=url))
    try:
        yield engine
    finally:
        engine.dispose()


def reference_schema(databases: Databases) -> dict[str, Any]:
    url, _ = databases.new()
    engine = make_engine(url)
    upgrade(engine)
    found = schema(engine)
    engine.dispose()
    databases.drop(url)
    assert found["version"] == head()
    return found


def each_kill(databases: Databases, source_url: str,
              check: Callable[[Engine], None]) -> int:
    """Kill the upgrade of a copy of `source_url` after each of its statements in turn;
    after each kill, the daemon's start must finish the upgrade and `check` the result.
    The number of statements of the whole upgrade."""
    url, _ = databases.copy(source_url)
    total = upgrade_killed_after(url, None)
    databases.drop(url)
    assert total > 5
    for n in range(1, total + 1):
        url, data_dir = databases.copy(source_url)
        assert upgrade_killed_after(url, n) == n
        try:
            with started(url, data_dir) as engine:
                check(engine)
        except BaseException as exc:
            raise AssertionError(f"after a kill at statement {n} of {total}: {exc}") from exc
        databases.drop(url)
    return total


def test_a_fresh_database_killed_after_any_statement_is_upgraded_at_the_next_start(
        databases: Databases) -> None:
    want = reference_schema(databases)
    empty, _ = databases.new()
    if databases.kind == "sqlite":  # an empty file is what a first start finds: none
        Path(empty.removeprefix("sqlite:///")).touch()

    def check(engine: Engine) -> None:
        assert schema(engine) == want

    total = each_kill(databases, empty, check)
    print(f"{databases.kind}: killed after each of {total} statements from an empty database")


def test_rows_survive_an_upgrade_killed_after_any_statement(databases: Databases) -> None:
    want = reference_schema(databases)
    url, _ = databases.new()
    rows = seed(url)
    assert all(rows.values())

    def check(engine: Engine) -> None:
        assert schema(engine) == want
        assert row_counts(engine, TABLES_AT_0003) == rows
        with engine.connect() as conn:
            event_ids = conn.execute(text(
                "SELECT destination, event_id FROM notifications")).all()
        assert all(event_id for _, event_id in event_ids)

    total = each_kill(databases, url, check)
    print(f"{databases.kind}: killed after each of {total} statements from {SEEDED_AT}")


def test_the_daemon_starts_after_its_upgrade_was_killed_in_a_table_copy(
        databases: Databases) -> None:
    """The issue's case: killed inside 0005's copy-and-swap of `notifications` (after
    `CREATE TABLE _alembic_tmp_notifications`), then a real `jobsup serve`."""
    url, _ = databases.new()
    seed(url)
    probe, _ = databases.copy(url)
    statements: list[str] = []
    engine = make_engine(probe)
    event.listen(engine, "after_cursor_execute",
                 lambda *args: statements.append(str(args[2])))
    upgrade(engine)
    engine.dispose()
    databases.drop(probe)
    if databases.kind == "sqlite":
        n = next(i for i, s in enumerate(statements, 1) if "_alembic_tmp_notifications" in s)
    else:
        n = next(i for i, s in enumerate(statements, 1) if "event_id" in s)
    killed, data_dir = databases.copy(url)
    assert upgrade_killed_after(killed, n) == n
    env = {} if databases.kind == "sqlite" else {"JOBSUP_DATABASE_URL": killed}
    daemon = Daemon(data_dir, env).start()
    try:
        jobs = daemon.http.get("/api/v1/jobs").json()
        assert sorted(j["id"] for j in jobs) == ["job0", "job1", "job2"]
    finally:
        daemon.shut_down()


def test_a_database_an_older_jobsup_left_half_upgraded_is_set_aside_by_rebuild_db(
        tmp_path: Path) -> None:
    """Before #30 a killed upgrade left SQLite half-upgraded (its DDL committed a
    statement at a time): the daemon says so in two lines, without a traceback, and
    `--rebuild-db` sets the file aside and rebuilds the jobs from the data dir."""
    daemon = Daemon(tmp_path / "data").start()
    try:
        job = daemon.submit(python_job("print('done')"), name="kept")["id"]
        daemon.wait_state(job, "succeeded")
    finally:
        daemon.stop()
    db = daemon.data_dir / "jobsup.db"
    for path in daemon.data_dir.glob("jobsup.db*"):
        path.unlink()
    url = f"sqlite:///{db}"
    seed(url)
    with closing(sqlite3.connect(db)) as conn:  # what a kill left of 0004: its index
        conn.execute("CREATE INDEX ix_samples_t ON samples (t)")

    refused = subprocess.run(
        [PY, "-m", "supervisor", "serve", "--port", str(daemon.port), "--data-dir",
         str(daemon.data_dir)], env=daemon.env, cwd=REPO, capture_output=True, text=True,
        timeout=60)
    output = " ".join((refused.stdout + refused.stderr).split())  # rich wraps at 80 columns
    assert refused.returncode == 1, output
    assert f"error: the database {db} was left half-upgraded" in output, output
    assert "hint: jobsup serve --rebuild-db moves it aside" in output
    assert "Traceback" not in output

    daemon.env["JOBSUP_REBUILD_DB"] = "1"
    daemon.start()
    try:
        assert daemon.job(job)["state"] == "succeeded"
        assert "moved the half-upgraded database aside" in daemon.log()
        aside = [p for p in daemon.data_dir.glob("jobsup.db.half-upgraded-*")
                 if not p.name.endswith(("-wal", "-shm"))]
        with closing(sqlite3.connect(aside[0])) as conn:
            assert conn.execute("SELECT count(*) FROM samples").fetchone() == (3,)
    finally:
        daemon.shut_down()
