"""The daemon's HTTP server (`app._Server`): its loop sleeps until it is asked to exit,
instead of waking ten times a second as uvicorn's does, so asking it to exit must wake it
at once: from another thread (`stop`, the PostgreSQL lock guard's way) and through a
signal (`handle_exit`), even one the kernel gives another thread; and the Date header,
which uvicorn's wakes renewed, is renewed by the responses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import pytest
import uvicorn

from supervisor.daemon.app import _Server
from tests.helpers import REPO, free_port

pytestmark = pytest.mark.timeout(60)



async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


def running_server() -> tuple[_Server, threading.Thread, int]:
    """A server up, answering; its loop asleep with no timeout: only a wake-up ends it."""
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
    assert response.headers["date"]
    return server, thread, port


def test_stop_from_another_thread_ends_the_server_at_once() -> None:
    server, thread, _ = running_server()
    time.sleep(0.3)  # the housekeeping loop is asleep
    server.stop()
    thread.join(10)
    assert not thread.is_alive()  # not the 30 s of its sleep


def test_a_signal_ends_the_server_at_once() -> None:
    server, thread, _ = running_server()
    time.sleep(0.3)
    server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler calls, in this thread
    thread.join(10)
    assert not thread.is_alive()


def test_the_date_header_is_of_the_request_s_second() -> None:
    """No loop wakes to renew it: a request a few seconds after the last still gets its
    own second's Date, not the one the server started with."""
    server, thread, port = running_server()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:  # one connection
            first = parsedate_to_datetime(client.get("/").headers["date"])
            time.sleep(2.2)
            before = time.time()
            second = parsedate_to_datetime(client.get("/").headers["date"])
            after = time.time()
    finally:
        server.stop()
        thread.join(10)
    assert (second - first).total_seconds() >= 2
    assert int(before) - 1 <= second.timestamp() <= after  # (the header has whole seconds)


SIGNALLED_SERVER = r"""
import signal, sys, threading, time
import uvicorn
from supervisor.daemon import app
from tests.test_server_loop import hello

if sys.argv[2] == "no-wakeup":  # the check of the test itself: without the wakeup fd
    app._wake_on_signals = lambda loop: (lambda: None)
# a thread that takes SIGTERM, the main thread blocking it: the kernel delivers it there
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
app._Server(uvicorn.Config(hello, host="127.0.0.1", port=int(sys.argv[1]), lifespan="off",
                           log_level="warning")).run()
"""


@pytest.mark.parametrize("variant", ["wakeup", "no-wakeup"])
def test_a_signal_taken_by_another_thread_ends_the_idle_server(variant: str) -> None:
    """The loop sleeps with no timeout; uvicorn's handler runs in the main thread only
    when that thread runs Python code again. A SIGTERM the kernel delivers to another
    thread (here the main thread blocks it) must still wake it: through the wakeup fd
    (`_wake_on_signals`). Without it (the second case, checking the test) the idle
    server sleeps on."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED_SERVER, str(port), variant],
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
        time.sleep(1.5)  # idle, asleep
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
        assert ended is (variant == "wakeup")
    finally:
        proc.kill()
        proc.wait(10)
