"""Benchmark: legitimate requests while SLOW connections upload request bodies slowly (#46).

Starts a real daemon (``python -m supervisor serve`` from ``--source`` on a free loopback
port, a temp data dir, the default open-file limit: 1,024 HTTP connections kept where the
hard limit allows 8,192 files) and measures two windows of SECONDS each:

* quiet: CLIENTS threads send requests, each on a new connection (no keep-alive: a
  client that comes during a flood must get a connection first), by turns
  ``GET /healthz``, ``GET /api/v1/jobs``, ``GET /`` (the status page) and
  ``POST /api/v1/jobs`` (a JobSpec sent whole with its head: a job running ``true``),
  pausing ``--pause-s`` between two;
* flood: the same while SLOW connections each send ``POST PATH`` with
  ``Content-Length: 1000`` and the body's first byte, then one more byte every
  ``--dribble-s`` seconds, never the last. The attacker keeps SLOW connections: one the
  daemon closes (or refuses) is opened again at the next dribble (``--no-reconnect``: the
  first SLOW only). Its connections are opened before the window begins.

Per route and window: requests, failures (a connection reset or refused, a timeout of
``--timeout-s``, a status other than 200/201), and latency p50/p99/max around the whole
request, connection included; a failed request counts as slower than any answer.
For the slow connections: how many were opened, answered 408 (and in how long after their
head), closed or refused without an answer, and how many the daemon held at once.

    python bench/slow_bodies.py [--slow 1100] [--seconds 30] [--clients 2]
    python bench/slow_bodies.py --source /tmp/old --label "commit 44b536b"

Prints a markdown table (docs/security.md, "Slow request bodies", holds the results).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import REPO, Daemon, machine, ms  # noqa: E402

ROUTES = ("GET /healthz", "GET /api/v1/jobs", "GET /", "POST /api/v1/jobs")
SPEC = {"name": "prompt-submit", "command": ["true"], "labels": {"bench": "slow-bodies"}}
CONTENT_LENGTH = 1000
"""What each slow upload announces; it sends all but the last byte, one at a time."""
FAILED = float("inf")


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile by nearest rank (a FAILED value stays one: no interpolation
    between an answer and a failure)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class RouteStats:
    latencies_s: list[float] = field(default_factory=list)
    """Each request's, a failure as FAILED."""
    errors: list[str] = field(default_factory=list)


def legitimate(url: str, deadline: float, pause_s: float, timeout_s: float, first: int,
               stats: dict[str, RouteStats]) -> None:
    """Requests by turns until `deadline`, each on a new connection."""
    limits = httpx.Limits(max_keepalive_connections=0)
    turn = first
    with httpx.Client(base_url=url, timeout=timeout_s, limits=limits) as http:
        while time.monotonic() < deadline:
            route = ROUTES[turn % len(ROUTES)]
            turn += 1
            method, path = route.split(" ", 1)
            route_stats = stats.setdefault(route, RouteStats())
            started = time.perf_counter()
            try:
                response = (http.post(path, json=SPEC) if method == "POST"
                            else http.get(path))
                error = (None if response.status_code in (200, 201)
                         else f"{response.status_code} {response.text[:200]}")
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
            elapsed = time.perf_counter() - started
            route_stats.latencies_s.append(FAILED if error else elapsed)
            if error:
                route_stats.errors.append(error)
            time.sleep(pause_s)


