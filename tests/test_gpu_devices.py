"""GPU memory per device: NVML's per-pid, per-device figures, their sums over a real
process tree, the job view, the Prometheus series and the CLI's text.

This machine has no GPU, so NVML itself is replaced by `FakeNvml`, put in
`sys.modules["pynvml"]` where `GpuReader` imports it (STYLE.md rule 9: fake what the
machine lacks; NVML absent is tested as the real state it is elsewhere, and the real
NVML path ran on 2 x H200, bench/gpu_job_view.py). Everything else is real: the process
trees are started here, the collector reads a real SQLite database and the daemon runs."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.api.metrics import JobsCollector, build_registry
from supervisor.client.tui import gpu_cell, gpu_memory_text
from supervisor.observe.observer import Observer
from supervisor.observe.readings import ObservedJob
from supervisor.runtime import procfs
from supervisor.runtime.gpu import GpuReader
from supervisor.runtime.sampler import Sampler, TreeTarget
from supervisor.spec import JobSpec
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from supervisor.storage.tables import Job
from tests.helpers import Daemon, job_module, python_job, wait_for
from tests.test_cli import jobsup

pytestmark = pytest.mark.timeout(60)

GB = 10**9
H200_BYTES = 143_771_000_000


class FakeNVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str | bytes
    uuid: str | bytes
    used: int
    total: int = H200_BYTES
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    """(pid, usedGpuMemory) of compute processes; None is NVML's "not available"."""
    graphics: list[tuple[int, int | None]] = field(default_factory=list)


class FakeNvml:
    """The part of pynvml that GpuReader calls; a handle is the device index. `fail`
    names a call and a device index at which that call raises NVMLError."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu]):
        self.gpus = gpus
        self.calls: Counter[str] = Counter()
        self.fail: tuple[str, int] | None = None

    def _call(self, name: str, handle: int) -> FakeGpu:
        self.calls[name] += 1
        if self.fail == (name, handle):
            raise FakeNVMLError(f"{name} failed on GPU {handle}")
        return self.gpus[handle]

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls["nvmlInit"] += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls["nvmlShutdown"] += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        gpu = self._call("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:  # noqa: N802
        return self._call("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:  # noqa: N802
        return self._call("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        gpu = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in gpu.compute]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:  # noqa: N802
        gpu = self._call("nvmlDeviceGetGraphicsRunningProcesses", handle)
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in gpu.graphics]


def install(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> FakeNvml:
    nvml = FakeNvml(gpus)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def two_gpus(pids: tuple[int, int, int] = (101, 202, 303)) -> list[FakeGpu]:
    """a on gpu0; b on gpu0 and gpu1 (a model split over both); c on gpu1, graphics."""
    a, b, c = pids
    return [
        FakeGpu("NVIDIA H200", "GPU-aaaa", used=60 * GB, compute=[(a, 4 * GB), (b, 1 * GB)]),
        FakeGpu(b"NVIDIA H200", b"GPU-bbbb", used=20 * GB, compute=[(b, 3 * GB)],
                graphics=[(c, 2 * GB)]),
    ]


# -- GpuReader ---------------------------------------------------------------------------

def test_memory_per_pid_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, two_gpus())
    reader = GpuReader()
    by_pid = reader.memory_by_pid(time.time())
    assert by_pid == {101: 4 * GB, 202: 4 * GB, 303: 2 * GB}  # the sum over devices, as before
    assert reader.device_memory_by_pid == {
        101: {0: 4 * GB}, 202: {0: 1 * GB, 1: 3 * GB}, 303: {1: 2 * GB}}
    gpu0, gpu1 = reader.devices[0], reader.devices[1]
    assert (gpu0.index, gpu0.name, gpu0.uuid) == (0, "NVIDIA H200", "GPU-aaaa")
    assert (gpu1.name, gpu1.uuid) == ("NVIDIA H200", "GPU-bbbb")  # bytes from old pynvml
    assert (gpu0.used_bytes, gpu0.total_bytes) == (60 * GB, H200_BYTES)
    assert gpu1.used_bytes == 20 * GB
    # the fullest device of a pid on two: gpu0
    assert reader.fraction_by_pid[202] == pytest.approx(60 * GB / H200_BYTES)
    reader.close()


def test_device_names_are_read_once_memory_every_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, two_gpus())
    reader = GpuReader()
    for _ in range(3):
        assert reader.memory_by_pid(time.time()) is not None
    assert nvml.calls["nvmlDeviceGetName"] == nvml.calls["nvmlDeviceGetUUID"] == 2
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 6
    nvml.gpus[0].used = 70 * GB
    reader.memory_by_pid(time.time())
    assert reader.devices[0].used_bytes == 70 * GB


def test_unknown_memory_still_counts_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML answers None for a process's memory under MIG: the pid uses the device."""
    install(monkeypatch, [FakeGpu("A100", "GPU-mig", used=GB, compute=[(7, None)])])
    reader = GpuReader()
    assert reader.memory_by_pid(time.time()) == {}
    assert reader.device_memory_by_pid == {7: {0: 0}}


