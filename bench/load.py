"""Benchmark: the daemon under API load while it supervises JOBS running jobs.

Starts a real daemon (``python -m supervisor serve`` on a free loopback port, a temp data
dir, ``JOBSUP_SAMPLE_INTERVAL=1``) and submits JOBS jobs that run until stopped. Each is a
``sh`` loop that, once a second, writes a small file into its own ``output_dir`` (with
``pattern`` and ``expected_items`` set) and reports progress one of three ways, by turns:
the progress file (``$JOBSUP_PROGRESS_FILE``, replaced atomically), a bare ``n/total`` log
line, or output files only. Once every job runs, two windows are measured:

* idle: IDLE_SECONDS with no client -- what sampling JOBS jobs costs the daemon alone;
* load: SECONDS with CLIENTS threads, each with its own keep-alive ``httpx.Client``, sending
  requests back to back (closed loop, no think time), the route drawn by weight from
  ROUTE_WEIGHTS and the job at random.

Per window: the daemon's CPU time (``psutil`` ``cpu_times``, user + system, all threads)
over wall time = average cores used; its RSS; the machine's busy cores and this process's
CPU (the clients run on the same machine); and the engine's ticks from the
``jobsup_tick_duration_seconds`` histogram of ``/metrics`` (scraped at both ends: count, mean
= sum / count, p99 interpolated in the buckets as Prometheus' ``histogram_quantile`` does).
Per route: requests, errors (non-2xx or an exception; there must be none) and latency
p50/p90/p99/max, measured around the whole request including the body.

At the end (also on Ctrl-C, SIGTERM or SIGHUP) every job is stopped through the API, the
daemon gets SIGTERM, and any process left of the run (the shims and job trees, found by
their pid files and by the data dir in their command line or environment) is SIGKILLed
and counted; the daemon log's warnings and errors are printed.

    python bench/load.py [--jobs 100] [--clients 20] [--seconds 60] [--idle-seconds 20]
    python bench/load.py --waiting 10000 --jobs 200 --sleep --interval 2   # at scale (#30)

With ``--waiting N``, N more jobs wait on one running dependency; after the idle window
the first pages of ``/`` and ``/api/v1/jobs``, the largest API page and ``/metrics`` are
timed, the shims' memory read (RSS, PSS and USS from ``smaps_rollup``), and the
dependency is stopped: how long until its N dependents have failed, and the longest tick
meanwhile (polled from ``/healthz``), instead of the load window.

Prints markdown tables; ``--doc FILE`` also writes them there (docs/benchmarks.md
holds the recorded results).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe  # noqa: E402

from supervisor.runtime import files  # noqa: E402

EXPECTED_ITEMS = 3600
"""Items each job announces: an hour at one a second, so none ends during the run."""

JOB_SCRIPT = r"""
kind=$1 out=$2 total=$3 i=0
while [ "$i" -lt "${4:-0}" ]; do  # --prefill: the files and log lines of a job begun earlier
  i=$((i + 1))
  printf 'item %d\n' "$i" > "$out/item_$i.txt"
  case $kind in log) echo "step $i/$total" ;; files) echo "wrote item_$i.txt" ;; esac
done
while :; do
  i=$((i + 1))
  printf 'item %d\n' "$i" > "$out/item_$i.txt"
  case $kind in
    progress_file)
      printf '{"done": %d, "total": %d, "unit": "items", "metrics": {"step": %d}}' \
        "$i" "$total" "$i" > "$JOBSUP_PROGRESS_FILE.tmp"
      mv "$JOBSUP_PROGRESS_FILE.tmp" "$JOBSUP_PROGRESS_FILE" ;;
    log) echo "step $i/$total" ;;
    *) echo "wrote item_$i.txt" ;;
  esac
  sleep 1
done
"""
"""One job: a file a second; `printf`/`echo` are dash builtins, so a second costs one
`sleep` fork (and one `mv` for the progress-file jobs)."""

PROGRESS_KINDS = ("progress_file", "log", "files")

ROUTE_WEIGHTS = {
    "GET /api/v1/jobs": 15,
    "GET /api/v1/jobs/{id}": 25,
    "GET /api/v1/jobs/{id}/samples?limit=100": 20,
    "GET /api/v1/jobs/{id}/logs?tail=20": 20,
    "GET /metrics": 10,
    "GET /api/v1/alerts": 10,
}
"""Share of the requests per route (percent)."""

TICK_METRIC = "jobsup_tick_duration_seconds"
LOG_PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Exception|locked", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1..99), inclusive method; the value itself for one sample."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# -- the daemon and its jobs -------------------------------------------------------------
HISTORY_SCRIPT = r"""
import json, sys, time
from pathlib import Path
from supervisor.config import Settings
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from supervisor.storage.tables import Job
data_dir, count = Path(sys.argv[1]), int(sys.argv[2])
engine = make_engine(Settings(data_dir=data_dir).resolved_database_url)
upgrade(engine)
now = time.time()
with make_sessionmaker(engine)() as session:
    for i in range(count):
        ended = now - 30 * 86400 * (count - i) / count - 3600  # over the last month
        spec = {"name": f"old{i}", "command": ["python", "train.py", "--shard", str(i)],
                "env": {"NOTE": "x" * 1500}, "output_dir": f"/data/old{i}"}
        progress = {"items_done": 1000, "items_total": 1000, "files": 1000,
                    "bytes_written": 83_000_000_000, "source": "files"}
        session.add(Job(id=f"h{i:07x}", name=f"old{i}", spec_json=json.dumps(spec),
                        state="succeeded", reason="exit code 0", created_at=ended - 7200,
                        started_at=ended - 7000, ended_at=ended, attempt=1, restarts=0,
                        exit_code=0, exit_reason="exit",
                        progress_json=json.dumps(progress)))
    session.commit()
