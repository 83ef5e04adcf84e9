"""The threads that take the jobs' file readings (output scans, progress files, free
space) off the tick: a reading stuck on a dead file server holds one thread, not the
daemon."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class FilePool:
    """A few daemon threads running the file readings. Daemon threads, not
    `concurrent.futures.ThreadPoolExecutor` (which joins its threads at exit): a reading
    stuck on a dead file server never keeps the daemon from exiting."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._tasks: queue.SimpleQueue[list[tuple[Future[Any], Callable[[], Any]]] | None] = (
            queue.SimpleQueue())
        self._threads: list[threading.Thread] = []
        self._outstanding = 0
        """Batches submitted and not finished (under `_lock`): more than there are
        threads, and a batch would wait behind a reading that may never end."""
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, task: Callable[[], T]) -> Future[T]:
        return self.submit_all([task])[0]

    def submit_all(self, tasks: Sequence[Callable[[], T]]) -> list[Future[T]]:
        """Run `tasks` one after the other in one thread, each future completed as its
        task ends. One hand-over per batch, not per task: waking a thread per job each
        tick (a thread per job, contending for the interpreter lock) cost more CPU than
        the readings themselves at 40 jobs. A task stuck on a dead file server holds the
        rest of its batch: batch together only what shares that fate (one filesystem)."""
        futures: list[Future[T]] = [Future() for _ in tasks]
        if not tasks:
            return futures
        with self._lock:
            if self._closed:
                raise RuntimeError("the observer is closed")
            self._outstanding += 1
            if len(self._threads) < self.size and self._outstanding > len(self._threads):
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"jobsup-observe-{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
            self._tasks.put(list(zip(futures, tasks, strict=True)))
        return futures

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
                for future, _ in queued or ():
                    future.cancel()
            for _ in self._threads:
                self._tasks.put(None)

    def _work(self) -> None:
        while (batch := self._tasks.get()) is not None:
            try:
                for future, task in batch:
                    if not future.set_running_or_notify_cancel():
                        continue
                    try:
                        result = task()
                    except BaseException as error:  # whatever it is, the future completes
                        future.set_exception(error)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self._outstanding -= 1
