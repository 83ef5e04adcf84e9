"""Benchmark: where one tick's CPU goes, job by job, in-process (#15).

`bench/load.py` measures the whole daemon from outside (its process's CPU); this runs the
engine in this process, over a real SQLite database and N real jobs (load.py's: a file a
second, and a progress file, a counted log or neither), ticks it every `--interval`
seconds, and prints the CPU per job per tick of the tick thread, of the other threads
(the file readings' pool, the exit watcher) and of the process, then of each part of the
tick (each timed with the thread's CPU clock around it; nested parts overlap, and the
timing adds ~1-2 us per call). `--profile` adds a cProfile of the ticks (the pool's
threads included), sorted by cumulative and own time.

    .venv/bin/python bench/tick_profile.py --jobs 40 --seconds 30
    .venv/bin/python bench/tick_profile.py --jobs 40 --seconds 30 --source /tmp/before
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import importlib
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = [
    ("supervisor.daemon.loop", "Engine.tick"),
    ("supervisor.daemon.checks", "JobChecks._check_running"),  # (before #31)
    ("supervisor.daemon.checks", "JobChecks.check_running"),
    ("supervisor.daemon.loop", "Engine._observed"),
    ("supervisor.observe.observer", "Observer.observe"),
    ("supervisor.observe.observer", "Observer._start_readings"),
    ("supervisor.observe.readings", "FileSide.read"),
    ("supervisor.runtime.outputs", "OutputScanner.scan"),
    ("supervisor.observe.outputs", "OutputScanner.scan"),  # its place in trees before #31
    ("supervisor.observe.readings", "FileSide.progress"),
    ("supervisor.observe.observer", "Observer._sample_trees"),
    ("supervisor.observe.building", "JobViewBuilder._observe_one"),  # (before #31)
    ("supervisor.observe.building", "JobViewBuilder.observe_one"),
    ("supervisor.daemon.loop", "Engine._store_samples"),
    ("supervisor.daemon.loop", "Engine._alert"),
]
"""(module, Class.method) timed; a part missing from the tree measured is skipped."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=20.0,
                        help="ticks before measuring (the jobs' first readings: walks)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between ticks")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile")
    parser.add_argument("--sleep", action="store_true",
                        help="the jobs are `sleep`s (a shim and a process each, no output), "
                             "as `load.py --sleep`'s")
    parser.add_argument("--waiting", type=int, default=0, metavar="N",
                        help="N more jobs pending behind one running dependency, as "
                             "`load.py --waiting`'s (#30)")
    parser.add_argument("--no-parts", action="store_true",
                        help="time no part of the tick (under a sampling profiler: py-spy)")
    parser.add_argument("--part", action="append", default=[], metavar="MODULE:CALLABLE",
                        help="also time this function or Class.method (repeatable), e.g. "
                             "supervisor.runtime.sampler:ProcessScan.read")
    parser.add_argument("--profile-out", metavar="FILE",
                        help="with --profile, also save the stats there (pstats, snakeviz)")
    parser.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                        help="the source tree the engine is imported from (default: this repo)")
    args = parser.parse_args()
    source = Path(args.source).resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # load.py's jobs
    import load  # (which imports this repo's supervisor: dropped, to import `source`'s)

    for name in [name for name in sys.modules if name.partition(".")[0] == "supervisor"]:
        del sys.modules[name]
    sys.path.insert(0, str(source))
    import supervisor
    if not Path(supervisor.__file__).resolve().is_relative_to(source):
        raise SystemExit(f"supervisor imported from {supervisor.__file__}, not {source}")

    from supervisor.api.submission import submit_job
    from supervisor.config import Settings
    from supervisor.daemon.loop import Engine
    from supervisor.spec import JobSpec
    from supervisor.storage.database import make_engine, make_sessionmaker, upgrade

    data = Path(tempfile.mkdtemp(prefix="jobsup-tickprof-"))
    settings = Settings(data_dir=data, sample_interval=args.interval)
    settings.jobs_dir.mkdir(parents=True)
    database = make_engine(settings.resolved_database_url)
    upgrade(database)
    sessions = make_sessionmaker(database)
    profiles: list[cProfile.Profile] = []
    if args.profile:  # the pool's threads too: each starts its own profile
        def start_profile(*_: Any) -> None:
            profile = cProfile.Profile(time.thread_time)
            profiles.append(profile)
            profile.enable()
        threading.setprofile(start_profile)
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    parts = ([] if args.no_parts else PARTS) + [tuple(extra.split(":")) for extra in args.part]
    for module_name, path in parts:
        _time_part(module_name, path, spent, calls)
    try:  # the engine's one constructor (#31); a tree from before it: the class
        from supervisor.daemon.wiring import build_engine
    except ImportError:
        build_engine = Engine
    engine = build_engine(settings, sessions)
    if args.waiting:  # load.py's: records and directories as submits make, faster
        subprocess.run([sys.executable, "-c", load.WAITING_SCRIPT, str(data),
                        str(args.waiting)], env={**os.environ, "PYTHONPATH": str(source)},
                       check=True, capture_output=True)
    for index in range(args.jobs):
        if args.sleep:
            with sessions() as session:
                submit_job(session, JobSpec(name=f"sleep-{index:04d}", stop_grace_s=5,
                                            command=["sleep", "86400"]),
                           default_cwd=str(data), views={}, jobs_dir=settings.jobs_dir)
                session.commit()
            continue
        kind = load.PROGRESS_KINDS[index % len(load.PROGRESS_KINDS)]
        out = data / "outputs" / f"job{index:03d}"
        out.mkdir(parents=True)
        spec = JobSpec(name=f"p{index}", output_dir=str(out), pattern="*.txt",
                       command=["sh", "-c", load.JOB_SCRIPT, "job", kind, str(out),
                                str(load.EXPECTED_ITEMS)],
                       expected_items=load.EXPECTED_ITEMS, stop_grace_s=5)
        with sessions() as session:
            submit_job(session, spec, default_cwd=str(data), views={},
                       jobs_dir=settings.jobs_dir)
            session.commit()
    try:
        heap = _settle_heap()  # as `serve` does before the daemon's first tick
        _run(engine, args.warmup, args.interval, None)
        while _running(sessions) < args.jobs + (1 if args.waiting else 0):
            _run(engine, args.interval, args.interval, None)  # launches take some ticks
        spent.clear()
        calls.clear()
        gc_spent = _GcTimer()
        before_process, before_others = os.times(), _other_threads_cpu()
        profile = cProfile.Profile(time.thread_time) if args.profile else None
        walls: list[float] = []
        tick_cpu, ticks = _run(engine, args.seconds, args.interval, profile, walls)
        after_process, after_others = os.times(), _other_threads_cpu()
        gc_spent.stop()
    finally:
        engine.observer.close()
        engine.backend.close()
        _kill_jobs(settings.jobs_dir)
    process = (after_process.user + after_process.system
               - before_process.user - before_process.system)
    per_job = 1000 / ticks / max(args.jobs, 1)  # --jobs 0: per tick
    print(f"source {source}: {args.jobs} jobs, {ticks} ticks {args.interval:g} s apart; "
          f"heap as the daemon's: {heap}")
    print(f"tick wall: mean {1000 * sum(walls) / len(walls):.0f} ms, "
          f"max {1000 * max(walls):.0f} ms")
    print(f"| what | ms per {'job per ' if args.jobs else ''}tick | calls per tick |")
    print("| --- | ---: | ---: |")
    print(f"| process | {process * per_job:.3f} | |")
    print(f"| tick thread | {tick_cpu * per_job:.3f} | |")
    print(f"| other threads | {(after_others - before_others) * per_job:.3f} | |")
    print(f"| garbage collections (tick thread) | {gc_spent.seconds * per_job:.3f} "
          f"| {gc_spent.collections / ticks:.2f} |")
    for _, path in parts:
        if calls[path]:
            print(f"| {path} | {spent[path] * per_job:.3f} | {calls[path] / ticks:.0f} |")
    if profile is not None:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        for thread_profile in profiles:
            thread_profile.disable()
            stats.add(thread_profile)
        if args.profile_out:
            stats.dump_stats(args.profile_out)
        stats.sort_stats("cumulative").print_stats(50)
        stats.sort_stats("tottime").print_stats(30)
        print(out.getvalue())