"""
"""Fills a new data dir's database (through `--source`'s own schema) with `--history`
jobs that ended over the last month, as a daemon in use for a while has."""


WAITING_SCRIPT = r"""
import sys, time
from pathlib import Path
from supervisor.config import Settings
from supervisor.runtime.fileio import atomic_write_json
from supervisor.spec import JobSpec
from supervisor.storage import store
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
data_dir, count = Path(sys.argv[1]), int(sys.argv[2])
settings = Settings(data_dir=data_dir)
engine = make_engine(settings.resolved_database_url)
upgrade(engine)
now = time.time()
with make_sessionmaker(engine)() as session:
    dependency = store.create_job(session, spec=JobSpec(
        name="dependency", command=["sleep", "86400"], stop_grace_s=5), now=now)
    jobs = [dependency]
    for i in range(count):
        jobs.append(store.create_job(session, spec=JobSpec(
            name=f"waiting-{i:05d}", command=["true"], depends_on=[dependency.id],
            labels={"bench": "waiting", "sweep": str(i % 10)}), now=now + 1e-4 * (i + 1)))
    session.flush()
    for job in jobs:  # the directory and record a submit gives a job (not fsynced here)
        (settings.jobs_dir / job.id).mkdir(parents=True)
        atomic_write_json(settings.jobs_dir / job.id / store.JOB_RECORD,
                          store.job_record(job), fsync=False)
    session.commit()
    print(dependency.id)
"""
"""Adds `--waiting` jobs, each pending behind one dependency (a `sleep` the daemon starts),
to a new data dir's database through the store, as submits would have (a sweep queued
behind its data step), each with the directory and `job.json` a submit writes (their end
is recorded there too); prints the dependency's id."""


