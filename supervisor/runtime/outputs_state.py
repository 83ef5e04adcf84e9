"""What the output scanner (`outputs.py`) keeps of each directory between scans
(`DirState`: its matching files, the names still settling, its inotify watch, its
totals), what one scan returns (`ScanResult`) and costs, and which names are never items
(`is_temp_name`). Stdlib only, like the scanner: the shim's publisher imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TEMP_SUFFIXES: tuple[str, ...] = (".tmp", ".partial", ".part", ".incomplete")
"""Name endings of files a writer has not finished; never counted as items."""

def is_temp_name(name: str) -> bool:
    """Whether a file or directory name marks unfinished or hidden output."""
    return name.startswith(".") or name.endswith(TEMP_SUFFIXES)


@dataclass(frozen=True)
class ScanResult:
    """One scan: what the output directory holds, and what finding it out cost."""

    files: int  # matching items
    bytes: int  # total size of the matching files, in bytes
    dirs_statted: int  # directories statted this scan
    dirs_listed: int  # directories re-listed (scandir) this scan
    files_statted: int  # files statted this scan
    newest_mtime: float | None = None  # newest mtime of a matching file, seconds since epoch
    waiting: int = 0  # unsettled files not statted this scan (a `final` scan stats all)


FileState = tuple[int, int, int]
"""(size in bytes, mtime_ns, inode) of one matching file. A plain tuple of ints, not an
object: less memory (~220 bytes per file in all), and the garbage collector stops tracking
it, where a full collection over 1M tracked objects would cost ~0.2 s in the daemon."""


@dataclass
class DirState:
    inode: int
    ctime_ns: int
    recheck: bool  # list again next scan even if the ctime did not move
    subdirs: dict[str, str] = field(default_factory=dict)  # name -> path relative to root
    files: dict[str, FileState] = field(default_factory=dict)  # matching files by name
    unsettled: dict[str, int] = field(default_factory=dict)
    """Names to stat again -> when (ns since the epoch, on the scan's clock)."""
    bytes_total: int = 0  # sum of the sizes in files, in bytes
    newest_mtime_ns: int | None = None
    wd: int | None = None
    """Its inotify watch (`dirwatch`), or None: then it is statted each scan."""
    changed: dict[str, int] = field(default_factory=dict)
    """Names the watch reported changed since the last scan -> their events."""

    def refresh_totals(self) -> None:
        self.bytes_total = sum(entry[0] for entry in self.files.values())
        self.newest_mtime_ns = max((entry[1] for entry in self.files.values()), default=None)

    def put_file(self, name: str, current: FileState) -> None:
        """Add or update one file, totals kept (O(1), no pass over the directory)."""
        self.drop_file(name)
        self.files[name] = current
        self.bytes_total += current[0]
        if self.newest_mtime_ns is None or current[1] > self.newest_mtime_ns:
            self.newest_mtime_ns = current[1]

    def drop_file(self, name: str) -> FileState | None:
        """Remove one file, totals kept; what was known of it."""
        old = self.files.pop(name, None)
        if old is not None:
            self.bytes_total -= old[0]
            if old[1] == self.newest_mtime_ns:  # the newest went: find the next (rare)
                self.newest_mtime_ns = max((entry[1] for entry in self.files.values()),
                                           default=None)
        return old


@dataclass
class ScanCost:
    dirs_statted: int = 0
    dirs_listed: int = 0
    files_statted: int = 0