def _settle_heap() -> str:
    """The heap as the daemon leaves it before serving (`app.settle_heap`; a tree from
    before it: collected and frozen, as its `serve` did)."""
    app = importlib.import_module("supervisor.daemon.app")
    settle = getattr(app, "settle_heap", None)
    if settle is None:
        gc.collect()
        gc.freeze()
        return f"collected, frozen, thresholds {gc.get_threshold()}"
    settle()
    return f"app.settle_heap, thresholds {gc.get_threshold()}"


class _GcTimer:
    """The thread CPU the tick thread (this one) spends in garbage collections."""

    def __init__(self) -> None:
        self.seconds, self.collections, self._began = 0.0, 0, 0.0
        self._thread = threading.get_ident()
        gc.callbacks.append(self._note)

    def _note(self, phase: str, _info: dict[str, int]) -> None:
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._began = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._began
            self.collections += 1

    def stop(self) -> None:
        gc.callbacks.remove(self._note)


def _time_part(module_name: str, path: str, spent: collections.Counter[str],
               calls: collections.Counter[str]) -> None:
    """Wrap `Class.method` of the module with a thread-CPU timer."""
    try:
        owner: Any = importlib.import_module(module_name)
        *classes, name = path.split(".")
        for class_name in classes:
            owner = getattr(owner, class_name)
        real: Callable[..., Any] = getattr(owner, name)
    except (ImportError, AttributeError):
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            spent[path] += time.thread_time() - started
            calls[path] += 1

    setattr(owner, name, timed)


def _run(engine: Any, seconds: float, interval: float,
         profile: cProfile.Profile | None,
         walls: list[float] | None = None) -> tuple[float, int]:
    """Tick every `interval` for `seconds`: (the ticks' thread CPU seconds, ticks); each
    tick's wall seconds appended to `walls`."""
    end = time.monotonic() + seconds
    cpu, ticks = 0.0, 0
    while time.monotonic() < end:
        started, began = time.thread_time(), time.monotonic()
        if profile is not None:
            profile.enable()
        engine.tick()
        if profile is not None:
            profile.disable()
        cpu += time.thread_time() - started
        if walls is not None:
            walls.append(time.monotonic() - began)
        ticks += 1
        time.sleep(interval)
    return cpu, ticks


def _running(sessions: Any) -> int:
    """How many jobs run (all of them launched: the measured ticks launch none)."""
    from supervisor.spec import JobState
    from supervisor.storage import store
    with sessions() as session:
        return store.count_by_state(session).get(JobState.RUNNING.value, 0)


def _other_threads_cpu() -> float:
    total = 0.0
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.ident is None:
            continue
        with contextlib.suppress(OSError, ValueError):  # ended meanwhile
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def _kill_jobs(jobs_dir: Path) -> None:
    """The jobs' workers (their process groups) and shims go with the benchmark."""
    from supervisor.runtime import files
    for kind, pid in files.live_processes(jobs_dir):
        with contextlib.suppress(OSError):
            if kind == files.WORKER:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
