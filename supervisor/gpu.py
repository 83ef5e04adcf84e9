"""GPU memory per process through NVML. No NVML, no driver or no GPU is a supported
state: readings are then None, never an exception out of a tick."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

RETRY_INIT_S = 300.0
"""After a failed nvmlInit, seconds before trying again (a driver may be loaded later)."""


class GpuReader:
    def __init__(self) -> None:
        self._nvml: Any = None
        self._ready = False
        self._next_init_at = 0.0
        self.fraction_by_pid: dict[int, float] = {}
        """After `memory_by_pid`: per pid, how full (0..1) the fullest GPU it uses is."""

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
        """{pid: GPU memory in bytes} over all devices, or None when NVML is unavailable."""
        if not self._init(now):
            return None
        nvml = self._nvml
        used: dict[int, int] = {}
        fraction: dict[int, float] = {}
        try:
            count = nvml.nvmlDeviceGetCount()
            for index in range(count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                device_fraction = info.used / info.total if info.total else 0.0
                getters: list[Callable[[Any], Any]] = [
                    nvml.nvmlDeviceGetComputeRunningProcesses,
                    nvml.nvmlDeviceGetGraphicsRunningProcesses,
                ]
                for getter in getters:
                    try:
                        processes = getter(handle)
                    except nvml.NVMLError:
                        continue
                    for proc in processes:
                        memory = proc.usedGpuMemory
                        if isinstance(memory, int) and memory >= 0:
                            used[proc.pid] = used.get(proc.pid, 0) + memory
                        fraction[proc.pid] = max(fraction.get(proc.pid, 0.0), device_fraction)
        except Exception as exc:  # a GPU fallen off the bus must not break the tick
            log.warning("NVML query failed: %s", exc)
            return None
        self.fraction_by_pid = fraction
        return used

    def close(self) -> None:
        if self._ready:
            with contextlib.suppress(Exception):  # shutting down: nothing to do about it
                self._nvml.nvmlShutdown()
            self._ready = False
