"""The output scanner with inotify watches (supervisor/runtime/dirwatch.py), on real
directories: what it counts equals a fresh walk after every kind of change, a scan of a
watched tree lists and stats nothing that did not change, and watches end with the job."""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.runtime.dirwatch import DirWatcher, local_devices
from supervisor.runtime.outputs import OutputScanner
from supervisor.runtime.outputs_state import ScanResult
from tests.helpers import LATER, make_shards, write


@pytest.fixture
def watcher() -> Iterator[DirWatcher]:
    opened = DirWatcher()
    yield opened
    opened.close()


def kernel_watches(watcher: DirWatcher) -> int:
    """The inotify watches the kernel holds for the instance (/proc/self/fdinfo)."""
    text = Path(f"/proc/self/fdinfo/{watcher.fd}").read_text()
    return sum(line.startswith("inotify wd:") for line in text.splitlines())


def fresh(root: Path, pattern: str = "**/*") -> ScanResult:
    return OutputScanner(str(root), pattern).scan(LATER, final=True)


def same_totals(got: ScanResult, root: Path, pattern: str = "**/*") -> bool:
    walked = fresh(root, pattern)
    return (got.files, got.bytes, got.newest_mtime) == (
        walked.files, walked.bytes, walked.newest_mtime)


def test_a_watched_tree_costs_no_stat_and_no_listing_until_it_changes(
        tmp_path: Path, watcher: DirWatcher) -> None:
    make_shards(tmp_path, dirs=10, per_dir=500)
    scanner = OutputScanner(str(tmp_path), "**/*.safetensors", watcher=watcher)
    first = scanner.scan(LATER)
    assert (first.files, first.dirs_listed, first.files_statted) == (5000, 11, 5000)
    assert kernel_watches(watcher) == 11
    idle = scanner.scan(LATER)
    assert (idle.files, idle.bytes) == (first.files, first.bytes)
    assert (idle.dirs_statted, idle.dirs_listed, idle.files_statted) == (1, 0, 0)  # the root

    write(tmp_path / "rows_1500-2000" / "item_new.safetensors", 9)  # no wait: no ctime race
    grown = scanner.scan(LATER)
    assert (grown.files, grown.bytes) == (5001, first.bytes + 9)
    assert (grown.dirs_statted, grown.dirs_listed, grown.files_statted) == (1, 0, 1)


def test_every_kind_of_change_is_seen(tmp_path: Path, watcher: DirWatcher) -> None:
    """Create, rename from temp, replace by rename, delete, a new subdirectory with files,
    a removed one, one re-created under the same name, an in-place append (the blind
    spot of listing: inotify reports the writer's close)."""
    make_shards(tmp_path, dirs=3, per_dir=10, suffix=".bin")
    scanner = OutputScanner(str(tmp_path), "**/*.bin", watcher=watcher)
    scanner.scan(LATER)
    rows = [tmp_path / "rows_0-10", tmp_path / "rows_10-20", tmp_path / "rows_20-30"]

    def append(path: Path, data: bytes) -> None:
        with path.open("ab") as handle:
            handle.write(data)

    steps = [
        lambda: write(rows[0] / "new.bin", 11),
        lambda: (write(rows[0] / ".x.bin.tmp", 5),
                 os.rename(rows[0] / ".x.bin.tmp", rows[0] / "x.bin")),
        lambda: (write(tmp_path / ".r.tmp", 40),
                 os.replace(tmp_path / ".r.tmp", rows[1] / "item_3.bin")),
        lambda: (rows[0] / "item_1.bin").unlink(),
        lambda: write(tmp_path / "fresh" / "deep" / "a.bin", 3),
        lambda: shutil.rmtree(rows[2]),
        lambda: (shutil.rmtree(rows[1]), write(rows[1] / "z.bin", 2)),
        lambda: append(rows[0] / "new.bin", b"more"),
        lambda: os.rename(tmp_path / "fresh", tmp_path / "moved"),
    ]
    for step in steps:
        step()
        assert same_totals(scanner.scan(LATER), tmp_path, "**/*.bin")


