"""GPU memory per process through NVML. No NVML, no driver or no GPU is a supported
state: readings are then None, never an exception out of a tick."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

RETRY_INIT_S = 300.0
"""After a failed nvmlInit, seconds before trying again (a driver may be loaded later)."""


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as NVML numbers it, at the moment of a pass. NVML's index order need not
    be CUDA's (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER): the UUID is what identifies it."""

    index: int
    name: str | None
    uuid: str | None
    used_bytes: int
    """Memory in use on the device by every process, ours or not."""
    total_bytes: int


@dataclass
class _Pass:
    """What one walk over the devices found; published only when the walk completed."""

    memory_by_pid: dict[int, int] = field(default_factory=dict)
    fraction_by_pid: dict[int, float] = field(default_factory=dict)
    device_memory_by_pid: dict[int, dict[int, int]] = field(default_factory=dict)
    devices: dict[int, GpuDevice] = field(default_factory=dict)

    def add(self, pid: int, device: GpuDevice, memory: Any) -> None:
        """One process entry of one device. A pid whose memory NVML cannot tell (None,
        e.g. under MIG) still counts as using the device, with 0 bytes."""
        known = isinstance(memory, int) and memory >= 0
        if known:
            self.memory_by_pid[pid] = self.memory_by_pid.get(pid, 0) + memory
        on_devices = self.device_memory_by_pid.setdefault(pid, {})
        on_devices[device.index] = on_devices.get(device.index, 0) + (memory if known else 0)
        fraction = device.used_bytes / device.total_bytes if device.total_bytes else 0.0
        self.fraction_by_pid[pid] = max(self.fraction_by_pid.get(pid, 0.0), fraction)


def _text(value: Any) -> str:
    """NVML bindings before 11.5 return names and UUIDs as bytes."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class GpuReader:
    def __init__(self) -> None:
        self._nvml: Any = None
        self._ready = False
        self._next_init_at = 0.0
        self._identity: dict[int, tuple[str | None, str | None]] = {}
        """(name, UUID) per NVML index, read once per init: they do not change."""
        self.fraction_by_pid: dict[int, float] = {}
        """After `memory_by_pid`: per pid, how full (0..1) the fullest GPU it uses is."""
        self.device_memory_by_pid: dict[int, dict[int, int]] = {}
        """After `memory_by_pid`: {pid: {NVML index: bytes}}."""
        self.devices: dict[int, GpuDevice] = {}
        """After `memory_by_pid`: every device by NVML index, with its used and total bytes."""

    def _init(self, now: float) -> bool:
        if self._ready:
            return True
        if now < self._next_init_at:
            return False
        self._next_init_at = now + RETRY_INIT_S
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded
            log.debug("NVML not available: %s", exc)
            return False
        self._nvml, self._ready = pynvml, True
        return True

    @property
    def available(self) -> bool:
        """NVML answered (a driver and at least the library are there)."""
        return self._ready

    def memory_by_pid(self, now: float) -> dict[int, int] | None:
        """{pid: GPU memory in bytes} over all devices, or None when NVML is unavailable.
        The same pass fills `fraction_by_pid`, `device_memory_by_pid` and `devices`; a
        failed pass empties them, so none of them outlives the tick it describes."""
        if not self._init(now):
            return None
        try:
            found = self._walk(self._nvml)
        except Exception as exc:  # a GPU fallen off the bus must not break the tick
            log.warning("NVML query failed: %s", exc)
            found = None
        published = found if found is not None else _Pass()
        self.fraction_by_pid = published.fraction_by_pid
        self.device_memory_by_pid = published.device_memory_by_pid
        self.devices = published.devices
        return None if found is None else found.memory_by_pid

    def _walk(self, nvml: Any) -> _Pass:
        found = _Pass()
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            name, uuid = self._device_identity(nvml, index, handle)
            device = GpuDevice(index=index, name=name, uuid=uuid,
                               used_bytes=int(info.used), total_bytes=int(info.total))
            found.devices[index] = device
            getters: list[Callable[[Any], Any]] = [
                nvml.nvmlDeviceGetComputeRunningProcesses,
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
            ]
            # a process doing both compute and graphics (type C+G) is in both lists
            # with the same memory: counted once per device
            on_device: dict[int, Any] = {}
            for getter in getters:
                try:
                    processes = getter(handle)
                except nvml.NVMLError:
                    continue
                for proc in processes:
                    memory = proc.usedGpuMemory
                    if not isinstance(on_device.get(proc.pid), int) or (
                            isinstance(memory, int) and memory > on_device[proc.pid]):
                        on_device[proc.pid] = memory
            for pid, memory in on_device.items():
                found.add(pid, device, memory)
        return found

    def _device_identity(self, nvml: Any, index: int,
                         handle: Any) -> tuple[str | None, str | None]:
        """Name and UUID of a device, asked of NVML the first time it is seen. A device
        that cannot tell (NVMLError_NotSupported) has None there, not a failed pass."""
        identity = self._identity.get(index)
        if identity is None:
            values: list[str | None] = []
            for getter in (nvml.nvmlDeviceGetName, nvml.nvmlDeviceGetUUID):
                try:
                    values.append(_text(getter(handle)))
                except nvml.NVMLError:
                    values.append(None)
            identity = self._identity[index] = (values[0], values[1])
        return identity

    def close(self) -> None:
        if self._ready:
            with contextlib.suppress(Exception):  # shutting down: nothing to do about it
                self._nvml.nvmlShutdown()
            self._ready = False
            self._identity = {}
