"""Incremental scan of a job's output directory: cost follows what changed, not the tree.

A job writes one file per item under ``output_dir``; the sampler asks every tick how many
items there are and how many bytes they hold. Walking a million files every two seconds
(what ``du`` does) costs seconds of I/O per tick, so :class:`OutputScanner` keeps state
between scans:

* per directory: its inode and ctime, its child directories, and its matching files with
  their size, mtime and inode;
* each scan stats every known directory (one ``stat`` per directory: ~500 for 1M files
  sharded 2,000 per directory) and re-lists (``os.scandir``) only directories whose ctime
  moved. Creating, deleting or renaming an entry moves the ctime of its directory, so a
  writer's ``write temp -> rename`` lands in the next scan. ctime is used rather than
  mtime because it cannot be set back with ``utime`` and it also moves on ``chmod`` (a
  directory that was unreadable and becomes readable is listed again);
* a file is re-statted only while it is unsettled: first seen with an mtime less than
  ``settle_s`` before ``now``, or with a size/mtime different from the previous stat.
  Settled files are not statted again, unless their directory is re-listed and the entry
  has a different inode (the name was atomically replaced). An unsettled file is not
  statted every scan either: ``active_recheck_s`` after a stat that found it new or
  growing, else once its mtime is ``settle_s`` old, the first moment it can settle. A
  file written once (write temp, rename) is statted about three times in all, not once
  per scan for ``settle_s``; the bytes of a file still being written lag by up to
  ``active_recheck_s``;
* directories that cannot hold a match (``rows_*/*.bin`` never needs ``logs/``) and
  dot-directories are never entered.

Known blind spots, by design (a new scanner, as after a daemon restart, walks the whole
tree once and sees them; a periodic full walk would cost a ``du`` in the tick's reading
budget, so there is none):

* a settled file rewritten or appended to in place, without a rename, is missed: nothing
  in its directory changes. So is a writer that pauses longer than ``settle_s`` between
  writes to the same file, and a file whose mtime lags ``now`` by more than ``settle_s``
  because the file server's clock is behind ours (NFS, Lustre);
* on filesystems with coarse timestamps two changes within one timestamp tick look like
  one. A directory whose ctime is within ``dir_recheck_s`` of ``now`` is therefore
  listed again on the next scan even if its ctime did not move; ``now`` must be the wall
  clock (``time.time()``) for that to hold.

Cost, listing: O(directories) stats per scan, plus one listing per changed directory
(O(entries) in it: ~0.75 us per entry in the kernel on ext4) plus one stat per new file
or unsettled one that is due; the first scan stats every file (about twice ``du``).

With a ``DirWatcher`` (``dirwatch.py``; the daemon's default, on local filesystems only)
every directory is watched from its first listing: a scan reads the kernel's events and
looks only at the names they report, with no stat of the directories and no re-listing
(a 5,000-entry directory gaining a file: 0.06 ms per scan instead of 5 ms), and an
in-place rewrite is seen through its writer's close (not a ``truncate`` by path, a
``fallocate`` or writes through ``mmap``: no event names them). An overflowed event queue
(every file statted again), or a directory that changed itself (moved, deleted, its
mode), is listed again; the root is statted each scan (a watch follows its directory, not
its path). Memory: ~220 bytes per matching file, ~1 KB of kernel memory per
watched directory.

What it keeps per directory, and what a scan returns: `outputs_state.py`.

Temp files are never items: names ending ``.tmp``, ``.partial``, ``.part`` or
``.incomplete``, dotfiles, and anything inside a dot-directory. Symlinked directories are
not followed (no cycles); symlinks to files count with the size of their target.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Iterable

from supervisor.runtime.dirwatch import Changes, DirWatcher, still_open
from supervisor.runtime.outputs_state import (
    DirState,
    FileState,
    ScanCost,
    ScanResult,
    is_temp_name,
)
from supervisor.runtime.patterns import DEFAULT_PATTERN, GlobMatcher

__all__ = ["OutputScanner"]

logger = logging.getLogger(__name__)


def _join(relative_dir: str, name: str) -> str:
    return f"{relative_dir}/{name}" if relative_dir else name


class OutputScanner:
    """Counts the items (and their bytes) under ``root`` matching ``pattern``, incrementally.

    Not thread-safe: one scanner per job, one scan at a time (the observer runs each
    job's scans in a worker thread, never two at once). ``scan(now)`` takes the wall
    clock as an argument (``time.time()``), so tests can move time forward.
    """

    def __init__(
        self,
        root: str,
        pattern: str = DEFAULT_PATTERN,
        settle_s: float = 10.0,
        dir_recheck_s: float = 2.0,
        active_recheck_s: float = 2.0,
        watcher: DirWatcher | None = None,
    ) -> None:
        """``settle_s``: a file whose mtime is older than this, and whose size and mtime
        did not change since the previous stat, is settled and not statted again.
        ``dir_recheck_s``: a directory changed less than this before ``now`` is listed
        again next scan, to cover coarse timestamps (see the module docstring).
        ``active_recheck_s``: how soon a file found new or changed is statted again.
        ``watcher``: where given, directories on local filesystems are watched (inotify)
        instead of statted each scan and re-listed on change; `close` ends the watches."""
        self.root = root
        self._root_prefix = root.rstrip("/") + "/"
        self.matcher = GlobMatcher(pattern)
        self.settle_s = settle_s
        self.dir_recheck_s = dir_recheck_s
        self.active_recheck_s = active_recheck_s
        self._dirs: dict[str, DirState] = {}  # by path relative to root, "" for the root
        self.watcher = watcher
        self._by_wd: dict[int, str] = {}  # watch -> the directory relative to root

    def scan(self, now: float, *, final: bool = False) -> ScanResult:
        """Bring the state up to date with the disk and return the totals. `final`:
        the writer has ended; stat every unsettled file now, due or not.

        Never raises for a missing root, a root that is a file, a directory or file that
        vanishes mid-scan, or an unreadable directory (skipped, logged at debug level).
        """
        cost = ScanCost()
        listed: set[str] = set()
        if self.watcher is not None:
            self._take_changes(self.watcher.changes(self, read=final))
            self._check_root(cost)
        pending = [""]
        while pending:
            relative_dir = pending.pop()
            state = self._dirs.get(relative_dir)
            if state is not None and state.wd is not None and not state.recheck:
                self._apply_changes(relative_dir, state, now, cost)  # watched: no stat
            else:
                state = self._visit(relative_dir, now, cost, listed)
            if state is not None:
                pending.extend(state.subdirs.values())
        for relative_dir, state in self._dirs.items():
            if state.unsettled and (final or relative_dir not in listed):
                self._restat_unsettled(relative_dir, state, now, cost, final=final)
        return self._result(cost)

    def watched(self, most_names: int = 64) -> bool:
        """The last scan found the root, every directory known is watched, and what the
        watches reported since is at most `most_names` file names (no new directory, no
        directory changed itself, no event lost: `DirWatcher.few_changes`): the next scan
        costs a few stats, no listing. (Two paths to one directory, through a bind mount,
        share a watch: such a tree is never counted watched.)"""
        return (self.watcher is not None and "" in self._dirs
                and len(self._by_wd) == len(self._dirs)
                and self.watcher.few_changes(self, most_names))

    def close(self) -> None:
        """The job is done with: its directories' watches go (a later scan lists)."""
        if self.watcher is not None:
            self.watcher.leave(self)
            self.watcher = None
        for state in self._dirs.values():
            state.wd = None
        self._by_wd.clear()

    def _check_root(self, cost: ScanCost) -> None:
        """The root's watch follows its directory, not its path: a parent renamed and
        made again, or a symlink on the path re-pointed, leaves it on the old one. One
        stat a scan catches that (then the root is statted and listed anew)."""
        root = self._dirs.get("")
        if root is None or root.wd is None:
            return
        cost.dirs_statted += 1
        try:
            same = os.stat(self.root).st_ino == root.inode
        except OSError:
            same = False
        if not same:
            root.recheck = True

    def _take_changes(self, changes: Changes) -> None:
        """Mark what the watches reported: names to look at, directories to stat and
        list again (changed themselves, gone, or every one after an overflow)."""
        for wd, names in changes.names.items():  # first: the names of a directory
            relative_dir = self._by_wd.get(wd)  # unwatched below are still kept
            if relative_dir is not None:
                changed = self._dirs[relative_dir].changed
                for name, mask in names.items():
                    changed[name] = changed.get(name, 0) | mask
        for wd in changes.itself:
            relative_dir = self._by_wd.get(wd)
            if relative_dir is not None:
                self._unwatch(self._dirs[relative_dir])  # a fresh watch when listed
                self._dirs[relative_dir].recheck = True
        if changes.overflow:  # events lost: every directory listed, every file statted
            for state in self._dirs.values():
                state.recheck = True
                state.changed = {name: 0 for name in state.files}

    def _apply_changes(self, relative_dir: str, state: DirState, now: float,
                       cost: ScanCost) -> None:
        """Look again at each name the watch reported in a watched directory."""
        if not state.changed:
            return
        names, state.changed = state.changed, {}
        for name, mask in names.items():
            known = state.drop_file(name)
            state.unsettled.pop(name, None)
            subdir = state.subdirs.pop(name, None)
            if subdir is not None:
                self._forget(subdir)
            self._take_name(relative_dir, name, known, state, now, cost,
                            settled=not still_open(mask))

    def _take_name(self, relative_dir: str, name: str, known: FileState | None,
                   state: DirState, now: float, cost: ScanCost, *, settled: bool) -> None:
        """`_take_entry` for a name a watch reported (no directory entry in hand);
        `settled`: no writer holds it open (`dirwatch.still_open`), so it is statted
        now and not again until its next event."""
        if is_temp_name(name):
            return
        relative_path = _join(relative_dir, name)
        path = self._path(relative_path)
        try:
            entry_stat = os.lstat(path)
        except OSError:  # gone (deleted, moved away): nothing to take
            return
        if stat.S_ISDIR(entry_stat.st_mode):
            if self.matcher.may_descend(relative_path):
                state.subdirs[name] = relative_path
            return
        if not (stat.S_ISREG(entry_stat.st_mode) or stat.S_ISLNK(entry_stat.st_mode)) \
                or not self.matcher.matches(relative_path):
            return
        same = known is not None and known[2] == entry_stat.st_ino  # written in place
        self._stat_file(path, name, known if same else None, state, now, cost,
                        taken=None if stat.S_ISLNK(entry_stat.st_mode) else entry_stat)
        if settled:
            state.unsettled.pop(name, None)

    def _unwatch(self, state: DirState) -> None:
        if state.wd is not None:
            self._by_wd.pop(state.wd, None)
            if self.watcher is not None:
                self.watcher.unwatch(state.wd, self)
            state.wd = None

    def _path(self, relative_path: str) -> str:
        return self._root_prefix + relative_path if relative_path else self.root

    def _visit(
        self, relative_dir: str, now: float, cost: ScanCost, listed: set[str]
    ) -> DirState | None:
        """Stat one directory and re-list it if it changed; ``None`` if it is gone."""
        cost.dirs_statted += 1
        try:
            dir_stat = os.stat(self._path(relative_dir))
        except OSError:  # vanished, or a path component lost its permission
            self._forget(relative_dir)
            return None
        if not stat.S_ISDIR(dir_stat.st_mode):  # e.g. a root that is a file: empty
            self._forget(relative_dir)
            return None
        state = self._dirs.get(relative_dir)
        if state is not None and state.inode != dir_stat.st_ino:  # removed and re-created
            self._forget(relative_dir)
            state = None
        if state is None or state.recheck or state.ctime_ns != dir_stat.st_ctime_ns:
            state = self._list(relative_dir, dir_stat, state, now, cost)
            self._dirs[relative_dir] = state
            listed.add(relative_dir)
        return state

    def _list(
        self,
        relative_dir: str,
        dir_stat: os.stat_result,
        old: DirState | None,
        now: float,
        cost: ScanCost,
    ) -> DirState:
        """List a directory, keeping what is known of entries that did not change."""
        cost.dirs_listed += 1
        path = self._path(relative_dir)
        wd = old.wd if old is not None else None
        if wd is None and self.watcher is not None:  # watch first: nothing falls between
            wd = self.watcher.watch(path, dir_stat.st_dev, self)
            if wd is not None:
                self._by_wd[wd] = relative_dir
        recent_ns = int((now - self.dir_recheck_s) * 1e9)
        state = DirState(
            inode=dir_stat.st_ino,
            ctime_ns=dir_stat.st_ctime_ns,
            recheck=wd is None and dir_stat.st_ctime_ns >= recent_ns,  # coarse timestamps
            wd=wd,
        )
        old_files = old.files if old is not None else {}
        old_unsettled = old.unsettled if old is not None else {}
        retake = old.changed if old is not None else {}  # a watch's names: stat them
        now_ns = int(now * 1e9)
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    known = old_files.get(entry.name)
                    if known is not None and entry.inode() == known[2] \
                            and entry.name not in retake:
                        due_ns = old_unsettled.get(entry.name)
                        if due_ns is None:
                            state.files[entry.name] = known  # settled, not replaced: no stat
                            continue
                        if due_ns > now_ns:  # unsettled, not due yet: as it was
                            state.files[entry.name] = known
                            state.unsettled[entry.name] = due_ns
                            continue
                    self._take_entry(relative_dir, entry, known, state, now, cost)
        except (FileNotFoundError, NotADirectoryError):
            state.recheck = True  # vanished between stat and listing: gone next scan
        except OSError as error:  # PermissionError and the like: skip this directory
            logger.debug("output scan: cannot list %s: %s", path, error)
        if old is not None:
            self._forget_all(old.subdirs[name] for name in old.subdirs.keys() - state.subdirs)
        state.refresh_totals()
        return state

    def _take_entry(
        self,
        relative_dir: str,
        entry: os.DirEntry[str],
        known: FileState | None,
        state: DirState,
        now: float,
        cost: ScanCost,
    ) -> None:
        """Classify a new, replaced or unsettled entry: subdirectory, item, or neither."""
        name = entry.name
        if is_temp_name(name):
            return
        relative_path = _join(relative_dir, name)
        try:
            if entry.is_dir(follow_symlinks=False):
                if self.matcher.may_descend(relative_path):
                    state.subdirs[name] = relative_path
                return
            if not entry.is_file() or not self.matcher.matches(relative_path):
                return
        except OSError:  # vanished since the listing
            return
        self._stat_file(entry.path, name, known, state, now, cost)

    def _stat_file(
        self,
        path: str,
        name: str,
        known: FileState | None,
        state: DirState,
        now: float,
        cost: ScanCost,
        taken: os.stat_result | None = None,
    ) -> None:
        """Stat one file into ``state``; drops it if it is gone. ``taken``: its stat
        already in hand (the `lstat` of a name a watch reported, not a symlink's)."""
        cost.files_statted += 1
        file_stat: os.stat_result | None = taken
        if file_stat is None:
            with contextlib.suppress(OSError):  # deleted since its listing: no item now
                file_stat = os.stat(path)
        if file_stat is None or not stat.S_ISREG(file_stat.st_mode):
            state.drop_file(name)
            state.unsettled.pop(name, None)
            return
        current = (file_stat.st_size, file_stat.st_mtime_ns, file_stat.st_ino)
        moved = known is None or known[:2] != current[:2]  # new, or its size or mtime moved
        settles_at_ns = file_stat.st_mtime_ns + int(self.settle_s * 1e9)
        now_ns = int(now * 1e9)
        state.put_file(name, current)
        if known is not None and not moved and settles_at_ns <= now_ns:
            state.unsettled.pop(name, None)  # settled: unchanged since a stat, and old
        elif known is None and settles_at_ns <= now_ns:
            state.unsettled.pop(name, None)  # first seen, and old already
        elif moved:
            state.unsettled[name] = min(now_ns + int(self.active_recheck_s * 1e9),
                                        settles_at_ns)
        else:
            state.unsettled[name] = settles_at_ns

    def _restat_unsettled(
        self, relative_dir: str, state: DirState, now: float, cost: ScanCost, *, final: bool
    ) -> None:
        now_ns = int(now * 1e9)
        due = sorted(name for name, due_ns in state.unsettled.items()
                     if final or due_ns <= now_ns)
        if not due:
            return
        for name in due:
            known = state.files.get(name)
            path = self._path(_join(relative_dir, name))
            self._stat_file(path, name, known, state, now, cost)

    def _forget(self, relative_dir: str) -> None:
        """Drop a directory and everything known below it."""
        state = self._dirs.pop(relative_dir, None)
        if state is not None:
            self._unwatch(state)
            self._forget_all(state.subdirs.values())

    def _forget_all(self, relative_dirs: Iterable[str]) -> None:
        for relative_dir in list(relative_dirs):
            self._forget(relative_dir)

    def _result(self, cost: ScanCost) -> ScanResult:
        files = bytes_total = waiting = 0
        newest_ns: int | None = None
        for state in self._dirs.values():  # one loop: most trees are one directory
            files += len(state.files)
            bytes_total += state.bytes_total
            waiting += len(state.unsettled)
            if state.newest_mtime_ns is not None and (newest_ns is None
                                                      or state.newest_mtime_ns > newest_ns):
                newest_ns = state.newest_mtime_ns
        return ScanResult(
            files=files,
            bytes=bytes_total,
            dirs_statted=cost.dirs_statted,
            dirs_listed=cost.dirs_listed,
            files_statted=cost.files_statted,
            newest_mtime=newest_ns / 1e9 if newest_ns is not None else None,
            waiting=waiting,
        )