def test_random_changes_keep_the_totals_of_a_fresh_walk(tmp_path: Path,
                                                        watcher: DirWatcher) -> None:
    rng = random.Random(18)
    dirs = [tmp_path / f"d{i}" for i in range(4)]
    scanner = OutputScanner(str(tmp_path), "**/*.bin", watcher=watcher)
    for _ in range(30):
        for _ in range(20):
            path = rng.choice(dirs) / f"f{rng.randint(0, 40)}.bin"
            action = rng.choice(["write", "write", "delete", "replace", "append", "rmdir"])
            if action == "write":
                write(path, rng.randint(1, 60))
            elif action == "delete":
                path.unlink(missing_ok=True)
            elif action == "replace" and path.exists():
                write(path.with_suffix(".tmp"), rng.randint(1, 60))
                os.replace(path.with_suffix(".tmp"), path)
            elif action == "append" and path.exists():
                with path.open("ab") as handle:
                    handle.write(b"x" * rng.randint(1, 9))
            elif action == "rmdir" and rng.random() < 0.2:
                shutil.rmtree(path.parent, ignore_errors=True)
        assert same_totals(scanner.scan(LATER), tmp_path, "**/*.bin")


def test_root_created_late_then_removed(tmp_path: Path, watcher: DirWatcher) -> None:
    root = tmp_path / "out"
    scanner = OutputScanner(str(root), watcher=watcher)
    assert scanner.scan(LATER).files == 0
    write(root / "a.bin", 4)
    assert scanner.scan(LATER).files == 1
    write(root / "b.bin", 4)
    assert scanner.scan(LATER).files == 2
    shutil.rmtree(root)
    assert (scanner.scan(LATER).files, scanner.scan(LATER).bytes) == (0, 0)
    write(root / "c.bin", 1)  # and back, a new directory: watched again
    assert scanner.scan(LATER).files == 1
    write(root / "d.bin", 1)
    assert scanner.scan(LATER).files == 2


def test_a_lost_queue_lists_everything_again(tmp_path: Path, watcher: DirWatcher) -> None:
    """More events than the kernel queues (fs.inotify.max_queued_events): the overflow
    makes every directory be listed again, and nothing is lost."""
    queued = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if queued > 40_000:
        pytest.skip(f"max_queued_events is {queued}: too many files to overflow it here")
    write(tmp_path / "settled.bin", 5)
    scanner = OutputScanner(str(tmp_path), watcher=watcher)
    scanner.scan(LATER)
    for index in range(queued + 100):  # two events each (create, close_write)
        (tmp_path / f"f{index}").touch()
    with (tmp_path / "settled.bin").open("ab") as handle:  # its close: past the queue
        handle.write(b"in place")
    assert scanner.watched()  # the overflow is still in the kernel's queue
    watcher.drain()
    assert not scanner.watched()  # read: its next scan is a walk (the observer's threads')
    result = scanner.scan(LATER)
    assert scanner.watched()
    assert result.dirs_listed == 1
    assert result.files == queued + 101
    assert same_totals(result, tmp_path)  # the rewrite in place too: every file statted


def test_watches_end_with_the_scanner_and_are_shared(tmp_path: Path,
                                                     watcher: DirWatcher) -> None:
    make_shards(tmp_path, dirs=2, per_dir=3)
    one = OutputScanner(str(tmp_path), watcher=watcher)
    two = OutputScanner(str(tmp_path / "rows_0-3"), watcher=watcher)  # a subtree of one's
    one.scan(LATER)
    two.scan(LATER)
    assert kernel_watches(watcher) == 3  # the shared directory is one watch
    one.close()
    assert kernel_watches(watcher) == 1  # two's stays
    write(tmp_path / "rows_0-3" / "more.safetensors", 1)
    assert two.scan(LATER).files == 4
    two.close()
    assert kernel_watches(watcher) == 0


def test_a_closed_scanner_lists_and_watches_nothing_again(tmp_path: Path,
                                                           watcher: DirWatcher) -> None:
    scanner = OutputScanner(str(tmp_path), watcher=watcher)
    write(tmp_path / "a.bin", 1)
    scanner.scan(LATER)
    scanner.close()  # e.g. closed while the final reading was queued
    assert kernel_watches(watcher) == 0
    write(tmp_path / "b.bin", 2)
    assert (scanner.scan(LATER, final=True).files, scanner.scan(LATER).files) == (2, 2)
    assert kernel_watches(watcher) == 0  # no watch taken again, none leaked


