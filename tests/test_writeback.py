"""Writeback of the extraction worker's files (workers/eagle3/extraction/hidden_files.py
`Writeback`): the CLI's default is steady and recorded, the modes write the same bytes, "fsync" and
"range" leave the page cache without the written pages (mincore on the file itself),
writeback errors are DiskFull, and a resume does not count a file cut short."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import make_conversations, make_model, worker_env
from workers.eagle3.extraction import hidden_files
from workers.eagle3.extraction.hidden_files import (
    DEFAULT_WRITEBACK,
    WRITEBACK_MODES,
    DiskFull,
    Writeback,
    existing_indexes,
    restore_manifest,
    safetensors_parts,
    sample_path,
    write_atomically,
)
from workers.extract import parse_args

REPO = Path(__file__).resolve().parent.parent
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def cached_fraction(path: Path) -> float:
    """The share of the file's pages in the page cache: mincore(2) on a mapping of it
    (mapping faults nothing in)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        address = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if LIBC.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            LIBC.munmap(address, size)
    return sum(v & 1 for v in vector) / pages


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """tmp_path, when it is on a disk: tmpfs keeps every page in memory by design."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}: no page cache to leave")
    return tmp_path


def sample_parts(seq_len: int = 64, hidden: int = 64, seed: int = 0) -> list[memoryview]:
    generator = torch.Generator().manual_seed(seed)
    return safetensors_parts({
        "aux_hidden_states": torch.randn(seq_len, 3 * hidden, generator=generator),
        "hidden_state": torch.randn(seq_len, hidden, generator=generator),
        "input_ids": torch.arange(seq_len, dtype=torch.int64),
        "loss_mask": torch.ones(seq_len, dtype=torch.uint8)}, {"id": f"s{seed}"})


# -- the command line ---------------------------------------------------------------------

REQUIRED = ["--model", "m", "--data", "d.jsonl", "--out", "o", "--device", "cpu"]


def test_default_writeback_is_steady_and_the_fsync_flags_map_to_modes() -> None:
    assert DEFAULT_WRITEBACK in WRITEBACK_MODES and DEFAULT_WRITEBACK != "none"
    assert parse_args(REQUIRED).writeback == DEFAULT_WRITEBACK
    assert parse_args([*REQUIRED, "--no-fsync"]).writeback == "none"
    assert parse_args([*REQUIRED, "--fsync"]).writeback == "fsync"
    for mode in WRITEBACK_MODES:
        assert parse_args([*REQUIRED, "--writeback", mode]).writeback == mode
    with pytest.raises(SystemExit):
        parse_args([*REQUIRED, "--fsync", "--no-fsync"])
    with pytest.raises(SystemExit):
        parse_args([*REQUIRED, "--writeback", "sometimes"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("flags, mode", [([], DEFAULT_WRITEBACK),
                                         (["--writeback", "range"], "range")])
def test_the_worker_records_its_mode_and_leaves_the_page_cache(
        tiny: Path, disk_dir: Path, flags: list[str], mode: str) -> None:
    """End to end: the mode reaches the Extractor, which finishes it (a "range" run
    keeps its last files in flight until the end) and records it in the config.
    (test_fsync_and_range_drop_the_written_pages shows mincore sees cached pages on
    this filesystem.)"""
    data = make_conversations(disk_dir / "conv.jsonl")
    out = disk_dir / "out"
    result = subprocess.run([sys.executable, "-m", "workers.extract", "--model", str(tiny),
                             "--data", str(data), "--out", str(out), "--limit", "12",
                             "--device", "cpu", "--writers", "2", *flags],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "extract_config.json").read_text())["writeback"] == mode
    files = sorted(out.glob("rows_*/*.safetensors"))
    assert len(files) == 12
    assert [cached_fraction(path) for path in files] == [0] * 12


# -- the writer ---------------------------------------------------------------------------

def test_every_mode_writes_the_same_whole_file(tmp_path: Path) -> None:
    parts = sample_parts()
    expected = b"".join(parts)
    for mode in WRITEBACK_MODES:
        policy = Writeback(mode)
        path = sample_path(tmp_path / mode, 7)
        write_atomically(path, parts, writeback=policy)
        policy.close()
        assert path.read_bytes() == expected, mode
        assert load_file(path)["input_ids"].tolist() == list(range(64))
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file


def test_fsync_and_range_drop_the_written_pages(disk_dir: Path) -> None:
    parts = [memoryview(os.urandom(16 << 20))]
    fractions = {}
    for mode in WRITEBACK_MODES:
        policy = Writeback(mode)
        path = disk_dir / mode / "big.safetensors"
        write_atomically(path, parts, writeback=policy)
        policy.close()
        fractions[mode] = cached_fraction(path)
    assert fractions["none"] > 0.9, fractions  # mincore sees cached pages here
    assert fractions["fsync"] < 0.05 and fractions["range"] < 0.05, fractions


def test_range_waits_for_older_files_only(disk_dir: Path) -> None:
    """With 2 files in flight, writing a 4th finishes the 1st and 2nd (their pages
    leave the cache); the newest two stay in flight until close()."""
    policy = Writeback("range", in_flight_files=2)
    paths = [disk_dir / f"{i}.safetensors" for i in range(4)]
    for path in paths:
        write_atomically(path, [memoryview(os.urandom(4 << 20))], writeback=policy)
    assert [cached_fraction(p) < 0.05 for p in paths] == [True, True, False, False]
    policy.close()
    assert all(cached_fraction(p) < 0.05 for p in paths)


def test_a_full_disk_in_fsync_is_disk_full(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    path = tmp_path / "rows_0-2000" / "00000000.safetensors"
    with pytest.raises(DiskFull):
        write_atomically(path, sample_parts(), writeback=Writeback("fsync"))
    assert list(path.parent.iterdir()) == []  # neither the file nor its temp file


def test_a_failed_range_writeback_is_disk_full_and_its_file_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait for an older file fails: that file is removed (a resume writes it
    again), DiskFull is raised, and no file descriptor is left open."""
    real = hidden_files.sync_file_range

    def fail_on_wait(fd: int, flags: int) -> None:
        if flags & 4:  # SYNC_FILE_RANGE_WAIT_AFTER
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, flags)

    monkeypatch.setattr(hidden_files, "sync_file_range", fail_on_wait)
    fds_before = len(os.listdir("/proc/self/fd"))
    policy = Writeback("range", in_flight_files=1)
    first, second = tmp_path / "0.safetensors", tmp_path / "1.safetensors"
    write_atomically(first, sample_parts(), writeback=policy)
    with pytest.raises(DiskFull, match="0.safetensors"):
        write_atomically(second, sample_parts(), writeback=policy)
    assert not first.exists() and second.exists()
    with pytest.raises(DiskFull, match="1.safetensors"):
        policy.close()
    assert not second.exists()
    assert len(os.listdir("/proc/self/fd")) == fds_before


def test_range_falls_back_to_fsync_without_sync_file_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hidden_files, "_libc_sync_file_range", lambda: None)
    assert Writeback("range").mode == "fsync"
    assert Writeback("none").mode == "none"
    with pytest.raises(ValueError):
        Writeback("sometimes")


# -- resume ---------------------------------------------------------------------------------

def test_a_file_cut_short_is_not_done(tmp_path: Path) -> None:
    """After a power loss without fsync a final name can hold a short file (its rename
    reached the disk, its data did not): the resume writes it again."""
    policy = Writeback("none")
    for index in range(4):
        write_atomically(sample_path(tmp_path, index), sample_parts(seed=index),
                         writeback=policy)
    whole = sample_path(tmp_path, 0).stat().st_size
    os.truncate(sample_path(tmp_path, 1), whole - 1)
    os.truncate(sample_path(tmp_path, 2), 0)
    with open(sample_path(tmp_path, 3), "ab") as f:  # longer than its header says
        f.write(b"\0")
    assert existing_indexes(tmp_path) == {0}
    assert restore_manifest(tmp_path) == {0}  # reads no short file's tensors
    manifest = (tmp_path / "manifest.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in manifest] == [0]