def run_window(url: str, seconds: float, clients: int, pause_s: float,
               timeout_s: float) -> dict[str, RouteStats]:
    deadline = time.monotonic() + seconds
    per_thread: list[dict[str, RouteStats]] = [{} for _ in range(clients)]
    threads = [threading.Thread(target=legitimate, daemon=True,
                                args=(url, deadline, pause_s, timeout_s, i, per_thread[i]))
               for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    merged = {route: RouteStats() for route in ROUTES}
    for stats in per_thread:
        for route, route_stats in stats.items():
            merged[route].latencies_s += route_stats.latencies_s
            merged[route].errors += route_stats.errors
    return merged


@dataclass
class Upload:
    sock: socket.socket
    head_at: float | None = None
    sent: int = 0
    answer: bytes = b""
    closed_at: float | None = None


class SlowBodies:
    """The attacker: `count` connections uploading a body a byte every `dribble_s`, in one
    thread polling them all."""

    def __init__(self, port: int, count: int, path: str, dribble_s: float, reconnect: bool):
        self.port = port
        self.count = count
        self.head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Type: application/json\r\n"
                     f"Content-Length: {CONTENT_LENGTH}\r\n\r\n{{").encode()
        self.dribble_s = dribble_s
        self.reconnect = reconnect
        self.open: dict[int, Upload] = {}
        self.ended: list[Upload] = []
        self.opened = 0
        self.still_open = 0
        """Connections still open when the attacker stopped."""
        self.stop = threading.Event()
        self.poller = select.poll()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def connect(self, wanted: int) -> None:
        for _ in range(wanted):
            s = socket.socket()
            s.setblocking(False)
            if s.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
                s.close()
                continue
            self.open[s.fileno()] = Upload(s)
            self.poller.register(s.fileno(), select.POLLOUT)
            self.opened += 1

    def end(self, fd: int) -> None:
        upload = self.open.pop(fd)
        upload.closed_at = time.monotonic()
        with contextlib.suppress(KeyError, ValueError):
            self.poller.unregister(fd)
        upload.sock.close()
        self.ended.append(upload)

    def run(self) -> None:
        next_dribble = time.monotonic() + self.dribble_s
        while not self.stop.is_set():
            for fd, _ in self.poller.poll(100):
                upload = self.open.get(fd)
                if upload is None:
                    continue
                try:
                    if upload.head_at is None:
                        if upload.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                            raise ConnectionRefusedError
                        upload.sock.send(self.head)
                        upload.head_at, upload.sent = time.monotonic(), 1
                        self.poller.modify(fd, select.POLLIN)
                        continue
                    data = upload.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    self.end(fd)
                    continue
                if not data:
                    self.end(fd)
                else:
                    upload.answer += data
            if time.monotonic() >= next_dribble:
                next_dribble += self.dribble_s
                for fd, upload in list(self.open.items()):
                    if upload.head_at is None or upload.sent >= CONTENT_LENGTH - 1:
                        continue
                    try:
                        upload.sock.send(b" ")
                        upload.sent += 1
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.end(fd)
                if self.reconnect:
                    self.connect(self.count - len(self.open))
        self.still_open = len(self.open)
        for upload in self.open.values():
            upload.sock.close()
        self.open.clear()

    def start(self) -> None:
        self.connect(self.count)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(30)


def established(pid: int, port: int) -> int:
    """The daemon's open connections on its port."""
    try:
        return sum(1 for c in psutil.Process(pid).net_connections("tcp")
                   if c.laddr and c.laddr.port == port and c.status == "ESTABLISHED")
    except psutil.Error:
        return -1


def hold(daemon: Daemon, port: int, stop: threading.Event, counts: list[int]) -> None:
    assert daemon.proc is not None
    while not stop.wait(2.0):
        counts.append(established(daemon.proc.pid, port))


def route_rows(window: str, stats: dict[str, RouteStats]) -> list[str]:
    rows = []
    everything = RouteStats()
    for route, route_stats in [*stats.items(), ("**all**", everything)]:
        if route != "**all**":
            everything.latencies_s += route_stats.latencies_s
            everything.errors += route_stats.errors
        values = route_stats.latencies_s
        rows.append(f"| {window} | {route} | {len(values)} | {len(route_stats.errors)} | "
                    f"{ms(percentile(values, 50))} | {ms(percentile(values, 99))} | "
                    f"{ms(max(values, default=float('nan')))} |")
    return rows