def test_only_local_filesystems_are_watched() -> None:
    mountinfo = "\n".join([
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw",
        "40 22 0:45 / /scratch rw - lustre 10.0.0.1@tcp:/fs rw",
        "41 22 0:46 / /home rw shared:5 - nfs4 srv:/home rw,vers=4.2",
        "42 22 0:47 / /mnt/s3 rw - fuse.s3fs s3fs rw",
        "43 22 0:48 / /dev/shm rw - tmpfs tmpfs rw",
        "garbage line",
    ])
    devices = local_devices(mountinfo)
    assert devices == {os.makedev(8, 1): True, os.makedev(0, 45): False,
                       os.makedev(0, 46): False, os.makedev(0, 47): False,
                       os.makedev(0, 48): True}
    watcher = DirWatcher()
    try:
        watcher._devices = {os.makedev(0, 46): False}
        assert watcher.watch("/", os.makedev(0, 46), object()) is None  # nfs: listed
        assert kernel_watches(watcher) == 0
    finally:
        watcher.close()


def test_a_closed_file_is_statted_once_an_open_one_until_its_close(
        tmp_path: Path, watcher: DirWatcher) -> None:
    """Listing cannot tell a finished file from one still being written, so it stats a
    new file again until its mtime is `settle_s` old (3 stats for one file). A watch can:
    a file closed after writing (or renamed in) is statted once, and its next change
    raises another event; one still open is statted as it grows, until its close."""
    scanner = OutputScanner(str(tmp_path), settle_s=10.0, dir_recheck_s=0.0,
                            active_recheck_s=2.0, watcher=watcher)
    scanner.scan(LATER)
    write(tmp_path / "done.bin", 10)  # created, written, closed
    with (tmp_path / "open.bin").open("wb") as handle:
        handle.write(b"x" * 5)
        handle.flush()
        now = time.time()
        first = scanner.scan(now)
        assert (first.files, first.bytes, first.files_statted) == (2, 15, 2)
        assert [scanner.scan(now + s).files_statted for s in (1, 2.5, 5)] == [0, 1, 0]
        handle.write(b"y" * 20)
    closed = scanner.scan(now + 6)  # the close: statted, settled
    assert (closed.bytes, closed.files_statted, closed.waiting) == (35, 1, 0)
    assert scanner.scan(now + 60).files_statted == 0


def test_a_root_whose_parent_is_replaced_is_found_again(tmp_path: Path,
                                                        watcher: DirWatcher) -> None:
    """A watch follows its directory: `mv run run.old; mkdir -p run/out` leaves it on the
    old one. The root's path is statted each scan, so the new directory is found."""
    root = tmp_path / "run" / "out"
    write(root / "a.bin", 1)
    scanner = OutputScanner(str(root), watcher=watcher)
    assert scanner.scan(LATER).files == 1
    os.rename(tmp_path / "run", tmp_path / "run.old")
    write(root / "b.bin", 2)
    write(root / "c.bin", 3)
    assert same_totals(scanner.scan(LATER), root)
    write(root / "d.bin", 4)  # the new root is watched
    assert same_totals(scanner.scan(LATER), root)


def test_a_scan_after_the_tick_s_drain_takes_it_without_reading_again(
        tmp_path: Path, watcher: DirWatcher) -> None:
    """The tick drains the queue once before its readings (`DirWatcher.drain`); a job's
    scan right after takes what that drain read, not what came since: that is its next
    scan's, which reads the queue again (#15: a read of an empty queue per job); a final
    scan (the job has ended) reads it whatever the drain."""
    scanner = OutputScanner(str(tmp_path), "*.txt", watcher=watcher)
    assert scanner.scan(LATER).files == 0
    write(tmp_path / "a.txt", 1)
    watcher.drain()
    write(tmp_path / "b.txt", 2)  # after the drain
    assert (scanner.scan(LATER).files, scanner.scan(LATER).files) == (1, 2)
    write(tmp_path / "c.txt", 3)
    assert scanner.scan(LATER).files == 3  # no drain since: it reads the queue itself
    watcher.drain()
    write(tmp_path / "d.txt", 4)  # the job's last file, after the drain
    assert scanner.scan(LATER, final=True).files == 4  # a final scan reads the queue
