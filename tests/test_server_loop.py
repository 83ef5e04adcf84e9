"""The daemon's HTTP server (`app._Server`): its housekeeping loop wakes once a second
instead of uvicorn's ten times, so asking it to exit must wake it at once: from another
thread (`stop`, the PostgreSQL lock guard's way) and through a signal (`handle_exit`)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from supervisor.daemon.app import _Server

pytestmark = pytest.mark.timeout(60)


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def running_server(monkeypatch: pytest.MonkeyPatch) -> tuple[_Server, threading.Thread, int]:
    """A server whose housekeeping would sleep 30 s: only a wake-up ends it sooner."""
    monkeypatch.setattr(_Server, "HOUSEKEEPING_S", 30.0)
    port = free_port()
    server = _Server(uvicorn.Config(hello, host="127.0.0.1", port=port, lifespan="off",
                                    log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    response = httpx.get(f"http://127.0.0.1:{port}/")
    assert (response.status_code, response.text) == (200, "hi")
    assert response.headers["date"]  # uvicorn's Date header, set by the housekeeping
    return server, thread, port


def test_stop_from_another_thread_ends_the_server_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    server, thread, _ = running_server(monkeypatch)
    time.sleep(0.3)  # the housekeeping loop is asleep
    server.stop()
    thread.join(10)
    assert not thread.is_alive()  # not the 30 s of its sleep


def test_a_signal_ends_the_server_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    server, thread, _ = running_server(monkeypatch)
    time.sleep(0.3)
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler calls, in this thread
    thread.join(10)
    assert not thread.is_alive()
