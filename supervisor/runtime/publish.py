"""The shim's readings of its own job, published for a daemon that cannot take them: a
thread in the shim appends one `observed.Observed` line to the attempt's `observed.jsonl`
every `Observe.interval_s` while the worker runs (`launch.json`'s `observe` asks for it).

Why the attempt directory and not HTTP to the daemon: the directory already carries the
launch, the claim and the exit between the two, so a job that can be run at all can be
observed this way; a compute node needs no network path to the daemon, the shim holds no
credential, and a daemon that is down, restarting or slow finds every reading it missed
in the file (the buffer is the file). What it costs: the directory must be on a
filesystem both machines mount (it already must be, for `status.json`), and a reading
reaches the daemon after the filesystem's attribute cache lets it see the file grow
(each line is written with its own open/close, which NFS's close-to-open consistency
flushes). The file is bounded: at `Observe.max_bytes` it is renamed to
`observed.jsonl.1` (the one before is dropped) and a new one is started.

Stdlib only at import time, like the rest of the shim. The readings reuse the daemon's
stdlib-only readers, imported when the first reading is taken: `runtime.sampler` (one
/proc pass), `runtime.outputs` (the incremental output scan) and `runtime.gpu` (NVML,
which imports `pynvml` only then and reads None where it is absent or fails).
`tests/test_layout.py` holds them to the standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from supervisor.runtime import files, observed
from supervisor.runtime.fileio import PRIVATE_MODE

if TYPE_CHECKING:
    from supervisor.runtime.gpu import GpuReader
    from supervisor.runtime.outputs import OutputScanner
    from supervisor.runtime.sampler import ProcessScan

FINAL_READING_WAIT_S = 5.0
"""How long the shim waits, once the worker ended, for the last reading (the final output
scan) before it records the exit anyway: a scan stuck on a dead file server must not
keep the exit from being known."""


class Publisher:
    """Takes a reading of the tree under `shim_pid` every interval and appends it to the
    attempt's `observed.jsonl`. Never raises out of its thread: a reading that fails says
    so in its `error` field, a line that cannot be written (a full disk) is skipped."""

    def __init__(self, attempt_dir: Path, observe: files.Observe, *, shim_pid: int,
                 worker_pid: int, cwd: str) -> None:
        self.path = attempt_dir / files.OBSERVED
        self.rotated = attempt_dir / files.OBSERVED_ROTATED
        self.observe = observe
        self.max_bytes = max(observe.get("max_bytes", files.OBSERVED_MAX_BYTES),
                             files.OBSERVED_MIN_BYTES)
        self.shim_pid = shim_pid
        self.worker_pid = worker_pid
        self.disk_path = observe["output_dir"] or cwd
        self.node = socket.gethostname()
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jobsup-publish", daemon=True)
        self._scanner: OutputScanner | None = None
        self._processes: ProcessScan | None = None
        self._gpu: GpuReader | None = None
        self._warned: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, wait_s: float = FINAL_READING_WAIT_S) -> bool:
        """The worker ended: take one final reading and end the thread, waiting for it
        at most `wait_s`. True when it ended in time."""
        self._stop.set()
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        interval = self.observe["interval_s"]
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._publish_or_warn(final=False)
            next_at += interval
            now = time.monotonic()
            if next_at <= now:  # a slow reading: the next one an interval from now
                next_at = now + interval
            self._stop.wait(next_at - now)
        self._publish_or_warn(final=True)
        if self._gpu is not None:
            self._gpu.close()

    def _publish_or_warn(self, *, final: bool) -> None:
        try:
            self.publish(final=final)
        except Exception as exc:  # noqa: BLE001 - a bug here must not end the readings
            self._warn(f"a reading failed: {exc!r}")  # once while it repeats

    def publish(self, *, final: bool) -> observed.Observed:
        """Take one reading and append it; returns it."""
        self.seq += 1
        reading = self.reading(final=final)
        self.append(json.dumps(reading, separators=(",", ":")).encode() + b"\n")
        return reading

    def append(self, line: bytes) -> None:
        """Append a line, rotating the file first if the line would take it over the cap.
        Open, write, close: a reader on another machine (NFS) sees whole lines."""
        try:
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                os.replace(self.path, self.rotated)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                         PRIVATE_MODE)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk: this reading is lost, the job goes on
            self._warn(f"cannot write {self.path.name} ({exc})")

    def reading(self, *, final: bool) -> observed.Observed:
        errors: list[str] = []
        tree = self._tree(errors)
        scan = self._scan(final, errors)
        free_bytes = total_bytes = device = None
        path = Path(self.disk_path)  # or its nearest existing parent (not created yet)
        while True:
            try:
                stat = os.statvfs(path)
                free_bytes, total_bytes = (stat.f_bavail * stat.f_frsize,
                                           stat.f_blocks * stat.f_frsize)
                device = os.stat(path).st_dev
                break
            except OSError as exc:
                if path.parent == path:
                    errors.append(f"disk: {exc.strerror or exc}")
                    break
                path = path.parent
        reading: dict[str, Any] = dict(
            seq=self.seq, t=time.time(), node=self.node, interval_s=self.observe["interval_s"],
            **tree, **scan, disk_free_bytes=free_bytes, disk_total_bytes=total_bytes,
            disk_device=device, final=final, error="; ".join(errors)[:300] or None)
        return cast(observed.Observed, reading)

    def _tree(self, errors: list[str]) -> dict[str, Any]:
        """The shim's descendants in one /proc pass (the daemon's `ProcessScan`: the node's
        other processes are read once, not every interval)."""
        from supervisor.runtime.procfs import CLOCK_TICKS, PAGE_SIZE
        from supervisor.runtime.sampler import STATUS_NAMES, ProcessScan

        tree: dict[str, Any] = dict(status=None, num_procs=0, num_threads=0, cpu_time_s=0.0,
                                    rss_bytes=0, read_bytes=0, write_bytes=0,
                                    gpu_memory_bytes=None, gpu_devices=None)
        try:
            if self._processes is None:
                self._processes = ProcessScan()
            table = self._processes.read([self.shim_pid])
            procs = [p for p in table.tree(self.shim_pid) if p.pid != self.shim_pid]
        except Exception as exc:  # noqa: BLE001 - a reading never ends the shim
            errors.append(f"processes: {exc}")
            return tree
        live = [p for p in procs if p.state not in ("Z", "X")]
        worker = table.procs.get(self.worker_pid)
        for proc in live:
            io = self._processes.io_bytes(proc.pid)
            if io is not None:
                tree["read_bytes"] += io[0]
                tree["write_bytes"] += io[1]
        tree.update(
            status=STATUS_NAMES.get(worker.state, worker.state) if worker in procs else None,
            num_procs=len(live), num_threads=sum(p.num_threads for p in live),
            cpu_time_s=sum(p.cpu_ticks for p in procs) / CLOCK_TICKS + self._reaped_cpu_s(),
            rss_bytes=sum(p.rss_pages for p in live) * PAGE_SIZE)
        if self.observe["gpu"]:
            try:
                tree.update(self._gpu_memory({p.pid for p in live}))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"gpu: {exc}")
        return tree

    def _reaped_cpu_s(self) -> float:
        """CPU seconds of the processes the shim has reaped (the worker at its end, and
        the orphans it adopted as subreaper): they leave the tree, their time goes to the
        shim's cutime/cstime. Counted as the daemon's sampler counts them (it sums the
        shim's cumulative ticks); the shim's own time is not the job's."""
        if self.shim_pid != os.getpid():
            return 0.0
        times = os.times()
        return times.children_user + times.children_system

    def _gpu_memory(self, pids: set[int]) -> dict[str, Any]:
        from supervisor.runtime.gpu import GpuReader

        if self._gpu is None:
            self._gpu = GpuReader()
        by_pid = self._gpu.memory_by_pid(time.monotonic())
        if by_pid is None:
            return {}
        by_index: dict[int, int] = {}
        for pid in pids:
            for index, memory in self._gpu.device_memory_by_pid.get(pid, {}).items():
                by_index[index] = by_index.get(index, 0) + memory
        devices = [observed.ObservedGpu(
            index=index, name=self._gpu.devices[index].name, uuid=self._gpu.devices[index].uuid,
            memory_bytes=memory, used_bytes=self._gpu.devices[index].used_bytes,
            total_bytes=self._gpu.devices[index].total_bytes)
            for index, memory in sorted(by_index.items()) if index in self._gpu.devices]
        return {"gpu_memory_bytes": sum(by_pid.get(pid, 0) for pid in pids),
                "gpu_devices": devices}

    def _scan(self, final: bool, errors: list[str]) -> dict[str, Any]:
        output_dir = self.observe["output_dir"]
        if not output_dir:
            return {"files": None, "bytes_written": None, "waiting": 0}
        try:
            if self._scanner is None:
                from supervisor.runtime.outputs import OutputScanner

                self._scanner = OutputScanner(output_dir, self.observe["pattern"])
            # file mtimes are the file server's wall clock: the scan compares with that
            scan = self._scanner.scan(time.time(), final=final)
        except Exception as exc:  # noqa: BLE001 - an invalid pattern, a bug: say so
            errors.append(f"output scan: {exc}")
            return {"files": None, "bytes_written": None, "waiting": 0}
        return {"files": scan.files, "bytes_written": scan.bytes, "waiting": scan.waiting}

    def _warn(self, message: str) -> None:
        if message != self._warned:
            self._warned = message
            with contextlib.suppress(OSError):
                print(f"jobsup shim: {message}", file=sys.stderr)
