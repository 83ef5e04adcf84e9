"""A daemon's exclusive hold on a file (`FileLock`): the data dir's `daemon.lock`, and the
lock beside a SQLite database file that keeps two data dirs from sharing one database
(`database.DatabaseLock`).

An `flock` on an open file: the kernel drops it when the process dies, even by SIGKILL,
and the file records the holder's pid for the message a second daemon prints. The lock
belongs to the file, not to its name: a lock file deleted (or replaced) under a running
daemon leaves it holding a lock nobody else can see, and a second daemon would make a
new file of that name and take it. So the holder checks, before each tick
(`confirm`), that the name still leads to the file it holds; if not, it takes the lock
on whatever the name leads to now (making the file again if it is gone), and if
another daemon holds that, it must stop (`DatabaseTaken`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from supervisor.errors import DaemonAlreadyRunning, DatabaseTaken

log = logging.getLogger(__name__)


class FileLock:
    """This daemon's exclusive `flock` on `path` (see the module's docstring)."""

    def __init__(self, path: Path, *, what: str, hint: str):
        """`what`: what the lock guards, for messages ("the data dir /x"); `hint`: what
        to do when another daemon holds it."""
        self.path = path
        self.what = what
        self.hint = hint
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or DaemonAlreadyRunning naming the daemon that holds it."""
        taken, owner = self._take()
        if not taken:
            raise DaemonAlreadyRunning(f"another jobsup daemon (pid {owner}) owns {self.what}",
                                       hint=self.hint)

    def confirm(self) -> bool:
        """Whether `path` still names the file this daemon holds; if it was deleted or
        replaced, the lock is taken on the file it names now (a warning) and True.
        DatabaseTaken when another daemon holds that one: this daemon must stop."""
        held = self._file
        if held is None:
            return True
        try:
            now = os.stat(self.path)
            mine = os.fstat(held.fileno())
            if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                return True
            how = "replaced"
        except FileNotFoundError:
            how = "deleted"
        taken, owner = self._take()
        if not taken:
            raise DatabaseTaken(
                f"the lock file {self.path} was {how} and another jobsup daemon (pid "
                f"{owner}) took {self.what}; this daemon stops: the jobs are the other "
                "daemon's now (they keep running)",
                hint="keep one daemon per data dir and database, and leave the lock files "
                     "alone")
        log.warning("the lock file %s was %s while this daemon held it; locked it again",
                    self.path, how)
        held.close()
        return True

    def release(self) -> None:
        held, self._file = self._file, None
        if held is not None:
            held.close()

    def _take(self) -> tuple[bool, str]:
        """Lock the file `path` names now (made if missing): (True, our pid) and it is
        held, or (False, the holder's pid as its file says)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(self.path, "a+")  # noqa: SIM115 - held until `release`
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "?"
            lock_file.close()
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False, owner
        lock_file.truncate(0)
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._file = lock_file
        return True, str(os.getpid())
