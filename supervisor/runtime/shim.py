"""The per-job shim: `python -m supervisor.runtime.shim ATTEMPT_DIR`.

The daemon never owns a job directly. It starts this small process in a new session;
the shim starts the worker in a process group of its own, waits for it and writes the
exit status to `status.json` (reserved before the worker starts, overwritten in place).
The files it reads and writes, their names and fields, are those of `files.py`.
A daemon crash, upgrade or `kill -9` therefore never kills a job, and the exit status is
known even when the job ended while the daemon was down or the disk filled up (the
conmon / containerd-shim pattern).

The shim is also the job's subreaper: descendants that double-fork or `setsid` away
are re-parented to it, so it reaps every zombie and, when the worker ends, kills what
the worker left behind. A job that has ended has no process left.

Stop: SIGTERM (or SIGINT/SIGHUP) to the shim forwards SIGTERM to the worker's group
and, after `stop_grace_s`, sends SIGKILL to the group and every remaining descendant.

Stdlib only (plus the stdlib-only `fileio`, `files`, `procfs` and `publish` of this
package): it must start fast and must not break when the daemon's dependencies are
upgraded under a running job. When `launch.json` has an `observe` object, a thread
(`publish.py`) also appends readings of the job to `observed.jsonl` for a daemon that
cannot read this node, the last one after the worker ended and before the exit is
recorded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from supervisor.runtime import files
from supervisor.runtime.fileio import PRIVATE_MODE, atomic_write_json, create_json_exclusive
from supervisor.runtime.procfs import (
    all_stats,
    create_time,
    signal_group,
    start_ticks_of,
    this_boot_id,
)

PR_SET_CHILD_SUBREAPER = 36
CLAIM_FILE = files.CLAIM
"""Created once per attempt, by the shim before it starts the worker or by a daemon that
gave the launch up (the shim left no trace in time): whoever creates it owns the
attempt, so a shim that starts late never runs a job the daemon launched again."""
STATUS_FILE = files.STATUS
STATUS_RESERVED_BYTES = 4096
"""`status.json` is created this large, padded with spaces, before the worker starts,
and overwritten in place when it ends: the exit is recorded in blocks the file already
owns, so a disk that filled up meanwhile cannot lose it. Readers see the reservation
(`files.RESERVED`), a torn write (invalid JSON) or the whole status: the padding
makes any mix of old and new bytes invalid JSON. (Copy-on-write filesystems such as
btrfs or ZFS allocate even for an overwrite; there the guarantee is only as good as
their reserve.)"""
LEFTOVER_GRACE_S = 2.0
"""Seconds leftover descendants get between SIGTERM and SIGKILL once the worker ended."""
KILL_POLL_S = 0.001
KILL_POLL_FOR_S = 5.0
"""Past the grace, the shim looks for children to SIGKILL every `KILL_POLL_S` for this
long, then every 0.05 s (a process stuck in the kernel, state D, may never die)."""


def _become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _children_of(ppid: int) -> list[int]:
    """Pids whose parent is `ppid` (one pass over /proc)."""
    return [stat.pid for stat in all_stats() if stat.ppid == ppid and stat.state != "Z"]


def _own_children() -> list[int]:
    """This process's children: what each of its threads lists in
    `/proc/self/task/TID/children` (the kernel's own list: a few reads, where a pass over
    /proc reads every process's stat, so a short-lived child has far less time to be
    missed); one pass over /proc where the kernel lacks it (CONFIG_PROC_CHILDREN)."""
    children: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
        for tid in tasks:
            with contextlib.suppress(FileNotFoundError), \
                    open(f"/proc/self/task/{tid}/children") as f:  # (a thread that ended)
                children += (int(pid) for pid in f.read().split())
    except OSError:
        return _children_of(os.getpid())
    return children


def oom_kill_count() -> int | None:
    """The `oom_kill` counter of our memory cgroup: cgroup v2 `memory.events`, else v1
    `memory.oom_control` (own path first, then the mount's root, which is what a
    container with a cgroup namespace sees). None when none of them is readable."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    candidates += [f"/sys/fs/cgroup{path.rstrip('/')}/memory.events",
                                   "/sys/fs/cgroup/memory.events"]
                elif "memory" in controllers.split(","):
                    candidates += [f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control",
                                   "/sys/fs/cgroup/memory/memory.oom_control"]
    except (OSError, ValueError):
        return None
    for candidate in candidates:
        try:
            with open(candidate) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _reap_all() -> bool:
    """Reap every exited child without blocking; whether a child is left (the kernel's
    answer: `ECHILD` once there is none, a zombie included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


class Shim:
    def __init__(self, attempt_dir: Path, launch: files.Launch):
        self.attempt_dir = attempt_dir
        self.launch = launch
        self.grace_s = launch["stop_grace_s"]
        self.worker: subprocess.Popen[bytes] | None = None
        self.oom_kills_at_start: int | None = None
        self.stop_requested = False
        self.killed = False

    # -- signal handlers: Python runs them in the main thread between bytecodes, so
    # they may call os.killpg; wait4 is retried after them (PEP 475).
    def _on_stop(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_requested:
            return
        self.stop_requested = True
        if self.worker is not None:
            signal_group(self.worker.pid, signal.SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_grace_over(self, _signum: int, _frame: FrameType | None) -> None:
        self.killed = True
        if self.worker is not None:
            signal_group(self.worker.pid, signal.SIGKILL)
        for pid in _children_of(os.getpid()):
            _kill(pid, signal.SIGKILL)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGALRM, self._on_grace_over)
        _become_subreaper()
        me = os.getpid()
        identity = files.Identity(pid=me, create_time=create_time(me),
                                  start_ticks=start_ticks_of(me), boot_id=this_boot_id())
        try:
            reserve_status(self.attempt_dir / STATUS_FILE)
        except OSError as exc:  # a full disk: the daemon claims and relaunches later
            print(f"jobsup shim: cannot reserve {STATUS_FILE} ({exc}); not starting the job",
                  file=sys.stderr)
            return 1
        try:
            claimed = create_json_exclusive(self.attempt_dir / CLAIM_FILE, files.Claim(
                by="shim", pid=identity["pid"], create_time=identity["create_time"],
                start_ticks=identity.get("start_ticks"), boot_id=identity.get("boot_id")))
        except OSError as exc:  # a full disk: the daemon settles the launch later
            print(f"jobsup shim: cannot claim the launch ({exc}); not starting the job",
                  file=sys.stderr)
            return 1
        if not claimed:
            print("jobsup shim: the daemon gave this launch up (the shim started too late); "
                  "not starting the job", file=sys.stderr)
            return 0
        _write_or_warn(self.attempt_dir / files.SHIM, identity)

        self.oom_kills_at_start = oom_kill_count()
        log_path = self.launch["log_path"]
        with open(log_path, "ab", buffering=0) as log:
            try:
                self.worker = subprocess.Popen(
                    self.launch["argv"],
                    cwd=self.launch["cwd"],
                    env=worker_environment(self.launch, os.environ),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=0,
                    close_fds=True,
                )
            except OSError as exc:
                message = f"jobsup: cannot start {self.launch['argv'][0]!r}: {exc.strerror}\n"
                log.write(message.encode())
                code = 126 if isinstance(exc, PermissionError) else 127
                self._write_status(exit_code=code, sig=None, spawn_error=message.strip())
                return 0

        worker_pid = self.worker.pid
        _write_or_warn(self.attempt_dir / files.WORKER, files.WorkerRecord(
            pid=worker_pid, create_time=create_time(worker_pid),
            start_ticks=start_ticks_of(worker_pid), boot_id=this_boot_id(),
            started_at=time.time()))
        if self.stop_requested:  # a stop that arrived while the worker was starting
            signal_group(worker_pid, signal.SIGTERM)
        publisher = None
        if "observe" in self.launch:  # the daemon cannot read this node: publish readings
            # imported here: a shim that does not publish stays without it (~1 MB, #30)
            from supervisor.runtime.publish import Publisher
            publisher = Publisher(self.attempt_dir, self.launch["observe"], shim_pid=me,
                                  worker_pid=worker_pid, cwd=self.launch["cwd"])
            publisher.start()

        status, max_rss_kb = self._wait_for(worker_pid)
        self.worker.returncode = 0  # reaped by wait4 above; keep Popen from waiting again
        signal.setitimer(signal.ITIMER_REAL, 0)
        self._clean_up_leftovers(worker_pid)
        if publisher is not None and not publisher.stop():
            print("jobsup shim: the final reading is still running; recording the exit "
                  "without it", file=sys.stderr)

        if os.WIFSIGNALED(status):
            self._write_status(exit_code=None, sig=os.WTERMSIG(status), max_rss_kb=max_rss_kb)
        else:
            exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            self._write_status(exit_code=exit_code, sig=None, max_rss_kb=max_rss_kb)
        return 0

    def _wait_for(self, worker_pid: int) -> tuple[int, int]:
        """Reap children (the worker and any orphan re-parented to us) until the worker
        has exited; returns its wait status and peak RSS in KiB."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, 0)
            except ChildProcessError:  # cannot happen while the worker lives; be safe
                return 0, 0
            if pid == worker_pid:
                return status, usage.ru_maxrss

    def _clean_up_leftovers(self, worker_pid: int) -> None:
        """Kill what the worker left: its process group, then every child we have (each
        an orphan re-parented to us, its subreaper), SIGTERM first (once each) and
        SIGKILL after a short grace, until we have no child at all. That end is the
        kernel's answer (`_reap_all`), not a scan's: a descendant of ours is our child
        or a child's descendant, so none is left once no child is. A scan may miss a
        process that forks and exits as it passes (a chain of setsid-fork-exit
        generations, each an orphan a moment), and the chain then ran on under init
        once we had exited; now we look again until it is caught (issue #30)."""
        signal_group(worker_pid, signal.SIGTERM)
        termed: set[int] = set()
        started = time.monotonic()
        deadline = started + (0 if self.killed else LEFTOVER_GRACE_S)
        while _reap_all():
            now = time.monotonic()
            kill = now >= deadline
            if kill:
                signal_group(worker_pid, signal.SIGKILL)
            for pid in _own_children():
                if kill:
                    _kill(pid, signal.SIGKILL)
                elif pid not in termed:
                    termed.add(pid)
                    _kill(pid, signal.SIGTERM)
            # past the grace, look often for a while: a generation of a fork chain is
            # our child only between its parent's exit and its own
            time.sleep(KILL_POLL_S if kill and now - deadline < KILL_POLL_FOR_S else 0.05)

    def _write_status(
        self, *, exit_code: int | None, sig: int | None, max_rss_kb: int = 0,
        spawn_error: str | None = None,
    ) -> None:
        write_status(self.attempt_dir / STATUS_FILE, files.Status(
            pid=self.worker.pid if self.worker else None,
            exit_code=exit_code,
            signal=sig,
            ended_at=time.time(),
            stop_requested=self.stop_requested,
            killed_after_grace=self.killed,
            max_rss_bytes=max_rss_kb * 1024,
            # 300 characters: JSON escapes a non-ASCII one to up to 12 bytes, and the
            # whole status must fit its 4 KiB reservation
            spawn_error=spawn_error[:300] if spawn_error else None,
            oom_kills=_delta(self.oom_kills_at_start, oom_kill_count()),
        ))


