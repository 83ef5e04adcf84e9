"""The daemon's HTTP server, stock uvicorn as `app.serve` runs it (#31: no override of its
loop): asking it to exit ends it at once, from another thread (`should_exit`, the
PostgreSQL lock guard's way) and through a signal, even one the kernel gives another
thread; the Date header is of each response's second; the daemon says it is ready once
its port is bound. What the daemon needs of uvicorn's own loop: a uvicorn whose loop
stopped waking would fail here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.helpers import REPO, Daemon, free_port, wait_for

pytestmark = pytest.mark.timeout(60)



async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


def running_server() -> tuple[uvicorn.Server, threading.Thread, int]:
    """A server up, answering, as the daemon's is."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=port, lifespan="off",
                                    log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    response = httpx.get(f"http://127.0.0.1:{port}/")
    assert (response.status_code, response.text) == (200, "hi")
    assert response.headers["date"]
    return server, thread, port


def test_stop_from_another_thread_ends_the_server_at_once() -> None:
    server, thread, _ = running_server()
    time.sleep(0.3)  # the housekeeping loop is asleep
    server.should_exit = True  # as the lock guard's `exit`, from another thread
    thread.join(1)
    assert not thread.is_alive()


def test_a_signal_ends_the_server_at_once() -> None:
    server, thread, _ = running_server()
    time.sleep(0.3)
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler calls, in this thread
    thread.join(1)
    assert not thread.is_alive()


def test_the_date_header_is_of_the_request_s_second() -> None:
    """A request a few seconds after the last gets its own second's Date, not the one
    the server started with."""
    server, thread, port = running_server()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:  # one connection
            first = parsedate_to_datetime(client.get("/").headers["date"])
            time.sleep(2.2)
            before = time.time()
            second = parsedate_to_datetime(client.get("/").headers["date"])
            after = time.time()
    finally:
        server.should_exit = True
        thread.join(10)
    assert (second - first).total_seconds() >= 2
    assert int(before) - 1 <= second.timestamp() <= after  # (the header has whole seconds)


SIGNALLED_SERVER = r"""
import signal, sys, threading, time
import uvicorn
from tests.test_server_loop import hello

# a thread that takes SIGTERM, the main thread blocking it: the kernel delivers it there
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
uvicorn.Server(uvicorn.Config(hello, host="127.0.0.1", port=int(sys.argv[1]), lifespan="off",
                              log_level="warning")).run()
"""


def test_a_signal_taken_by_another_thread_ends_the_idle_server() -> None:
    """uvicorn's handler runs in the main thread only when that thread runs Python code
    again: a SIGTERM the kernel delivers to another thread (here the main thread blocks
    it) still ends the idle server, as its loop wakes ten times a second."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_SERVER, str(port)],
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "no server"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        time.sleep(0.5)  # idle
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)
    finally:
        proc.kill()
        proc.wait(10)


def test_the_daemon_says_it_is_ready_once_its_port_is_bound(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "data").start()
    try:
        line = wait_for(lambda: next((line for line in daemon.log().splitlines()
                                      if "jobsup daemon ready on" in line), None), 10,
                        what="the ready line")
        assert f"http://127.0.0.1:{daemon.port}" in line
    finally:
        daemon.stop()