class Daemon:
    """`python -m supervisor serve` as a child process, its log in the data dir."""

    def __init__(self, data_dir: Path, sample_interval_s: float, source: Path):
        self.data_dir = data_dir
        self.source = source
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = data_dir / "daemon.log"
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")}
        self.env = {**inherited, "JOBSUP_SAMPLE_INTERVAL": str(sample_interval_s),
                    "PYTHONPATH": str(source)}
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor", "serve", "--port", self.url.rsplit(":", 1)[1],
                 "--data-dir", str(self.data_dir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.source)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not healthy after 30 s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> int | None:
        """SIGTERM, SIGKILL after 20 s; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                print("daemon ignored SIGTERM for 20 s: SIGKILL", file=sys.stderr)
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def submit_jobs(daemon: Daemon, count: int, job_ids: list[str], prefill: int = 0,
                sleep: bool = False) -> None:
    """Submit `count` jobs into `job_ids` (appended one by one, so a failure still cleans
    up what was submitted); each starts with `prefill` items written at once (`sleep`:
    each a `sleep`, no output at all)."""
    for index in range(count):
        if sleep:
            spec: dict[str, object] = {"name": f"sleep-{index:04d}", "stop_grace_s": 5,
                                       "command": ["sleep", "86400"],
                                       "labels": {"bench": "load", "progress": "none"}}
            response = daemon.http.post("/api/v1/jobs", json=spec)
            if response.status_code != 201:
                raise RuntimeError(f"submit {index}: {response.status_code} {response.text}")
            job_ids.append(response.json()["id"])
            continue
        kind = PROGRESS_KINDS[index % len(PROGRESS_KINDS)]
        out = daemon.data_dir / "outputs" / f"job{index:03d}"
        out.mkdir(parents=True, exist_ok=True)
        spec = {
            "name": f"load-{kind}-{index:03d}",
            "command": ["sh", "-c", JOB_SCRIPT, "job", kind, str(out), str(EXPECTED_ITEMS),
                        str(prefill)],
            "output_dir": str(out), "pattern": "*.txt", "expected_items": EXPECTED_ITEMS,
            "stop_grace_s": 5, "labels": {"bench": "load", "progress": kind},
        }
        response = daemon.http.post("/api/v1/jobs", json=spec)
        if response.status_code != 201:
            raise RuntimeError(f"submit {index}: {response.status_code} {response.text}")
        job_ids.append(response.json()["id"])


def all_jobs(daemon: Daemon, **params: str) -> list[dict]:
    """Every job the API lists with these filters, page after page (`Link: rel=next`)."""
    jobs: list[dict] = []
    response = daemon.http.get("/api/v1/jobs", params={"limit": "1000", **params})
    while True:
        response.raise_for_status()
        jobs += response.json()
        following = response.links.get("next", {}).get("url")
        if not following:
            return jobs
        response = daemon.http.get(following)


def count_of(daemon: Daemon, state: str) -> int:
    """Jobs in this state (the API's `X-Total-Count`)."""
    response = daemon.http.get("/api/v1/jobs", params={"state": state, "limit": "1"})
    response.raise_for_status()
    return int(response.headers["X-Total-Count"])


def wait_all_running(daemon: Daemon, job_ids: list[str], timeout_s: float = 120,
                     progress: bool = True) -> None:
    """Until these jobs run and each has made progress (its first item counted; only
    running, with `progress` False: `--sleep` jobs count nothing)."""
    deadline = time.monotonic() + timeout_s
    count, ours = len(job_ids), set(job_ids)
    while True:  # (not the --history jobs)
        jobs = [j for j in all_jobs(daemon) if j["id"] in ours]
        running = [j for j in jobs if j["state"] == "running"]
        progressing = [j for j in running
                       if not progress or (j["progress"]["items_done"] or 0) > 0]
        if len(progressing) == count:
            return
        if any(j["state"] not in ("pending", "running") for j in jobs):
            bad = [(j["id"], j["state"], j["reason"]) for j in jobs
                   if j["state"] not in ("pending", "running")]
            raise RuntimeError(f"jobs ended before the benchmark: {bad[:5]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"after {timeout_s} s: {len(running)} of {count} running, "
                               f"{len(progressing)} with progress")
        time.sleep(1)


def run_processes(data_dir: Path, exclude: set[int]) -> list[psutil.Process]:
    """Live processes of the run: those whose pid file under `data_dir` still names them,
    and any whose command line or environment mentions `data_dir` (a job's children)."""
    found: dict[int, psutil.Process] = {}
    for _, pid in files.live_processes(data_dir / "jobs"):
        with contextlib.suppress(psutil.NoSuchProcess):
            found[pid] = psutil.Process(pid)
    marker = str(data_dir)
    for proc in psutil.process_iter():
        if proc.pid in exclude or proc.pid in found:
            continue
        try:
            if (any(marker in arg for arg in proc.cmdline())
                    or marker in proc.environ().get("JOBSUP_PROGRESS_FILE", "")):
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return list(found.values())


@dataclass(frozen=True)
class Cleanup:
    job_states: dict[str, int]  # after the stops, as the API answered
    stop_s: float  # from the first stop request until no job ran
    daemon_exit: int | None
    leftovers: int  # processes of the run alive after the daemon's exit, then SIGKILLed


def stop_everything(daemon: Daemon, job_ids: list[str]) -> Cleanup:
    """Stop the jobs through the API, SIGTERM the daemon, SIGKILL whatever of the run is
    left (process groups first)."""
    states: list[str] = []
    started = time.monotonic()
    if daemon.proc is not None and daemon.proc.poll() is None:
        for job_id in job_ids:
            try:
                daemon.http.post(f"/api/v1/jobs/{job_id}/stop")  # 409 when already ended
            except httpx.HTTPError as exc:
                print(f"stop {job_id}: {exc!r}", file=sys.stderr)
        deadline = time.monotonic() + 60
        ours = set(job_ids)
        while time.monotonic() < deadline:
            try:
                states = [j["state"] for j in all_jobs(daemon, state="running")
                          if j["id"] in ours]
            except (httpx.HTTPError, ValueError):
                break
            if not states:
                states = [j["state"] for j in all_jobs(daemon) if j["id"] in ours]
                break
            time.sleep(0.5)
        else:
            print("some jobs still run 60 s after their stop", file=sys.stderr)
    stop_s = time.monotonic() - started
    daemon_exit = daemon.terminate()
    leftovers = run_processes(daemon.data_dir, exclude={os.getpid()})
    for proc in leftovers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(leftovers, timeout=5)
    if leftovers:
        print(f"SIGKILLed {len(leftovers)} process(es) left of the run", file=sys.stderr)
    still = run_processes(daemon.data_dir, exclude={os.getpid()})
    if still:
        print(f"processes still alive after SIGKILL: {[p.pid for p in still]}", file=sys.stderr)
    counts = {state: states.count(state) for state in sorted(set(states))}
    return Cleanup(counts, stop_s, daemon_exit, len(leftovers))


# -- measuring ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound in seconds, cumulative count)
    sum_s: float
    count: float


def read_tick_histogram(metrics_text: str) -> Histogram:
    buckets: list[tuple[float, float]] = []
    sum_s = count = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(TICK_METRIC):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith(f"{TICK_METRIC}_bucket"):
            bound = re.search(r'le="([^"]+)"', name)
            if bound:
                buckets.append((float(bound.group(1)), float(value)))
        elif name == f"{TICK_METRIC}_sum":
            sum_s = float(value)
        elif name == f"{TICK_METRIC}_count":
            count = float(value)
    return Histogram(sorted(buckets), sum_s, count)


def histogram_quantile(q: float, before: Histogram, after: Histogram) -> float:
    """The q-quantile of the observations between two scrapes, interpolated linearly in
    its bucket (Prometheus' histogram_quantile); inf when it lies above the last bound."""
    counts = [(bound, a - b) for (bound, a), (_, b) in zip(after.buckets, before.buckets,
                                                              strict=True)]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return float("nan")
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if bound == float("inf"):
                return float("inf")
            share = (rank - lower_count) / max(cumulative - lower_count, 1e-12)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, cumulative
    return float("inf")


def ticks_over(seconds: float, before: Histogram, after: Histogram) -> float:
    """Ticks between the scrapes that took longer than the first bucket bound at or above
    `seconds` (0 with no such bound: the histogram cannot tell). A bound that is not a
    bucket (a 2 s interval) counted every tick as over it before."""
    bounds = sorted(bound for bound, _ in after.buckets if bound >= seconds)
    if not bounds:
        return 0.0
    within = dict(after.buckets)[bounds[0]] - dict(before.buckets).get(bounds[0], 0.0)
    return (after.count - before.count) - within


@dataclass
class Snapshot:
    wall_s: float
    daemon_cpu_s: float
    bench_cpu_s: float
    machine_busy_s: float
    daemon_rss_bytes: int
    jobs_cpu_s: dict[int, float]  # per shim and job process, children reaped included
    daemon_threads_cpu_s: dict[int, float]  # per thread id of the daemon
    ticks: Histogram
    scrape_cpu_s: float = 0.0
    """The daemon's CPU for a `/metrics` scrape (the least of three taken after this
    snapshot): what the scrape this snapshot took (counted in a window it ends) cost it;
    taken off the daemon's total, not off its threads' figures."""


def task_cpu_s(pid: int) -> float:
    """The CPU time of the process's live threads, from their schedstat (nanoseconds:
    psutil's figures move in 10 ms steps)."""
    total_ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total_ns += int(f.read().split()[0])
    return total_ns / 1e9


def snapshot(daemon: Daemon, *, ends_window: bool = False) -> Snapshot:
    """The figures now. The tick count comes from a `/metrics` scrape taken first; where
    the snapshot `ends_window`, that scrape falls in the window, and one more scrape
    afterwards measures what it cost the daemon (`window` takes it off)."""
    assert daemon.proc is not None
    proc = psutil.Process(daemon.proc.pid)
    ticks = read_tick_histogram(daemon.http.get("/metrics").text)
    times, own = proc.cpu_times(), psutil.Process().cpu_times()
    threads = {t.id: t.user_time + t.system_time for t in proc.threads()}
    machine = psutil.cpu_times()
    jobs_cpu_s = {}
    for job_proc in run_processes(daemon.data_dir, exclude={os.getpid(), proc.pid}):
        with contextlib.suppress(psutil.Error):
            t = job_proc.cpu_times()
            jobs_cpu_s[job_proc.pid] = t.user + t.system + t.children_user + t.children_system
    taken = Snapshot(time.monotonic(), times.user + times.system, own.user + own.system,
                     machine.user + machine.system + machine.nice + machine.irq
                     + machine.softirq + getattr(machine, "steal", 0.0),
                     proc.memory_info().rss, jobs_cpu_s, threads, ticks)
    if ends_window:  # the least of three: a tick running meanwhile is not the scrape's
        costs = []
        for _ in range(3):
            before = task_cpu_s(proc.pid)
            daemon.http.get("/metrics")
            costs.append(task_cpu_s(proc.pid) - before)
        taken.scrape_cpu_s = min(costs)
    return taken


@dataclass(frozen=True)
class Window:
    name: str
    seconds: float
    daemon_cores: float
    bench_cores: float
    jobs_cores: float
    machine_cores: float
    rss_end_bytes: int
    rss_max_bytes: int
    ticks: float
    tick_mean_s: float
    tick_p99_s: float
    ticks_over_interval: float
    thread_cpu_s: dict[int, float]  # per daemon thread, over the window
    scrape_cpu_s: float = 0.0  # the benchmark's /metrics scrape in it: not in daemon_cores


def window(name: str, start: Snapshot, end: Snapshot, rss_max_bytes: int,
           interval_s: float) -> Window:
    seconds = end.wall_s - start.wall_s
    ticks = end.ticks.count - start.ticks.count
    thread_cpu_s = {tid: cpu_s - start.daemon_threads_cpu_s.get(tid, 0.0)
                    for tid, cpu_s in end.daemon_threads_cpu_s.items()}
    return Window(  # the daemon's CPU without the benchmark's own scrape of /metrics
        name, seconds, (end.daemon_cpu_s - start.daemon_cpu_s - end.scrape_cpu_s) / seconds,
        (end.bench_cpu_s - start.bench_cpu_s) / seconds,
        sum(cpu_s - start.jobs_cpu_s[pid] for pid, cpu_s in end.jobs_cpu_s.items()
            if pid in start.jobs_cpu_s) / seconds,
        (end.machine_busy_s - start.machine_busy_s) / seconds,
        end.daemon_rss_bytes, max(rss_max_bytes, end.daemon_rss_bytes, start.daemon_rss_bytes),
        ticks, (end.ticks.sum_s - start.ticks.sum_s) / ticks if ticks else float("nan"),
        histogram_quantile(0.99, start.ticks, end.ticks),
        ticks_over(interval_s, start.ticks, end.ticks), thread_cpu_s, end.scrape_cpu_s)


def watch_rss(pid: int, stop: threading.Event) -> list[int]:
    """Start a thread recording the daemon's RSS twice a second until `stop`."""
    readings: list[int] = []

    def loop() -> None:
        proc = psutil.Process(pid)
        while not stop.wait(0.5):
            try:
                readings.append(proc.memory_info().rss)
            except psutil.NoSuchProcess:
                return

    threading.Thread(target=loop, daemon=True).start()
    return readings


@dataclass
class RouteStats:
    latencies_s: list[float] = field(default_factory=list)
    response_bytes: int = 0
    errors: list[str] = field(default_factory=list)


def client(url: str, job_ids: list[str], deadline: float, stop: threading.Event, seed: int,
           stats: dict[str, RouteStats]) -> None:
    """Send requests back to back until `deadline`; record into `stats` (this thread's)."""
    rng = random.Random(seed)
    routes, weights = list(ROUTE_WEIGHTS), list(ROUTE_WEIGHTS.values())
    with httpx.Client(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline and not stop.is_set():
            route = rng.choices(routes, weights)[0]
            path = route.removeprefix("GET ").replace("{id}", rng.choice(job_ids))
            route_stats = stats.setdefault(route, RouteStats())
            started = time.perf_counter()
            try:
                response = http.get(path)
                error = (None if 200 <= response.status_code < 300
                         else f"{response.status_code} {response.text[:300]}")
                size = len(response.content)
            except httpx.HTTPError as exc:
                error, size = f"{type(exc).__name__}: {exc}", 0
            route_stats.latencies_s.append(time.perf_counter() - started)
            route_stats.response_bytes += size
            if error is not None:
                route_stats.errors.append(f"{path}: {error}")


def run_clients(daemon: Daemon, job_ids: list[str], clients: int, seconds: float,
                stop: threading.Event) -> dict[str, RouteStats]:
    deadline = time.monotonic() + seconds
    per_thread: list[dict[str, RouteStats]] = [{} for _ in range(clients)]
    threads = [threading.Thread(target=client, daemon=True,
                                args=(daemon.url, job_ids, deadline, stop, i, per_thread[i]))
               for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)  # short joins: Ctrl-C reaches this thread
    merged: dict[str, RouteStats] = {route: RouteStats() for route in ROUTE_WEIGHTS}
    for stats in per_thread:
        for route, route_stats in stats.items():
            merged[route].latencies_s += route_stats.latencies_s
            merged[route].response_bytes += route_stats.response_bytes
            merged[route].errors += route_stats.errors
    return merged


def measure_window(daemon: Daemon, name: str, seconds: float, interval_s: float,
                   run: threading.Event | None = None, job_ids: list[str] | None = None,
                   clients: int = 0) -> tuple[Window, dict[str, RouteStats]]:
    assert daemon.proc is not None
    stop_rss = threading.Event()
    rss = watch_rss(daemon.proc.pid, stop_rss)
    start = snapshot(daemon)
    if clients and job_ids and run is not None:
        stats = run_clients(daemon, job_ids, clients, seconds, run)
    else:
        time.sleep(seconds)
        stats = {}
    end = snapshot(daemon, ends_window=True)
    stop_rss.set()
    return window(name, start, end, max(rss, default=0), interval_s), stats


# -- at scale (--waiting) -----------------------------------------------------------------
SCALE_ROUTES = ("/", "/fragments/jobs", "/api/v1/jobs", "/api/v1/jobs?limit=1000",
                "/api/v1/jobs?state=running&limit=1000", "/metrics")
"""Timed with `--waiting`: the first page of the table and of the API, the largest API
page, and a scrape."""


@dataclass
class Scale:
    routes: dict[str, tuple[float, float, int]]  # median s, max s, bytes
    shims: int
    shim_rss_mib: float  # means per shim, from /proc/PID/smaps_rollup
    shim_pss_mib: float
    shim_uss_mib: float
    cascade_s: float = float("nan")  # from the dependency's stop until none waits
    cascade_ticks: float = 0.0
    cascade_ticks_over_half_s: float = 0.0
    cascade_worst_tick_s: float = 0.0  # the longest /healthz reported, polled 5 times a second
    rss_after_mib: float = 0.0


def shim_memory(data_dir: Path) -> tuple[int, float, float, float]:
    """(shims, mean RSS, PSS, USS in MiB) of the run's shims."""
    totals = {"Rss": 0, "Pss": 0, "Private_Clean": 0, "Private_Dirty": 0}
    shims = 0
    for proc in run_processes(data_dir, exclude={os.getpid()}):
        try:
            if "supervisor.runtime.shim" not in " ".join(proc.cmdline()):
                continue
            with open(f"/proc/{proc.pid}/smaps_rollup") as rollup:
                for line in rollup:
                    key, _, rest = line.partition(":")
                    if key in totals:
                        totals[key] += int(rest.split()[0])
            shims += 1
        except (OSError, psutil.Error):
            continue
    per = max(shims, 1) * 1024
    return (shims, totals["Rss"] / per, totals["Pss"] / per,
            (totals["Private_Clean"] + totals["Private_Dirty"]) / per)


def measure_scale(daemon: Daemon, dependency: str, waiting: int) -> Scale:
    """Times the routes (5 requests each), the shims' memory, then stops the dependency
    and watches its `waiting` dependents fail: how long, and the ticks meanwhile."""
    routes = {}
    for path in SCALE_ROUTES:
        times, size = [], 0
        for _ in range(5):
            started = time.perf_counter()
            answer = daemon.http.get(path)
            times.append(time.perf_counter() - started)
            answer.raise_for_status()
            size = len(answer.content)
        routes[path] = (statistics.median(times), max(times), size)
    scale = Scale(routes, *shim_memory(daemon.data_dir))
    before = read_tick_histogram(daemon.http.get("/metrics").text)
    started = time.monotonic()
    daemon.http.post(f"/api/v1/jobs/{dependency}/stop").raise_for_status()
    worst = 0.0
    while time.monotonic() - started < 600:
        health = daemon.http.get("/healthz").json()
        worst = max(worst, health.get("last_tick_duration_s") or 0.0)
        if count_of(daemon, "pending") == 0:
            break
        time.sleep(0.2)
    scale.cascade_s = time.monotonic() - started
    time.sleep(2 * TICK_S)  # the ticks after: the ends evaluated once
    worst = max(worst, daemon.http.get("/healthz").json().get("last_tick_duration_s") or 0.0)
    after = read_tick_histogram(daemon.http.get("/metrics").text)
    scale.cascade_ticks = after.count - before.count
    scale.cascade_ticks_over_half_s = ticks_over(0.5, before, after)
    scale.cascade_worst_tick_s = worst
    assert daemon.proc is not None
    scale.rss_after_mib = psutil.Process(daemon.proc.pid).memory_info().rss / 2**20
    return scale


def render_scale(args: argparse.Namespace, idle: Window, scale: Scale) -> str:
    lines = [
        f"## {args.waiting + args.jobs + 1:,} jobs: {args.jobs} running, {args.waiting:,} "
        "waiting on one dependency",
        "",
        f"`bench/load.py --waiting {args.waiting} --jobs {args.jobs}"
        + (" --sleep" if args.sleep else "") + f" --interval {args.interval:g}`: "
        f"{args.waiting:,} jobs pending behind one running `sleep` (put in the database "
        "through the store before the daemon starts),",
        f"{args.jobs} running jobs submitted through the API"
        + (" (each a `sleep`: a shim and a process, no output)" if args.sleep else "")
        + f". Daemon from {args.label}; on a {machine()}.",
        "",
        f"Idle ({idle.seconds:.0f} s, no client): daemon {idle.daemon_cores:.3f} cores, "
        f"RSS {idle.rss_end_bytes / 2**20:.0f} MiB (max {idle.rss_max_bytes / 2**20:.0f}), "
        f"{idle.ticks:.0f} ticks, mean {ms(idle.tick_mean_s)} ms, p99 {ms(idle.tick_p99_s)} "
        f"ms, {idle.ticks_over_interval:.0f} over the {args.interval:g} s interval.",
        "",
        "| route | median ms | max ms (5 requests) | bytes |",
        "| --- | ---: | ---: | ---: |",
        *[f"| `{path}` | {median * 1000:.1f} | {worst * 1000:.1f} | {size:,} |"
          for path, (median, worst, size) in scale.routes.items()],
        "",
        f"Shims: {scale.shims}, each RSS {scale.shim_rss_mib:.2f} MiB, PSS "
        f"{scale.shim_pss_mib:.2f} MiB, USS {scale.shim_uss_mib:.2f} MiB (smaps_rollup; "
        f"USS = private pages: what one more job costs).",
        "",
        f"The dependency stopped: its {args.waiting:,} dependents all failed "
        f"{scale.cascade_s:.1f} s later, over {scale.cascade_ticks:.0f} ticks, "
        f"{scale.cascade_ticks_over_half_s:.0f} of them over 0.5 s; the longest tick "
        f"/healthz reported: {scale.cascade_worst_tick_s * 1000:.0f} ms. Daemon RSS after: "
        f"{scale.rss_after_mib:.0f} MiB.",
    ]
    return "\n".join(lines) + "\n"


# -- report ------------------------------------------------------------------------------
def machine() -> str:
    memory_gib = psutil.virtual_memory().total / 2**30
    return describe(f"{memory_gib:.0f} GiB, shared", f"httpx {httpx.__version__}",
                    f"psutil {psutil.__version__}")


def ms(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "-"
    return "> 5000" if seconds == float("inf") else f"{seconds * 1000:.1f}"


def route_rows(stats: dict[str, RouteStats], seconds: float) -> list[str]:
    rows = []
    everything = RouteStats()
    for route, route_stats in [*stats.items(), ("**all**", everything)]:
        if route != "**all**":
            everything.latencies_s += route_stats.latencies_s
            everything.response_bytes += route_stats.response_bytes
            everything.errors += route_stats.errors
        latencies, count = route_stats.latencies_s, len(route_stats.latencies_s)
        mean_kib = route_stats.response_bytes / count / 1024 if count else 0.0
        rows.append(
            f"| `{route}` | {count} | {count / seconds:.1f} | {len(route_stats.errors)} "
            f"| {ms(percentile(latencies, 50))} | {ms(percentile(latencies, 90))} "
            f"| {ms(percentile(latencies, 99))} | {ms(max(latencies, default=float('nan')))} "
            f"| {mean_kib:.1f} |")
    return rows


TICK_S = 2.0
"""The daemon's default tick (`JOBSUP_SAMPLE_INTERVAL`), for the share of a core below."""


def tick_cost(w: Window, jobs: int) -> str:
    """The daemon's CPU per tick in a window without clients (all its threads: the tick
    and the file readings), per job, and as a share of a core at the default tick."""
    if not w.ticks:
        return "no ticks"
    per_tick_s = w.daemon_cores * w.seconds / w.ticks
    return (f"daemon CPU {per_tick_s * 1000:.1f} ms per tick, "
            f"{per_tick_s * 1000 / max(jobs, 1):.2f} ms per job per tick, "
            f"{per_tick_s / TICK_S * 100:.2f} % of a core at a {TICK_S:g} s tick "
            f"(the benchmark's own /metrics scrape, {w.scrape_cpu_s * 1000:.1f} ms, "
            "not counted)")


def render(args: argparse.Namespace, windows: list[Window], stats: dict[str, RouteStats],
           problems: list[str], cleanup: Cleanup) -> str:
    errors = sum(len(s.errors) for s in stats.values())
    load = windows[-1]
    requests = max(sum(len(s.latencies_s) for s in stats.values()), 1)
    per_request_ms = ((load.daemon_cores - windows[0].daemon_cores) * load.seconds
                      / requests * 1000)
    lines = [
        "## Under load: 20 API clients while 100 jobs run" if
        (args.jobs, args.clients) == (100, 20) else
        f"## Under load: {args.clients} API clients while {args.jobs} jobs run",
        "",
        f"`bench/load.py` starts a real daemon (temp data dir, `JOBSUP_SAMPLE_INTERVAL="
        f"{args.interval:g}`) and submits {args.jobs} jobs that run until stopped: each a",
        "`sh` loop writing one small file a second into its own `output_dir` (`pattern`, "
        f"`expected_items={EXPECTED_ITEMS}` set)"
        + (f", after {args.prefill} items written at once (as if it had run "
           f"{args.prefill} s)," if args.prefill else ","),
        "reporting progress by turns through `$JOBSUP_PROGRESS_FILE`, a bare `n/total` log "
        "line, or the files alone."
        + (f" The database held {args.history} jobs that ended over the month before "
           "(`--history`)." if args.history else ""),
        "Once all run and count items, it measures two windows: **idle**, "
        f"{args.idle_seconds:g} s with no client (the cost of supervising",
        f"the jobs alone), then **load**, {args.seconds:g} s with {args.clients} client "
        "threads (one keep-alive `httpx.Client` each) sending",
        "requests back to back, no think time; routes drawn by weight ("
        + ", ".join(f"{w} % `{r.removeprefix('GET ')}`" for r, w in ROUTE_WEIGHTS.items())
        + "), jobs at random.",
        "CPU columns are cores used on average (CPU seconds over wall seconds): daemon is its "
        "`cpu_times` (user + system, all threads);",
        "jobs the shims and job processes (with their reaped children: `sleep`, `mv`); bench "
        "this benchmark's own process (the clients);",
        "machine all cores busy (user, system, irq, steal); other the rest of the machine "
        "(other work on the shared VM). Ticks come from the "
        "`jobsup_tick_duration_seconds` histogram of `/metrics`,",
        "scraped at both ends of the window: mean = sum / count, p99 interpolated in the "
        "buckets like `histogram_quantile`.",
        f"Daemon from {args.label}; run on a {machine()}:",
        f"`.venv/bin/python bench/load.py --jobs {args.jobs} --clients {args.clients} "
        f"--seconds {args.seconds:g} --idle-seconds {args.idle_seconds:g}"
        + (f" --source {args.source}" if args.source.resolve() != REPO else "") + "`.",
        "",
        "| window | seconds | daemon CPU (cores) | daemon RSS end / max MiB | jobs CPU "
        f"| bench CPU | other CPU | machine busy (of {os.cpu_count()}) | ticks | tick mean ms "
        f"| tick p99 ms | ticks > {args.interval:g} s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in windows:
        lines.append(
            f"| {w.name} | {w.seconds:.1f} | {w.daemon_cores:.3f} "
            f"| {w.rss_end_bytes / 2**20:.0f} / {w.rss_max_bytes / 2**20:.0f} "
            f"| {w.jobs_cores:.3f} | {w.bench_cores:.2f} "
            f"| {w.machine_cores - w.daemon_cores - w.jobs_cores - w.bench_cores:.2f} "
            f"| {w.machine_cores:.2f} | {w.ticks:.0f} "
            f"| {ms(w.tick_mean_s)} | {ms(w.tick_p99_s)} | {w.ticks_over_interval:.0f} |")
    lines += ["", f"Tick cost (idle window, #15): {tick_cost(windows[0], args.jobs)}."]
    idle_threads = windows[0].thread_cpu_s
    engine_tid = max(idle_threads, key=lambda tid: idle_threads[tid]) if idle_threads else -1
    lines += [
        "",
        "Where the daemon's time went: the tick thread is the daemon's busiest thread in the "
        "idle window (the engine's loop;",
        "the other threads are uvicorn's event loop, the request thread pool and the exit "
        "watcher). A tick's wall time above its",
        "CPU time is time spent waiting: for the interpreter lock held by request threads, "
        "for a core, or for I/O.",
        "",
        "| window | seconds between ticks | tick wall ms (mean) | tick thread CPU ms per tick "
        "| tick thread CPU (cores) | other threads CPU (cores) | threads |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in windows:
        engine_cpu_s = w.thread_cpu_s.get(engine_tid, 0.0)
        other_cpu_s = sum(w.thread_cpu_s.values()) - engine_cpu_s
        lines.append(
            f"| {w.name} | {w.seconds / w.ticks if w.ticks else float('nan'):.2f} "
            f"| {ms(w.tick_mean_s)} "
            f"| {engine_cpu_s / w.ticks * 1000 if w.ticks else float('nan'):.1f} "
            f"| {engine_cpu_s / w.seconds:.3f} | {other_cpu_s / w.seconds:.3f} "
            f"| {len(w.thread_cpu_s)} |")
    lines += [
        "",
        f"Requests in the load window ({load.seconds:.1f} s; latency in ms, measured by the "
        "client around the whole request):",
        "",
        "| route | requests | req/s | errors | p50 | p90 | p99 | max | mean KiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *route_rows(stats, load.seconds),
        "",
        f"Daemon CPU per request (load minus idle daemon CPU, over the requests): "
        f"{per_request_ms:.1f} ms. With {args.clients} closed-loop clients a request waits "
        f"behind the others: {args.clients} / {requests / load.seconds:.1f} req/s = "
        f"{args.clients / (requests / load.seconds) * 1000:.0f} ms (Little's law).",
        "",
        f"Errors: {errors}" + ("." if not errors else ", the first ones per route:"),
        *(["", *[f"- `{e}`" for s in stats.values() for e in s.errors[:3]], ""]
          if errors else []),
        f"Daemon log: {len(problems)} warning/error line(s)" + ("." if not problems else ":"),
        *(["", "```", *problems[:20], "```", ""] if problems else []),
        "Cleanup: jobs after their stop through the API: "
        + ", ".join(f"{n} {state}" for state, n in cleanup.job_states.items())
        + f" ({cleanup.stop_s:.1f} s); daemon exit {cleanup.daemon_exit} after SIGTERM "
        "(uvicorn re-raises the signal after its graceful shutdown);",
        f"processes of the run still alive after that (SIGKILLed by the benchmark): "
        f"{cleanup.leftovers}.",
    ]
    return "\n".join(lines) + "\n"


def on_signal(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through the finally that stops everything


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="each job first writes N items (files, and log lines) at once: "
                             "jobs measured as if they had run N seconds, not one minute")
    parser.add_argument("--history", type=int, default=0, metavar="N",
                        help="N jobs that ended over the last month in the database before "
                             "the daemon starts: a daemon in use for a while, not a new one")
    parser.add_argument("--waiting", type=int, default=0, metavar="N",
                        help="N more jobs pending behind one running dependency (a sweep "
                             "queued behind its data step); then the routes are timed, the "
                             "dependency stopped and its dependents' failure watched, "
                             "instead of the load window")
    parser.add_argument("--sleep", action="store_true",
                        help="the --jobs are `sleep`s (a shim and a process each, no output)")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60, help="the load window")
    parser.add_argument("--idle-seconds", type=float, default=20, help="the window without clients")
    parser.add_argument("--interval", type=float, default=1,
                        help="the daemon's JOBSUP_SAMPLE_INTERVAL in seconds")
    parser.add_argument("--settle-seconds", type=float, default=5,
                        help="wait after all jobs run, before measuring")
    parser.add_argument("--doc", type=Path, default=None,
                        help="also write the tables to this markdown file")
    parser.add_argument("--keep-data", action="store_true", help="keep the temp data dir")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="the source tree the daemon runs from (e.g. a `git archive` of a "
                             "commit, while the checkout is being edited); default this repo")
    parser.add_argument("--label", default=None,
                        help="what --source is, for the report (default: git describe)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    data_dir = Path(tempfile.mkdtemp(prefix="jobsup-load-"))
    daemon = Daemon(data_dir, args.interval, args.source.resolve())
    if args.history:
        subprocess.run([sys.executable, "-c", HISTORY_SCRIPT, str(data_dir), str(args.history)],
                       env=daemon.env, cwd=daemon.source, check=True)
    dependency = ""
    if args.waiting:
        dependency = subprocess.run(
            [sys.executable, "-c", WAITING_SCRIPT, str(data_dir), str(args.waiting)],
            env=daemon.env, cwd=daemon.source, check=True, capture_output=True,
            text=True).stdout.strip()
    if args.label is None:
        described = subprocess.run(["git", "-C", str(args.source), "describe", "--always",
                                    "--dirty"], capture_output=True, text=True)
        args.label = (f"commit {described.stdout.strip()}" if described.returncode == 0
                      else str(args.source))
    job_ids: list[str] = []
    run = threading.Event()  # set: clients stop
    windows: list[Window] = []
    stats: dict[str, RouteStats] = {}
    interrupted = False
    try:
        daemon.start()
        print(f"daemon pid {daemon.proc.pid if daemon.proc else '?'} on {daemon.url}, "
              f"data dir {data_dir}", flush=True)
        if dependency:
            job_ids.append(dependency)
        submit_jobs(daemon, args.jobs, job_ids, args.prefill, sleep=args.sleep)
        wait_all_running(daemon, job_ids, timeout_s=max(120.0, 0.5 * len(job_ids)),
                         progress=not args.sleep)
        print(f"{args.jobs} jobs running; settling {args.settle_seconds:g} s", flush=True)
        time.sleep(args.settle_seconds)
        idle, _ = measure_window(daemon, "idle (no clients)", args.idle_seconds, args.interval)
        windows.append(idle)
        print(f"idle: daemon {idle.daemon_cores:.3f} cores, {idle.ticks:.0f} ticks, "
              f"mean {ms(idle.tick_mean_s)} ms; " + tick_cost(idle, args.jobs), flush=True)
        if args.waiting:
            scale = measure_scale(daemon, dependency, args.waiting)
            scale_table = render_scale(args, idle, scale)
            print(scale_table, flush=True)
            windows.append(idle)
        else:
            load, stats = measure_window(daemon, f"load ({args.clients} clients)",
                                         args.seconds, args.interval, run, job_ids,
                                         args.clients)
            windows.append(load)
        if not args.waiting:
            print(f"load: daemon {windows[-1].daemon_cores:.3f} cores, "
                  f"{sum(len(s.latencies_s) for s in stats.values())} requests", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: stopping the jobs and the daemon", file=sys.stderr)
    finally:
        run.set()
        # a second Ctrl-C must not leave jobs behind: the cleanup runs to its end
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cleanup = stop_everything(daemon, job_ids)
        signal.signal(signal.SIGINT, previous)
        problems = [line for line in daemon.log().splitlines() if LOG_PROBLEM.search(line)]
        if args.keep_data:
            print(f"data dir kept: {data_dir}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
    if interrupted or len(windows) < 2:
        print("\n".join(problems[:20]))
        return 130 if interrupted else 1

    if args.waiting:
        table = scale_table + (f"\nDaemon log: {len(problems)} warning/error line(s).\n"
                               f"Cleanup: daemon exit {cleanup.daemon_exit}; processes left "
                               f"and SIGKILLed: {cleanup.leftovers}.\n")
        if args.doc is not None:
            args.doc.write_text(table)
        print(table)
        print("\n".join(problems[:20]))
        return 0
    table = render(args, windows, stats, problems, cleanup)
    print()
    print(table)
    if args.doc is not None:
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text(table)
        print(f"wrote {args.doc}")
    return 1 if any(s.errors for s in stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