def test_a_compute_and_graphics_process_is_counted_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A C+G process is in both of NVML's lists, with the same memory."""
    install(monkeypatch, [FakeGpu("H200", "GPU-cg", used=9 * GB, compute=[(5, 3 * GB)],
                                  graphics=[(5, 3 * GB), (6, None)])])
    reader = GpuReader()
    assert reader.memory_by_pid(time.time()) == {5: 3 * GB}
    assert reader.device_memory_by_pid == {5: {0: 3 * GB}, 6: {0: 0}}


def test_a_device_without_name_or_uuid_is_not_a_failed_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, two_gpus())
    nvml.fail = ("nvmlDeviceGetUUID", 1)
    reader = GpuReader()
    assert reader.memory_by_pid(time.time()) is not None
    assert (reader.devices[1].name, reader.devices[1].uuid) == ("NVIDIA H200", None)


def test_nvml_failing_mid_pass_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu0 was read, then gpu1 fails: None, and no half pass is left to be read."""
    nvml = install(monkeypatch, two_gpus())
    reader = GpuReader()
    assert reader.memory_by_pid(time.time()) is not None
    nvml.fail = ("nvmlDeviceGetMemoryInfo", 1)
    assert reader.memory_by_pid(time.time()) is None
    assert (reader.device_memory_by_pid, reader.devices, reader.fraction_by_pid) == ({}, {}, {})


def test_a_refused_process_list_skips_only_that_list(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, two_gpus())
    nvml.fail = ("nvmlDeviceGetComputeRunningProcesses", 1)
    reader = GpuReader()
    assert reader.memory_by_pid(time.time()) == {101: 4 * GB, 202: 1 * GB, 303: 2 * GB}
    assert reader.device_memory_by_pid[202] == {0: 1 * GB}


# -- a real process tree -----------------------------------------------------------------

@dataclass
class Tree:
    popen: subprocess.Popen[str]
    child: int
    child_create_time: float | None

    def target(self, job_id: str) -> TreeTarget:
        return TreeTarget(job_id, self.popen.pid, procfs.create_time(self.popen.pid),
                          self.popen.pid)


@pytest.fixture
def trees() -> Iterator[list[Tree]]:
    """Start trees with `start_tree(trees)`; each is killed as a group afterwards."""
    started: list[Tree] = []
    yield started
    for tree in started:
        procfs.signal_group(tree.popen.pid, signal.SIGKILL)
        tree.popen.wait(10)
        assert tree.popen.stdout is not None
        tree.popen.stdout.close()
    for tree in started:  # the orphaned child is gone too (a zombie counts as gone)
        wait_for(lambda t=tree: not procfs.is_same_process(t.child, t.child_create_time),
                 5, what="child gone")


def start_tree(started: list[Tree]) -> Tree:
    """A python parent and its python child, in a session of their own."""
    popen = subprocess.Popen(job_module("parent_and_child"), stdout=subprocess.PIPE, text=True,
                             start_new_session=True, stdin=subprocess.DEVNULL)
    assert popen.stdout is not None
    child = int(popen.stdout.readline())
    tree = Tree(popen, child, procfs.create_time(child))
    started.append(tree)
    return tree


def test_tree_memory_per_device(monkeypatch: pytest.MonkeyPatch, trees: list[Tree]) -> None:
    gpu_tree, cpu_tree = start_tree(trees), start_tree(trees)
    install(monkeypatch, [
        FakeGpu("NVIDIA H200", "GPU-aaaa", used=60 * GB,
                compute=[(gpu_tree.popen.pid, 2 * GB), (os.getpid(), 7 * GB)]),
        FakeGpu("NVIDIA H200", "GPU-bbbb", used=20 * GB,
                compute=[(gpu_tree.popen.pid, 3 * GB), (gpu_tree.child, 5 * GB)]),
    ])
    readings = Sampler(GpuReader()).sample(
        [gpu_tree.target("gpu"), cpu_tree.target("cpu")], now=time.time())

    reading = readings["gpu"]
    assert reading.num_procs == 2
    assert reading.gpu_memory_bytes == 10 * GB  # the test's own 7 GB is not the tree's
    assert reading.gpu_devices is not None
    assert [(d.device.index, d.memory_bytes) for d in reading.gpu_devices] == [
        (0, 2 * GB), (1, 8 * GB)]
    assert [d.device.uuid for d in reading.gpu_devices] == ["GPU-aaaa", "GPU-bbbb"]
    assert reading.gpu_devices[0].device.used_bytes == 60 * GB
    assert sum(d.memory_bytes for d in reading.gpu_devices) == reading.gpu_memory_bytes
    assert readings["cpu"].gpu_devices == () and readings["cpu"].gpu_memory_bytes == 0


def test_no_nvml_or_a_failed_pass_gives_none(monkeypatch: pytest.MonkeyPatch,
                                             trees: list[Tree]) -> None:
    tree = start_tree(trees)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert Sampler(GpuReader()).sample([tree.target("j")], time.time())["j"].gpu_devices is None

    nvml = install(monkeypatch, [FakeGpu("H200", "GPU-a", used=GB,
                                         compute=[(tree.popen.pid, GB)])])
    nvml.fail = ("nvmlDeviceGetMemoryInfo", 0)
    reading = Sampler(GpuReader()).sample([tree.target("j")], time.time())["j"]
    assert (reading.gpu_devices, reading.gpu_memory_bytes) == (None, None)
    assert reading.num_procs == 2  # the rest of the reading is whole


# -- job view and Prometheus -------------------------------------------------------------

def test_job_view_and_metric_per_device(monkeypatch: pytest.MonkeyPatch, trees: list[Tree],
                                        tmp_path: Path) -> None:
    tree = start_tree(trees)
    install(monkeypatch, [
        FakeGpu("NVIDIA H200", "GPU-aaaa", used=60 * GB, compute=[(tree.popen.pid, 16 * GB)]),
        FakeGpu("NVIDIA H200", "GPU-bbbb", used=20 * GB, compute=[(tree.child, 9 * GB)]),
    ])
    observer = Observer(tmp_path / "jobs", Sampler(GpuReader()))
    spec = JobSpec(name="split", command=["sleep", "60"], cwd=str(tmp_path))
    now = time.time()
    observer.observe([ObservedJob(job_id="j1", spec=spec, attempt=1, root_pid=tree.popen.pid,
                                  root_create_time=procfs.create_time(tree.popen.pid),
                                  worker_pid=tree.popen.pid)], now)

    resources = observer.views["j1"].resources
    assert resources.gpu_memory_bytes == 25 * GB
    assert resources.gpu_devices is not None
    assert [dataclasses.asdict(d) for d in resources.gpu_devices] == [
        {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-aaaa", "memory_bytes": 16 * GB,
         "device_used_bytes": 60 * GB, "device_total_bytes": H200_BYTES},
        {"index": 1, "name": "NVIDIA H200", "uuid": "GPU-bbbb", "memory_bytes": 9 * GB,
         "device_used_bytes": 20 * GB, "device_total_bytes": H200_BYTES}]

    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        session.add(Job(id="j1", name="split", spec_json=spec.model_dump_json(),
                        state="running", created_at=now, attempt=1, restarts=0))
        session.commit()
    registry, _ = build_registry(JobsCollector(sessions, lambda: observer.views, None, 60.0))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    engine.dispose()

    per_device = {s.labels["gpu"]: (s.labels, s.value)
                  for s in families["jobsup_job_gpu_device_memory_bytes"].samples}
    assert per_device == {
        "0": ({"job_id": "j1", "job_name": "split", "gpu": "0"}, 16 * GB),
        "1": ({"job_id": "j1", "job_name": "split", "gpu": "1"}, 9 * GB)}
    (total,) = families["jobsup_job_gpu_memory_bytes"].samples
    assert total.value == 25 * GB  # the contract's series is unchanged: the sum


@pytest.mark.slow
def test_daemon_exposes_the_field_the_family_and_the_show_row(daemon: Daemon) -> None:
    """A real daemon, whatever NVML it has: the field is there, the family is declared, and
    `jobsup show` has its GPU line."""
    job = daemon.submit(python_job("import time; time.sleep(30)"), name="gpuless")
    running = wait_for(lambda: (j := daemon.job(job["id"]))["resources"]["num_procs"] and j,
                       15, what="a sampled job")
    devices = running["resources"]["gpu_devices"]
    assert devices is None or devices == []  # this tree runs nothing on a GPU
    scrape = daemon.http.get("/metrics").text
    assert "# TYPE jobsup_job_gpu_device_memory_bytes gauge" in scrape
    shown = jobsup("show", job["id"], url=daemon.url)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^\s*GPU memory\s+(-|0 B)\s*$", shown.stdout, re.MULTILINE), shown.stdout
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


# -- CLI text ----------------------------------------------------------------------------

def device(index: int, memory_bytes: int) -> dict[str, Any]:
    return {"index": index, "name": "NVIDIA H200", "uuid": f"GPU-{index}",
            "memory_bytes": memory_bytes, "device_used_bytes": memory_bytes,
            "device_total_bytes": H200_BYTES}


def test_show_text_splits_memory_per_device() -> None:
    two = {"gpu_memory_bytes": 32_100_000_000,
           "gpu_devices": [device(0, 16_000_000_000), device(1, 16_100_000_000)]}
    assert gpu_memory_text(two) == (
        "32.1 GB  (gpu0 16.0 GB of 143.8 GB, gpu1 16.1 GB of 143.8 GB)")
    one = {"gpu_memory_bytes": 16 * GB, "gpu_devices": [device(3, 16 * GB)]}
    assert gpu_memory_text(one) == "16.0 GB  (gpu3 16.0 GB of 143.8 GB)"
    assert gpu_memory_text({"gpu_memory_bytes": 0, "gpu_devices": []}) == "0 B"
    assert gpu_memory_text({"gpu_memory_bytes": None, "gpu_devices": None}) == "-"
    # a daemon from before the field
    assert gpu_memory_text({"gpu_memory_bytes": 5 * GB}) == "5.0 GB"


def test_table_cell_counts_devices_only_when_several() -> None:
    two = {"gpu_memory_bytes": 32_100_000_000,
           "gpu_devices": [device(0, 16_000_000_000), device(1, 16_100_000_000)]}
    assert gpu_cell(two) == "32.1 GB (2 GPUs)"
    assert gpu_cell({"gpu_memory_bytes": 16 * GB, "gpu_devices": [device(0, 16 * GB)]}) == (
        "16.0 GB")
    assert gpu_cell({"gpu_memory_bytes": None, "gpu_devices": None}) == "-"