def worker_environment(launch: files.Launch, own: Mapping[str, str]) -> dict[str, str]:
    """The launch's environment, plus the shim's own variables whose names start with
    one of its `inherit_env` prefixes (a SLURM allocation's `SLURM_*`: srun needs them
    to start the job's ranks inside the allocation)."""
    prefixes = tuple(launch.get("inherit_env", ()))
    env = dict(launch["env"])
    if prefixes:
        env.update({k: v for k, v in own.items() if k.startswith(prefixes)})
    return env


def reserve_status(path: Path) -> None:
    """Create the status file at its full size, holding `files.RESERVED`, on disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                 PRIVATE_MODE)
    try:
        _write_all(fd, _padded(files.RESERVED))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_status(path: Path, status: files.Status) -> None:
    """Overwrite the reserved status file in place (no new blocks, no temp file).

    Where it is gone, it is written anew, its directory made again first: an attempt
    dir from before reservations existed, or one deleted, moved or emptied while the
    job ran (an operator's cleanup, a tmp cleaner). The daemon reads the exit at this
    path and nowhere else; without it a job that ended well would end `lost` (#46)."""
    data = _padded(status)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, status)
        return
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _padded(data: Mapping[str, Any]) -> bytes:
    text = json.dumps(data).encode()
    if len(text) > STATUS_RESERVED_BYTES:
        raise ValueError(f"status too large for its reservation ({len(text)} bytes)")
    return text + b" " * (STATUS_RESERVED_BYTES - len(text))


def _write_all(fd: int, data: bytes) -> None:
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, data[offset:], offset)


def _write_or_warn(path: Path, data: Mapping[str, Any]) -> None:
    """Write a file the daemon can do without (it finds the processes through the
    claim and the process tree), so a full disk does not end the shim."""
    try:
        atomic_write_json(path, data)
    except OSError as exc:
        with contextlib.suppress(OSError):
            print(f"jobsup shim: cannot write {path.name} ({exc})", file=sys.stderr)


def _delta(before: int | None, after: int | None) -> int | None:
    return after - before if before is not None and after is not None else None


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m supervisor.runtime.shim ATTEMPT_DIR", file=sys.stderr)
        return 2
    attempt_dir = Path(argv[0])
    launch = files.read_launch(attempt_dir)
    if launch is None:
        print(f"jobsup shim: no readable {files.LAUNCH} in {attempt_dir}", file=sys.stderr)
        return 2
    return Shim(attempt_dir, launch).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
