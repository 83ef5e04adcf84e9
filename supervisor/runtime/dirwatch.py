"""Which directories changed since the last look: Linux inotify, for the output scanner.

Re-listing a directory costs the kernel ~0.75 us per entry on ext4 (measured: 150 us for
200 entries): a job adding one file a second to a directory of 3,600 files would cost
~3 ms of every tick for that listing alone. With a watch on each directory the scanner
descends into, the kernel says which names changed (created, deleted, moved in or out,
closed after writing, attributes changed) and the scanner looks at those names only: no
listing, and not even the one `stat` per directory per scan (docs/architecture.md, #15).

One inotify instance serves every scanner of a process (the per-user limit on
instances is 128 by default; watches are plentiful): scanners subscribe to directories;
each scan drains whatever the kernel has queued and hands every subscriber its share
(once the engine's tick has drained the queue before its readings, each scanner's next
regular scan takes its share of that drain without reading the queue again).
When the kernel's queue overflowed, every subscriber is told to list all its
directories again.

Only on local filesystems (`LOCAL_FILESYSTEMS`): inotify sees the changes made through
this machine's kernel, so on NFS, Lustre, GPFS or any FUSE filesystem a file written on
another node would never be seen; there the scanner keeps listing (`watch` says None).
Stdlib only (ctypes), like the rest of the scanner: the shim's publisher imports it too.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import sys
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_ISDIR = 0x40000000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_DONT_FOLLOW = 0x2000000
IN_EXCL_UNLINK = 0x4000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

WATCH_MASK = (  # not IN_MODIFY (an event per write()): IN_CLOSE_WRITE instead
    IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
    | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
def still_open(mask: int) -> bool:
    """A name's events say it may still be open for writing: created, and no close after
    writing seen yet. Anything else (closed, renamed in, its attributes changed) is a
    file whose next change raises another event: its stat is its size until then."""
    return bool(mask & IN_CREATE) and not mask & IN_CLOSE_WRITE


SELF_EVENTS = IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED
"""Events about the watched directory itself (no name): stat and list it again."""

_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len of the NUL-padded name
READ_BYTES = 256 * 1024

LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs",
    "bcachefs", "jfs", "reiserfs", "nilfs2", "vfat", "exfat", "ntfs3", "hfsplus",
})
"""Filesystems whose every change goes through this machine's kernel. Anything else
(nfs, nfs4, lustre, gpfs, cifs, ceph, beegfs, 9p, virtiofs, fuse.*) is listed instead."""


def local_devices(mountinfo: str) -> dict[int, bool]:
    """st_dev -> whether inotify sees every change there, from /proc/self/mountinfo's
    text (`36 35 98:0 / /mnt rw - ext4 /dev/sda1 rw`: field 3 is major:minor, the type
    follows the `-`)."""
    out: dict[int, bool] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            major, minor = (int(part) for part in fields[2].split(":"))
            fstype = fields[fields.index("-", 6) + 1]
        except (IndexError, ValueError):
            continue
        out[os.makedev(major, minor)] = fstype in LOCAL_FILESYSTEMS
    return out


@dataclass
class Changes:
    """What one subscriber's watched directories went through since its last look."""

    names: dict[int, dict[str, int]] = field(default_factory=dict)
    """Watch descriptor -> names in that directory that changed (look at each again) ->
    the events seen for each, OR-ed (`IN_CREATE`, `IN_CLOSE_WRITE`, ...)."""
    itself: set[int] = field(default_factory=set)
    """Watch descriptors whose directory itself changed, moved, or went away."""
    overflow: bool = False
    """The kernel dropped events: every directory must be listed again."""


