"""Fixtures and pytest hooks; the helpers they build on are in `tests/helpers.py`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.notify import Destination, Notifier
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from tests.helpers import Clock, Daemon, Receiver, make_model


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    daemons: list[Daemon] = []

    def make(env: dict[str, str] | None = None, data_dir: Path | None = None,
             start: bool = True, log_dir: Path | None = None) -> Daemon:
        daemon = Daemon(data_dir or tmp_path / f"data{len(daemons)}", env, log_dir)
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
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """A migrated SQLite database of its own, as the daemon makes it."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
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
