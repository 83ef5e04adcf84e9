"""A throwaway PostgreSQL server for the tests that run against PostgreSQL as well as
SQLite (`tests/conftest.py`: the `database_kind` parameter). Debian's `postgresql`
(./dev.sh installs it) provides the binaries; each pytest process (each xdist worker)
starts its own server in a temporary directory, on a free loopback port with fsync off,
and each test gets a database of its own, dropped after it. Nothing is shared between
workers, so `-n 3 --dist loadfile` needs no coordination: 3 small servers at most."""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import free_port

PG_ROOT = Path("/usr/lib/postgresql")
"""Where Debian installs each major version's binaries (`<version>/bin`)."""

START_TIMEOUT_S = 60.0
SUPERUSER = "postgres"


def postgres_bin() -> Path:
    """The newest installed version's bin directory, or the test fails saying what to
    install: a PostgreSQL test that skips would hide the very thing it is there for."""
    versions = sorted((d for d in PG_ROOT.glob("*") if (d / "bin" / "postgres").exists()),
                      key=lambda d: [int(n) for n in re.findall(r"\d+", d.name)] or [0])
    if not versions:
        pytest.fail(f"PostgreSQL is not installed (no {PG_ROOT}/<version>/bin/postgres): the "
                    "store, API and restart tests run against it too. ./dev.sh test installs "
                    "it (Debian: apt-get install postgresql)", pytrace=False)
    return versions[-1] / "bin"


class PostgresServer:
    """`initdb` + `postgres` in a directory of their own, stopped by `stop()`. As root
    both run as the `postgres` user (PostgreSQL refuses to run as root)."""

    def __init__(self) -> None:
        self.bin = postgres_bin()
        self.root = Path(tempfile.mkdtemp(prefix="jobsup-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam(SUPERUSER)
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", SUPERUSER, "--"]

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        data = self.root / "data"
        initdb = subprocess.run(
            [*self.as_user, str(self.bin / "initdb"), "-D", str(data), "-U", SUPERUSER,
             "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"],
            capture_output=True, text=True, check=False)
        if initdb.returncode != 0:
            pytest.fail(f"initdb failed ({initdb.returncode}):\n{initdb.stdout}{initdb.stderr}",
                        pytrace=False)
        for _ in range(3):  # another process may take the free port first
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [*self.as_user, str(self.bin / "postgres"), "-D", str(data),
                     "-p", str(self.port), "-k", str(self.root),
                     "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                     "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                     "-c", "max_connections=200", "-c", "shared_buffers=32MB",
                     # no parallel query: its segments live in /dev/shm, 64 MB in a container
                     "-c", "max_parallel_workers_per_gather=0"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            if self._wait_until_accepting():
                return self
            self.port = free_port()
        pytest.fail(f"postgres could not bind a port:\n{self.log()}", pytrace=False)

    def _wait_until_accepting(self) -> bool:
        """True once it accepts connections; False if it exited for want of its port."""
        import psycopg

        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                if "could not bind" in self.log() or "already in use" in self.log():
                    return False
                pytest.fail(f"postgres exited {self.proc.returncode}:\n{self.log()}",
                            pytrace=False)
            try:
                psycopg.connect(self._dsn("postgres"), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"postgres did not accept connections within "
                                f"{START_TIMEOUT_S:.0f} s:\n{self.log()}", pytrace=False)
                time.sleep(0.1)

    def _dsn(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={database}"

    def admin(self, sql: str) -> None:
        """Run a statement as the superuser, outside a transaction (CREATE DATABASE);
        the tests' own SQL, never input."""
        import psycopg

        with psycopg.connect(self._dsn("postgres"), autocommit=True) as conn:
            conn.execute(sql.encode())

    @contextmanager
    def database(self) -> Iterator[str]:
        """A new empty database for one test; its URL. Dropped after, with whatever
        connections a killed daemon left to it."""
        name = f"t_{secrets.token_hex(6)}"
        self.admin(f'CREATE DATABASE "{name}"')
        try:
            yield self.url(name)
        finally:
            self.admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Fast shutdown (SIGINT: clients disconnected, no waiting for them), then the
        directory goes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)
