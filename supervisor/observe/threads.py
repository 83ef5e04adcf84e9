"""The threads that take the jobs' file readings (output scans, progress files, free
space) off the tick: a reading stuck on a dead file server holds one thread, not the
daemon."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class FilePool:
    """A few daemon threads running the file readings. Daemon threads, not
    `concurrent.futures.ThreadPoolExecutor` (which joins its threads at exit): a reading
    stuck on a dead file server never keeps the daemon from exiting."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._outstanding = 0
        """Tasks submitted and not finished (under `_lock`): more than there are threads,
        and a task would wait behind a reading that may never end."""
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, task: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the observer is closed")
            self._outstanding += 1
            if len(self._threads) < self.size and self._outstanding > len(self._threads):
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"jobsup-observe-{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
            self._tasks.put((future, task))
        return future

    def close(self) -> None:
        """Cancel what has not started and let the threads end; a running reading
        finishes in its thread (nobody waits for it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    queued = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if queued is not None:
                    queued[0].cancel()
            for _ in self._threads:
                self._tasks.put(None)

    def _work(self) -> None:
        while (queued := self._tasks.get()) is not None:
            future, task = queued
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = task()
                except BaseException as error:  # whatever it is, the future must complete
                    future.set_exception(error)
                else:
                    future.set_result(result)
            finally:
                with self._lock:
                    self._outstanding -= 1
