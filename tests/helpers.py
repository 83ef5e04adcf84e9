"""Helpers the tests import: a real daemon process on a free loopback port, a stand-in
Slack receiver, job argv builders, a fake clock and the tiny worker inputs. A plain
module: the fixtures built on these live in `tests/conftest.py`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil
import pytest

from supervisor.runtime import files
from supervisor.runtime.fileio import read_json

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


PORT_TRIES = 3
"""Ports a daemon's first start tries (`Daemon.start`)."""
DAEMON_START_S = 60.0
"""How long `Daemon.start` waits for /healthz, in the daemon's own time: the time it
spent waiting for a CPU does not count (`cpu_wait_s`). A start takes ~2 s of CPU, but 20 s
did not always do on 2 loaded cores (#33), and neither did 60 s of wall-clock time on 2
cores saturated by busy loops of a higher priority (`nice -n 5`, the tests at 19): a
start took 115 s, 112 s of them waiting for a CPU, and test_api_pages's setup failed
with nothing logged yet (its imports). A daemon that fails to start exits, which is seen
at once; one that hangs still fails after 60 s of its own."""


class PortTaken(AssertionError):
    """The daemon exited: its port was taken before it could bind it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05,
             what: str | Callable[[], str] = "condition",
             cpu_wait: Callable[[], float] | None = None) -> Any:
    """`predicate()`'s first true value, polled every `interval` s for up to `timeout` s.
    `what` names the condition in the failure; a callable is asked at the failure, so it
    can tell what was seen last. `cpu_wait`: the seconds the process that must bring the
    condition about has waited for a CPU (`cpu_wait_s`); what it waited since the call
    does not count against `timeout`, so a starved process gets its `timeout` s all the
    same."""
    began = time.monotonic()
    waited_before = cpu_wait() if cpu_wait is not None else 0.0

    def waited() -> float:
        return cpu_wait() - waited_before if cpu_wait is not None else 0.0

    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() - began - waited() > timeout:
            told = what() if callable(what) else what
            starved = f" (and {waited():.0f} s it waited for a CPU)" if cpu_wait else ""
            raise AssertionError(f"timed out after {timeout} s{starved} waiting for {told}")
        time.sleep(interval)


def cpu_wait_s(pid: int) -> float:
    """Seconds the process's threads have spent runnable but waiting for a CPU, summed
    over its threads (the second field of each `/proc/PID/task/TID/schedstat`: the
    daemon's tick runs on a thread of its own, its HTTP server on the main one); 0 where
    the kernel does not say, or the process is gone. Two threads waiting at once count
    twice: an allowance, not a clock."""
    waited = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                waited += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):  # a thread gone meanwhile
            continue
    return waited / 1e9


class Daemon:
    """`python -m supervisor serve` as a child process of the test."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None,
                 log_dir: Path | None = None, cwd: Path = REPO,
                 wrapper: Sequence[str] = ()):
        self.data_dir = data_dir
        self.wrapper = list(wrapper)
        """A command the daemon runs under (`setpriv ... --`), if any."""
        self.log_dir = log_dir or data_dir
        self.cwd = cwd
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")}
        self.env = {**inherited, "JOBSUP_SAMPLE_INTERVAL": "0.5", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10)
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"daemon-{self.starts}.log"

    def start(self, wait: bool = True) -> Daemon:
        first = self.starts == 0
        for attempt in range(PORT_TRIES):
            self.starts += 1
            self.data_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [*self.wrapper, PY, "-m", "supervisor", "serve", "--port", str(self.port),
                     "--data-dir", str(self.data_dir)],
                    stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                )
            if not wait:
                return self
            try:
                self.wait_started()
                return self
            except PortTaken:
                # `free_port` closed the port it found, and another test's process (a
                # daemon of another xdist worker) took it before this daemon could bind
                # it. A new port, on a first start only: a restarted daemon keeps its URL
                # (a test, or its Prometheus, holds it)
                if not first or attempt == PORT_TRIES - 1:
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.http.base_url = httpx.URL(self.url)  # (its headers kept: a token)
        raise AssertionError("unreachable")

    def wait_started(self, timeout: float = DAEMON_START_S) -> None:
        """Until it answers /healthz, for `timeout` s of its own time (`DAEMON_START_S`);
        a timeout tells what it logged by then (an exit tells it at once: `_healthy`)."""
        assert self.proc is not None
        pid = self.proc.pid
        wait_for(self._healthy, timeout,
                 what=lambda: f"daemon on {self.url}; its log:\n{self.log()}",
                 cpu_wait=lambda: cpu_wait_s(pid))

    def _healthy(self) -> bool:
        """Our daemon answers /healthz on its port. Another process answering there (a
        daemon of another test that took the port first) is not it: ours then exits,
        unable to bind (`PortTaken`)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            error = PortTaken if "address already in use" in self.log() else AssertionError
            raise error(f"daemon exited {self.proc.returncode}:\n{self.log()}")
        try:
            if self.http.get("/healthz").status_code != 200:
                return False
        except httpx.TransportError:
            return False
        return self._listening()

    def _listening(self) -> bool:
        """The daemon's process holds the listening socket of its port."""
        assert self.proc is not None
        try:
            sockets = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(s.status == psutil.CONN_LISTEN and s.laddr and s.laddr.port == self.port
                   for s in sockets)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def shut_down(self) -> None:
        """Stop the daemon, close the client, and kill every shim and worker it started:
        no job outlives its test."""
        self.stop()
        self.http.close()
        kill_jobs_of(self.data_dir)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    # -- API helpers -------------------------------------------------------------------
    def submit(self, command: list[str], name: str = "job", **spec: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/jobs", json={"name": name, "command": command, **spec})
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.http.get(f"/api/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.http.get(f"/api/v1/jobs/{job_id}/events").json()

    def wait_state(self, job_id: str, *states: str, timeout: float = 15) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["state"] in states else None

        return wait_for(reached, timeout, what=f"job {job_id} in {states}")

    def logs(self, job_id: str, tail: int = 100) -> str:
        return self.http.get(f"/api/v1/jobs/{job_id}/logs", params={"tail": tail}).text

    def ticks(self) -> int:
        """Ticks the engine loop has finished: the count of /metrics' tick histogram."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("jobsup_tick_duration_seconds_count "):
                return int(float(line.split()[1]))
        raise AssertionError("no jobsup_tick_duration_seconds_count in /metrics")

    def wait_ticks(self, count: int, timeout: float = 60) -> None:
        """Wait until the engine loop has run `count` whole ticks begun after this call.
        For a check that something does NOT happen ("still one message", "still
        running"): it gives the daemon that many chances however slow the machine is,
        where a fixed sleep may have covered none."""
        target = self.ticks() + count + 1  # the tick under way now began before the call
        wait_for(lambda: self.ticks() >= target, timeout, what=f"{count} more ticks")


def kill_jobs_of(data_dir: Path) -> None:
    """SIGKILL every shim and worker of the data dir's jobs: those their attempts'
    files record, and those not recorded yet. A daemon that launched an attempt just
    before the test ended (a second daemon's first ticks relaunching a job) leaves a
    shim that has not written its `shim.json`, or has not yet started its worker or
    written its `worker.json`: found by its command line (it names its attempt's
    directory), frozen (SIGSTOP: it starts and records nothing more), and killed with
    every process under it (its worker, and what the subreaper adopted)."""
    jobs_dir = data_dir / "jobs"
    shims = shims_under(jobs_dir)
    for shim in shims:
        with suppress(psutil.Error):
            shim.suspend()
    under = []
    for shim in shims:
        with suppress(psutil.Error):
            under.extend(shim.children(recursive=True))
    for kind, pid in files.live_processes(jobs_dir):
        with suppress(OSError):
            if kind == files.WORKER:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    for proc in under:  # a worker leads its group: what it forks since is in it
        with suppress(OSError, psutil.Error):
            if proc.is_running() and os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in [*under, *shims]:
        with suppress(psutil.Error):
            proc.kill()


def shims_under(jobs_dir: Path) -> list[psutil.Process]:
    """The live shims of attempts under `jobs_dir` (`python -m supervisor.runtime.shim
    ADIR`), whether or not they have recorded themselves."""
    roots = {jobs_dir.absolute(), jobs_dir.resolve()}
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "supervisor.runtime.shim" in argv[:-1] and argv[-1] \
                and Path(argv[-1]).parent.parent in roots:
            found.append(proc)
    return found


def python_job(code: str) -> list[str]:
    """argv running `code` in a fresh Python."""
    return [PY, "-c", code]


class Receiver:
    """A local HTTP server standing in for Slack: records every POST, answers from a
    script of (status, headers) and then 200. With `delay_s`, each answer comes that
    long after the POST was recorded (a slow receiver: acted on, not yet answered);
    `in_flight` counts the POSTs recorded and not yet answered."""

    def __init__(self, delay_s: float = 0.0) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: list[tuple[float, dict[str, Any]]] = []
        self.attempts: list[tuple[float, int]] = []
        self.requests: list[tuple[dict[str, str], bytes]] = []
        """Every POST's headers (lower-case names) and raw body, in order."""
        self.script: list[tuple[int, dict[str, str]]] = []
        self.down_until = 0.0
        """Until this time every POST answers 503 (the service is down)."""
        self.delay_s = delay_s
        self.in_flight = 0
        self.answered: list[float] = []
        """When each answer was written (a client killed first gets none)."""
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("content-length", 0))
                body = self.rfile.read(length)
                if len(body) < length:
                    return  # the client died mid-request: nothing arrived to act on
                with receiver.lock:
                    if time.time() < receiver.down_until:
                        status, headers = 503, {}
                    else:
                        status, headers = (receiver.script.pop(0) if receiver.script
                                           else (200, {}))
                    receiver.attempts.append((time.time(), status))
                    receiver.requests.append(
                        ({k.lower(): v for k, v in self.headers.items()}, body))
                    if status == 200:
                        receiver.posts.append((time.time(), json.loads(body)))
                    receiver.in_flight += 1
                try:
                    time.sleep(receiver.delay_s)
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(b"ok" if status == 200 else b"nope")
                    with receiver.lock:
                        receiver.answered.append(time.time())
                except OSError:
                    pass  # the client went away before the answer (killed mid-request)
                finally:
                    with receiver.lock:
                        receiver.in_flight -= 1

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def texts(self) -> list[str]:
        with self.lock:
            return [body.get("text", "") for _, body in self.posts]

    def open_connections(self) -> int:
        """TCP connections to this receiver that its side has not closed yet (accepted or
        still in the listen queue), whatever became of their client. None left: every
        request a client finished writing has been read and recorded."""
        port = self.server.server_address[1]
        return sum(1 for c in psutil.net_connections(kind="tcp")
                   if c.laddr and c.laddr.port == port and c.status in (
                       psutil.CONN_ESTABLISHED, psutil.CONN_SYN_RECV, psutil.CONN_CLOSE_WAIT))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def exit_recorded(status_file: Path) -> bool:
    """The shim has recorded the worker's exit (the file exists from the launch on,
    holding a reservation, see `supervisor.runtime.shim.STATUS_RESERVED_BYTES`)."""
    try:
        return "ended_at" in json.loads(status_file.read_bytes())
    except (OSError, ValueError):
        return False


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "16m") mounted at `path` for the block: a disk a test can
    fill to the last byte. Needs root (CI and the dev machines run as root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.fail(f"this test mounts a {size} tmpfs and needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextmanager
def in_process_engine(data_dir: Path, clock: Callable[[], float] | None = None,
                      ) -> Iterator[tuple[Any, Any]]:
    """An `Engine` over a fresh SQLite database in `data_dir`, ticked by the test itself
    (a 60 s interval: no tick of its own; `clock` instead of the steady one if given);
    (engine, sessions). Its observer's threads, its backend and every job it started
    end with the block."""
    from supervisor.config import Settings
    from supervisor.daemon.wiring import build_engine
    from supervisor.storage.database import make_engine, make_sessionmaker, upgrade

    settings = Settings(data_dir=data_dir, sample_interval=60)
    settings.jobs_dir.mkdir(parents=True)
    db = make_engine(settings.resolved_database_url)
    upgrade(db)
    sessions = make_sessionmaker(db)
    engine = build_engine(settings, sessions, clock=clock)
    try:
        yield engine, sessions
    finally:
        engine.observer.close()
        engine.backend.close()
        kill_jobs_of(settings.data_dir)
        db.dispose()


T0 = 1_700_000_000.0
"""A fake clock's start, seconds since the epoch."""


class Clock:
    """A fake clock the test moves by hand (notifier and engine unit tests)."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def job_module(name: str, *args: object) -> list[str]:
    """argv running the test job `tests/jobs/<name>.py` (`main()` reads `sys.argv`) in
    a fresh Python, from any working directory."""
    return [PY, str(REPO / "tests" / "jobs" / f"{name}.py"), *map(str, args)]


class Recorded(NamedTuple):
    """A process as the shim recorded it: `is_same_process(*recorded)` checks it."""

    pid: int
    create_time: float
    start_ticks: int


def identity(data_dir: Path, job_id: str, name: str) -> Recorded:
    """The process the shim recorded in `shim.json` / `worker.json` of attempt 1.

    Compare it with a live process by (pid, start ticks): a create time computed in this
    process may differ from the shim's by however much the boot time moved between the
    two reads (a clock step; see `procfs`)."""
    info = read_json(data_dir / "jobs" / job_id / "attempt-1" / name)
    assert isinstance(info, dict), f"no {name} for job {job_id}"
    return Recorded(int(info["pid"]), float(info["create_time"]), int(info["start_ticks"]))


# -- worker tests: a tiny random Llama and a conversations file --------------------------
def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a worker process on tiny torch models: this one's, with one
    intra-op thread (`OMP_NUM_THREADS=1`), as the `one_thread` fixture does in-process.
    On a busy 2-core machine two spinning OpenMP threads made a 384-sample CPU extraction
    cost 61 s of CPU instead of 14 s; tiny ops gain nothing from the second thread."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def make_model(path: Path) -> Path:
    from workers.fixtures.tiny import build_tiny_llama

    return build_tiny_llama(path, layers=8, hidden=64)


def make_conversations(path: Path, copies: int = 1) -> Path:
    """The demo prompts with assistant answers of varied length (some with reasoning)."""
    from workers.fixtures.tiny import DEMO_PROMPTS

    with open(path, "w") as f:
        n = 0
        for _ in range(copies):
            for line in DEMO_PROMPTS.read_text().splitlines():
                record = json.loads(line)
                record["id"] = f"{record['id']}-{n}"
                words = " ".join(["token"] * (3 + n * 7 % 40))
                record["messages"].append({
                    "role": "assistant", "content": f"Answer {n}: {words}.",
                    "reasoning_content": "let me think" if n % 3 == 0 else None})
                f.write(json.dumps(record) + "\n")
                n += 1
    return path


def saved(out: Path) -> dict[str, Any]:
    """What `workers.extract` wrote to `out`: the tensors of each sample, by sample id."""
    from safetensors.torch import load_file

    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    return {entry["id"]: load_file(out / entry["file"]) for entry in manifest}


def job_row(sessions: Any, job_id: str) -> Any:
    """The job's row, read in a session of its own."""
    from supervisor.storage.tables import Job

    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


# -- output trees (the scanner tests) ------------------------------------------------
LATER = time.time() + 3600.0  # far enough ahead that every file has settled


def write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def make_shards(root: Path, dirs: int, per_dir: int, suffix: str = ".safetensors") -> int:
    """rows_0-N/item_K<suffix>, item K of size K % 7; returns the total bytes."""
    total = 0
    for shard in range(dirs):
        shard_dir = root / f"rows_{shard * per_dir}-{(shard + 1) * per_dir}"
        shard_dir.mkdir(parents=True)
        for index in range(per_dir):
            size = index % 7
            (shard_dir / f"item_{index}{suffix}").write_bytes(b"x" * size)
            total += size
    return total