class DirWatcher:
    """One inotify instance shared by the scanners of this process. Thread-safe: scans
    of different jobs run in different threads."""

    def __init__(self) -> None:
        """Raises OSError where inotify is not available (not Linux, no instance left)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._add_watch = libc.inotify_add_watch
            self._rm_watch = libc.inotify_rm_watch
            init = libc.inotify_init1
        except (OSError, AttributeError) as error:
            raise OSError(errno.ENOSYS, f"no inotify here: {error}") from error
        self._add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        self.fd = fd
        self._lock = threading.Lock()
        self._subscribers: dict[int, set[int]] = {}  # wd -> ids of the subscribers
        self._pending: dict[int, Changes] = {}  # subscriber id -> changes not taken yet
        self._devices: dict[int, bool] = {}
        self._limit_logged = False
        self._fresh: set[int] = set()  # subscriber ids: `drain` read the queue for them

    @classmethod
    def open(cls) -> DirWatcher | None:
        """A watcher, or None where inotify cannot be had (the scanners then list)."""
        try:
            return cls()
        except OSError as error:
            logger.info("output scans list directories (no inotify: %s)", error)
            return None

    def is_local(self, dev: int) -> bool:
        """Whether the filesystem of device `dev` is one of `LOCAL_FILESYSTEMS`."""
        with self._lock:
            devices = self._devices
            if dev not in devices:  # a mount we have not seen: read the table again
                try:
                    with open("/proc/self/mountinfo", encoding="utf-8",
                              errors="replace") as f:
                        devices = local_devices(f.read())
                except OSError:
                    devices = dict(devices)
                devices.setdefault(dev, False)
                self._devices = devices
            return devices[dev]

    def watch(self, path: str, dev: int, subscriber: object) -> int | None:
        """A watch on the directory `path` (on device `dev`) for `subscriber`; None if
        its filesystem is not local, or the watch cannot be had (limit reached, gone)."""
        if self.fd < 0 or not self.is_local(dev):
            return None
        with self._lock:
            wd = self._add_watch(self.fd, os.fsencode(path), WATCH_MASK)
            if wd < 0:
                code = ctypes.get_errno()
                if code == errno.ENOSPC and not self._limit_logged:
                    self._limit_logged = True
                    logger.warning("inotify watch limit reached (fs.inotify.max_user_watches):"
                                   " further output directories are listed instead")
                return None
            self._subscribers.setdefault(wd, set()).add(id(subscriber))
            self._pending.setdefault(id(subscriber), Changes())
            return int(wd)

    def unwatch(self, wd: int, subscriber: object) -> None:
        """`subscriber` no longer needs `wd`; the watch goes with its last subscriber."""
        with self._lock:
            subscribers = self._subscribers.get(wd)
            if subscribers is None:
                return
            subscribers.discard(id(subscriber))
            pending = self._pending.get(id(subscriber))
            if pending is not None:
                pending.names.pop(wd, None)
                pending.itself.discard(wd)
            if not subscribers:
                del self._subscribers[wd]
                if self.fd >= 0:
                    self._rm_watch(self.fd, wd)  # EINVAL when the kernel dropped it: fine

    def leave(self, subscriber: object) -> None:
        """`subscriber` is done (its job ended): every watch of its goes."""
        with self._lock:
            wds = [wd for wd, subs in self._subscribers.items() if id(subscriber) in subs]
        for wd in wds:
            self.unwatch(wd, subscriber)
        with self._lock:
            self._pending.pop(id(subscriber), None)
            self._fresh.discard(id(subscriber))

    def drain(self) -> None:
        """Read what the kernel queued and share it out now (`few_changes` then knows
        what was reported, and of a queue that overflowed, up to this moment); each
        subscriber's next `changes` takes it without reading the queue again."""
        with self._lock:
            self._drain()
            self._fresh = set(self._pending)

    def few_changes(self, subscriber: object, most_names: int) -> bool:
        """What `subscriber`'s watches reported since its last `changes` (as far as read
        from the kernel: see `drain`) is at most `most_names` names, none a directory,
        no directory changed itself and no event was lost: its next scan stats those
        names and lists nothing (a directory created or moved in is listed whole, its
        whole subtree; an overflow restats every file)."""
        with self._lock:
            pending = self._pending.get(id(subscriber))
            if pending is None or pending.overflow or pending.itself:
                return False
            names = 0
            for changed in pending.names.values():
                names += len(changed)
                if names > most_names or any(mask & IN_ISDIR for mask in changed.values()):
                    return False
            return True

    def changes(self, subscriber: object, *, read: bool = False) -> Changes:
        """Read what the kernel queued, share it out, and take `subscriber`'s share. The
        first call for a subscriber after a `drain` does not read the queue again unless
        asked to (`read`: a job's final reading, which must see what came up to its
        end): the tick drains it before its readings, and each of those taken right
        after in the tick thread (most jobs, most ticks) found it empty, at ~5 us a read
        (#15); what came since is its next reading's, as if it had been taken at the
        drain."""
        with self._lock:
            key = id(subscriber)
            drained = key in self._fresh and not read
            self._fresh.discard(key)
            if not drained:
                self._drain()
            taken = self._pending.get(key)
            if taken is None:
                return Changes()
            self._pending[key] = Changes()
            return taken

    def _drain(self) -> None:
        subscribers_of, pending_of = self._subscribers, self._pending
        unpack, header = EVENT_HEADER.unpack_from, EVENT_HEADER.size
        while self.fd >= 0:
            try:
                data = os.read(self.fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError as error:
                logger.warning("inotify read failed (%s): every directory listed again", error)
                self._overflow()
                return
            offset, end = 0, len(data)
            while offset + header <= end:  # one pass a tick over every job's events: lean
                wd, mask, _cookie, length = unpack(data, offset)
                start = offset + header
                offset = start + length
                if mask & IN_Q_OVERFLOW:
                    self._overflow()
                    continue
                subscribers = subscribers_of.get(wd, ())
                name = (data[start:offset].rstrip(b"\0").decode(_FS_ENCODING, _FS_ERRORS)
                        if length else "")  # os.fsdecode's, without its call per event
                for subscriber in subscribers:
                    pending = pending_of.get(subscriber)
                    if pending is None:  # left meanwhile
                        continue
                    if name:
                        names = pending.names.get(wd)
                        if names is None:
                            names = pending.names[wd] = {}
                        names[name] = names.get(name, 0) | mask
                    elif mask & SELF_EVENTS:
                        pending.itself.add(wd)
                if mask & IN_IGNORED:  # the kernel dropped the watch (directory gone)
                    subscribers_of.pop(wd, None)

    def _overflow(self) -> None:
        for pending in self._pending.values():
            pending.overflow = True

    def close(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self._subscribers.clear()
            self._pending.clear()
