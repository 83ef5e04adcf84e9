"""Fixtures and pytest hooks; the helpers they build on are in `tests/helpers.py`.

The database: SQLite in the test's directory, as the daemon makes it by default. A test
marked `both_databases` (or in a module so marked) that uses the database (`sessions`,
`database_url`, the `daemon`/`make_daemon` fixtures) runs twice, `[sqlite]` and
`[postgresql]`, the second against a throwaway PostgreSQL server (`tests/postgres.py`)
with a new database per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.notify import Notifier
from supervisor.alerting.wire import Destination
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from tests.file_order import file_seconds, longest_files_first
from tests.helpers import Clock, Daemon, Receiver, make_model
from tests.postgres import PostgresServer
from tests.slurm_cluster import SlurmCluster, running

DATABASES = ("sqlite", "postgresql")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (`tests/file_order.py`): with `--dist loadfile`, the run
    does not end on one worker's late 2-minute file."""
    longest_files_first(items, file_seconds())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`both_databases`: `database_kind` for each database, unless the test names its own
    (`@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)`)."""
    chosen = any("database_kind" in str(marker.args[0])
                 for marker in metafunc.definition.iter_markers("parametrize"))
    if ("database_kind" in metafunc.fixturenames and not chosen
            and metafunc.definition.get_closest_marker("both_databases")):
        metafunc.parametrize("database_kind", DATABASES, indirect=True)


@pytest.fixture
def database_kind(request: pytest.FixtureRequest) -> str:
    """`sqlite`, or `postgresql` for the second run of a `both_databases` test."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """This process's PostgreSQL server (one per xdist worker), started on first use."""
    server = PostgresServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def new_database(request: pytest.FixtureRequest, database_kind: str,
                 tmp_path: Path) -> Iterator[Callable[[], str | None]]:
    """Makes a new empty database of the test's kind; its URL, or None for SQLite (the
    daemon's default: its data dir's `jobsup.db`). PostgreSQL databases are dropped after
    the test."""
    with ExitStack() as stack:

        def make() -> str | None:
            if database_kind == "sqlite":
                return None
            server: PostgresServer = request.getfixturevalue("postgres_server")
            return stack.enter_context(server.database())

        yield make


@pytest.fixture
def database_url(new_database: Callable[[], str | None], tmp_path: Path) -> str:
    """The URL of a new empty database of the test's kind."""
    return new_database() or f"sqlite:///{tmp_path / 'db.sqlite'}"


@pytest.fixture
def make_daemon(tmp_path: Path,
                new_database: Callable[[], str | None]) -> Iterator[Callable[..., Daemon]]:
    """Daemons on data dirs of their own. Against PostgreSQL each data dir gets a
    database of its own (`JOBSUP_DATABASE_URL`), kept when a daemon reuses the dir."""
    daemons: list[Daemon] = []
    databases: dict[Path, str | None] = {}

    def make(env: dict[str, str] | None = None, data_dir: Path | None = None,
             start: bool = True, log_dir: Path | None = None) -> Daemon:
        data_dir = data_dir or tmp_path / f"data{len(daemons)}"
        if data_dir not in databases:
            databases[data_dir] = new_database()
        url = databases[data_dir]
        env = {**({"JOBSUP_DATABASE_URL": url} if url else {}), **(env or {})}
        daemon = Daemon(data_dir, env, log_dir)
        daemons.append(daemon)
        return daemon.start() if start else daemon

    yield make
    for daemon in daemons:
        daemon.shut_down()


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Daemon:
    return make_daemon()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated database of its own, as the daemon makes it."""
    engine = make_engine(database_url)
    upgrade(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture
def make_notifier(sessions: sessionmaker[Session],
                  clock: Clock) -> Iterator[Callable[..., Notifier]]:
    made: list[Notifier] = []

    def make(*destinations: Destination, secret: str | None = None) -> Notifier:
        notifier = Notifier(list(destinations), sessions, clock=clock, webhook_secret=secret)
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.stop()  # no thread was started: this closes its HTTP client


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One default daemon (loopback, no token) for a module's tests that only send
    requests, started once per module."""
    daemon = Daemon(tmp_path_factory.mktemp("shared") / "data").start()
    try:
        yield daemon
    finally:
        daemon.shut_down()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (8 layers, hidden 64), built once per module."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """For a test module of tiny torch models (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): tiny ops gain nothing from intra-op threads, and on a busy 2-core
    machine two spinning OpenMP threads made a 0.1 s step take 8 s."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """A one-node SLURM cluster on loopback (tests/slurm_cluster.py) for a module's
    tests, `SLURM_CONF` pointing at it meanwhile. Fails, never skips, without SLURM."""
    with running() as slurm:
        yield slurm
