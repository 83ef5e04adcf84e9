"""The local backend: shims started as children of the daemon on this machine
(`LocalBackend`), stopped with SIGTERM -> grace -> SIGKILL and re-adopted after a daemon
restart, and the `ExitWatcher` thread whose pidfds wake the engine when one exits. The
`Backend` it implements is `base.py`'s; the attempt's `launch.json`, `launch.py`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.backends.base import Attempt, Backend, LaunchFate, ShimState
from supervisor.backends.launch import (
    observe_request,
    package_root_on_path,
    scrubbed_env,
    write_launch,
)
from supervisor.runtime import files
from supervisor.runtime.fileio import create_json_exclusive
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.runtime.procfs import (
    StatReader,
    all_stats,
    boot_id_or_none,
    is_same_process,
    is_started_at,
    read_stat,
    signal_group,
    start_ticks_to_time,
    this_boot_id,
)
from supervisor.spec import JobSpec

if TYPE_CHECKING:
    from supervisor.config import Settings

log = logging.getLogger(__name__)


def worker_group_alive(worker: WorkerInfo) -> bool:
    """True while the worker's process group holds a live process of this job: the worker
    itself or, once it has ended with no shim left to clean up, what it left in its group.

    The group's id is the worker's pid, and the kernel keeps a pid number reserved while
    any process still has it as its group id. So the group is still the worker's unless
    another process now holds that pid (then the group, if any, is that stranger's)."""
    if is_same_process(worker.pid, worker.create_time, worker.start_ticks, worker.boot_id):
        return True
    holder = read_stat(worker.pid)  # our worker as a zombie, or a stranger
    if holder is not None and not is_started_at(holder, worker.start_ticks, worker.create_time,
                                                worker.boot_id):
        return False
    return any(stat.pgid == worker.pid and stat.state not in ("Z", "X")
               for stat in all_stats())


class LocalBackend(Backend):
    """Shims as children of the daemon on this machine."""

    def __init__(self, jobs_dir: Path, on_exit: Callable[[], None], *,
                 publish_interval_s: float | None = None):
        """`publish_interval_s`: the shims publish their readings this often
        (`JOBSUP_OBSERVE=shim`); None: the daemon reads the jobs itself."""
        self.jobs_dir = jobs_dir
        self.publish_interval_s = publish_interval_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._watcher = ExitWatcher(on_exit)

    @classmethod
    def from_settings(cls, settings: Settings, *, on_exit: Callable[[], None]) -> LocalBackend:
        """Its shims publish their readings only under `JOBSUP_OBSERVE=shim`."""
        return cls(settings.jobs_dir, on_exit, publish_interval_s=(
            settings.sample_interval if settings.observe == "shim" else None))

    def start(self, job_id: str, number: int, spec: JobSpec, *, cwd: str,
              stop_grace_s: float) -> Attempt:
        observe = (observe_request(spec, self.publish_interval_s)
                   if self.publish_interval_s is not None else None)
        adir = write_launch(self.jobs_dir, job_id, number, spec, cwd=cwd,
                            stop_grace_s=stop_grace_s, observe=observe)
        # `-S`: no `site` (site-packages, .pth files, an editable install's finder): the
        # shim needs the standard library and its package (PYTHONPATH) only, and each of
        # a thousand shims is ~2 MB smaller without it (#30). A publishing shim keeps it:
        # its GPU readings import NVML's `pynvml` from site-packages
        flags = () if observe is not None else ("-S",)
        with open(adir / files.SHIM_LOG, "ab") as shim_log:
            proc = subprocess.Popen(
                [sys.executable, *flags, "-m", "supervisor.runtime.shim", str(adir)],
                stdin=subprocess.DEVNULL, stdout=shim_log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, cwd="/",
                env={**scrubbed_env(os.environ),
                     "PYTHONPATH": package_root_on_path()},
            )
        self._children[proc.pid] = proc
        stat = read_stat(proc.pid)
        attempt = Attempt(job_id, number, adir, proc.pid,
                          start_ticks_to_time(stat.start_ticks) if stat else None,
                          stat.start_ticks if stat else None, this_boot_id())
        self._watcher.add(proc.pid)
        return attempt

    def attempt(self, job_id: str, number: int, shim_pid: int | None,
                shim_create_time: float | None, shim_start_ticks: int | None,
                shim_boot_id: str | None = None) -> Attempt:
        """The attempt of a stored job; the shim's identity from its own `shim.json` when
        the daemon died before recording it."""
        adir = files.attempt_dir(self.jobs_dir, job_id, number)
        if shim_pid is None:
            shim = files.read_shim(adir)
            if shim is not None:
                shim_pid, shim_create_time = shim["pid"], shim["create_time"]
                shim_start_ticks = shim.get("start_ticks")
                shim_boot_id = boot_id_or_none(shim.get("boot_id"))
        return Attempt(job_id, number, adir, shim_pid, shim_create_time, shim_start_ticks,
                       shim_boot_id)

    def settle_launch(self, attempt: Attempt) -> LaunchFate:
        """Claim an attempt whose shim left no trace (see `LaunchFate`)."""
        try:
            attempt.dir.mkdir(parents=True, exist_ok=True)
            claimed = create_json_exclusive(attempt.dir / files.CLAIM,
                                            files.Claim(by="daemon", pid=os.getpid()))
        except OSError as exc:
            log.warning("job %s: cannot claim attempt %d's launch (%s); asking again next "
                        "tick", attempt.job_id, attempt.number, exc)
            return LaunchFate.WAIT
        if claimed:
            return LaunchFate.ABANDONED
        claim = files.read_claim(attempt.dir)
        if claim is not None and claim["by"] == "daemon":
            return LaunchFate.ABANDONED  # by an earlier daemon that died before relaunching
        if claim is not None and is_same_process(claim["pid"], claim.get("create_time"),
                                                 claim.get("start_ticks"),
                                                 boot_id_or_none(claim.get("boot_id"))):
            return LaunchFate.WAIT
        return LaunchFate.DEAD

    def worker_alive(self, worker: WorkerInfo) -> bool:
        """The worker, or what it left in its process group, still runs."""
        return worker_group_alive(worker)

    def worker_running(self, worker: WorkerInfo) -> bool:
        return is_same_process(worker.pid, worker.create_time, worker.start_ticks,
                               worker.boot_id)

    def read_exit(self, attempt: Attempt) -> ExitStatus | None:
        return files.read_exit(attempt.dir)

    def shim_state(self, attempt: Attempt, stat_of: StatReader | None = None) -> ShimState:
        stat = ((stat_of or read_stat)(attempt.shim_pid) if attempt.shim_pid is not None
                else None)
        if (stat is None or stat.state in ("Z", "X")
                or not is_started_at(stat, attempt.shim_start_ticks, attempt.shim_create_time,
                                     attempt.shim_boot_id)):
            return ShimState.GONE
        return ShimState.SUSPENDED if stat.state in ("T", "t") else ShimState.RUNNING

    def request_stop(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Ask the shim to stop the job (it runs SIGTERM -> grace -> SIGKILL). Without a
        live shim, signal the worker's group directly, while it is still the job's."""
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            os.kill(attempt.shim_pid, signal.SIGTERM)
        elif worker is not None and worker_group_alive(worker):
            signal_group(worker.pid, signal.SIGTERM)

    def kill(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """SIGKILL the worker's group and the shim's other children (orphans it
        adopted), never the shim itself; then continue the shim in case it was stopped
        (SIGSTOP), so it reaps them and records the exit."""
        if worker is not None and worker_group_alive(worker):
            signal_group(worker.pid, signal.SIGKILL)
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            for stat in all_stats():
                if stat.ppid == attempt.shim_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(stat.pid, signal.SIGKILL)
            self.resume_shim(attempt)

    def resume_shim(self, attempt: Attempt) -> None:
        if attempt.shim_pid is not None and self.shim_alive(attempt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(attempt.shim_pid, signal.SIGCONT)

    def watch(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Wake the engine as soon as this attempt's shim (or shim-less worker) exits."""
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            self._watcher.add(attempt.shim_pid)
        elif worker is not None and is_same_process(worker.pid, worker.create_time,
                                                    worker.start_ticks, worker.boot_id):
            self._watcher.add(worker.pid)

    def forget(self, attempt: Attempt) -> None:
        if attempt.shim_pid is not None:
            self._watcher.remove(attempt.shim_pid)

    def reap(self) -> None:
        """Collect exited shims we started, so none stays a zombie."""
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]

    def close(self) -> None:
        self._watcher.close()


class ExitWatcher:
    """A thread polling pidfds: a process exit wakes the engine at once instead of at
    the next tick. pidfds work for processes that are not our children (re-adopted
    shims after a daemon restart)."""

    def __init__(self, on_exit: Callable[[], None]):
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jobsup-exit-watcher",
                                        daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone (the tick will notice), or no pidfd support
            self._on_exit()
            return
        with self._lock:
            if pid in self._fds.values():
                os.close(fd)
                return
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        os.write(self._wake_w, b"x")

    def remove(self, pid: int) -> None:
        with self._lock:
            for fd, watched in list(self._fds.items()):
                if watched == pid:
                    self._drop(fd)

    def _drop(self, fd: int) -> None:
        self._poll.unregister(fd)
        del self._fds[fd]
        os.close(fd)

    def _run(self) -> None:
        while not self._closed:
            events = self._poll.poll()  # no timeout: `add` and `close` write the wake pipe
            exited = False
            with self._lock:
                for fd, _mask in events:
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    elif fd in self._fds:
                        self._drop(fd)
                        exited = True
            if exited:
                self._on_exit()

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for fd in list(self._fds):
                self._drop(fd)
        os.close(self._wake_r)
        os.close(self._wake_w)