def slow_rows(slow: SlowBodies, held: list[int]) -> list[str]:
    ended = slow.ended
    answered = [u for u in ended if u.answer.startswith(b"HTTP/1.1 408")]
    cut_s = sorted(u.closed_at - u.head_at for u in answered
                   if u.closed_at is not None and u.head_at is not None)
    other = [u for u in ended if u.answer and u not in answered]
    silent = [u for u in ended if not u.answer and u.head_at is not None]
    refused = [u for u in ended if u.head_at is None]
    return [
        "| slow connections | count |",
        "| --- | ---: |",
        f"| opened (with re-openings) | {slow.opened} |",
        f"| answered 408 and closed | {len(answered)} |",
        f"| time from head to the 408's close, p50 / max | "
        f"{percentile(cut_s, 50):.2f} s / {max(cut_s, default=float('nan')):.2f} s |",
        f"| answered otherwise | {len(other)} "
        f"{sorted({u.answer[:12].decode(errors='replace') for u in other})} |",
        f"| closed without an answer after their head | {len(silent)} |",
        f"| refused or reset before their head was sent | {len(refused)} |",
        f"| still open at the end | {slow.still_open} |",
        f"| the daemon's connections, sampled every 2 s: median / max | "
        f"{percentile([float(h) for h in held], 50):.0f} / {max(held, default=0)} |",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow", type=int, default=1100, help="slow uploads held at once")
    parser.add_argument("--path", default="/api/v1/jobs", help="what they POST to")
    parser.add_argument("--seconds", type=float, default=30, help="each window")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--pause-s", type=float, default=0.05,
                        help="each client's pause between two requests")
    parser.add_argument("--timeout-s", type=float, default=5)
    parser.add_argument("--dribble-s", type=float, default=2.0)
    parser.add_argument("--no-reconnect", dest="reconnect", action="store_false",
                        help="open SLOW connections once; do not replace those closed")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the source tree the daemon runs from (e.g. a `git archive` "
                             "of a commit); default this repo")
    parser.add_argument("--label", default=None, help="what --source is, for the report")
    parser.add_argument("--keep-data", action="store_true")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # SLOW sockets of ours
    if args.label is None:
        described = subprocess.run(["git", "-C", str(args.source), "describe", "--always",
                                    "--dirty"], capture_output=True, text=True)
        args.label = (f"commit {described.stdout.strip()}" if described.returncode == 0
                      else str(args.source))

    data_dir = Path(tempfile.mkdtemp(prefix="jobsup-slow-bodies-"))
    daemon = Daemon(data_dir, 2.0, args.source.resolve())
    port = int(daemon.url.rsplit(":", 1)[1])
    slow = SlowBodies(port, args.slow, args.path, args.dribble_s, args.reconnect)
    stop_holding = threading.Event()
    held: list[int] = []
    try:
        daemon.start()
        assert daemon.proc is not None
        quiet = run_window(daemon.url, args.seconds, args.clients, args.pause_s,
                           args.timeout_s)
        slow.start()
        time.sleep(2 * args.dribble_s)  # every connection made and its head read
        holder = threading.Thread(target=hold, args=(daemon, port, stop_holding, held),
                                  daemon=True)
        holder.start()
        flood = run_window(daemon.url, args.seconds, args.clients, args.pause_s,
                           args.timeout_s)
        stop_holding.set()
        slow.finish()
    finally:
        slow.finish()
        stop_holding.set()
        daemon.terminate()
        log = daemon.log()
        if args.keep_data:
            print(f"data dir kept: {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)

    lines = [
        f"{args.label}; {machine()}; {args.slow} slow `POST {args.path}` "
        f"(Content-Length {CONTENT_LENGTH}, a byte every {args.dribble_s:g} s"
        f"{', each one closed opened again' if args.reconnect else ''}); {args.clients} "
        f"clients, a new connection per request, {args.pause_s:g} s apart; "
        f"{args.seconds:g} s per window; timeout {args.timeout_s:g} s.",
        "",
        "| window | route | requests | failed | p50 ms | p99 ms | max ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *route_rows("quiet", quiet),
        *route_rows(f"{args.slow} slow bodies", flood),
        "",
        *slow_rows(slow, held),
    ]
    errors = sorted({e[:120] for s in flood.values() for e in s.errors})
    print("\n".join(lines))
    if errors:
        print("\nfailures (distinct):\n" + "\n".join(f"- {e}" for e in errors[:10]))
    problems = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line
                or "Traceback" in line]
    print(f"\ndaemon log: {len(problems)} warning/error line(s)")
    print("\n".join(problems[:10]))
    return 1 if any(s.errors for s in flood.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
