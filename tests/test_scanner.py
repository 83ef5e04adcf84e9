"""OutputScanner on real files: counts, bytes, temp files, and that cost follows change."""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from supervisor.runtime.outputs import OutputScanner
from supervisor.runtime.outputs_state import ScanResult
from supervisor.runtime.patterns import MAX_PATTERN_CHARS, GlobMatcher, check_pattern
from tests.helpers import LATER, make_shards, write


def wait_for_new_timestamp() -> None:
    """Let the clock leave the timestamp tick of the last change (coarse ctime)."""
    time.sleep(0.05)


def test_counts_and_bytes_of_nested_sharded_dirs(tmp_path: Path) -> None:
    total = make_shards(tmp_path / "out", dirs=4, per_dir=50)
    write(tmp_path / "out" / "rows_0-50" / "nested" / "deep" / "extra.safetensors", 100)
    result = OutputScanner(str(tmp_path / "out")).scan(LATER)
    assert isinstance(result, ScanResult)
    assert (result.files, result.bytes) == (201, total + 100)
    assert result.newest_mtime is not None and result.newest_mtime <= time.time() + 1


@pytest.mark.parametrize(
    ("pattern", "files"),
    [
        ("**/*.safetensors", 5),  # any depth, including the root
        ("rows_*/*.safetensors", 2),  # exactly one shard level
        ("*.bin", 1),  # the root only
        ("**/*", 8),  # the default: everything that is not temp
        ("rows_[0-4]*/item_?.safetensors", 2),
        ("rows_[!0]*/*", 1),
        ("**", 8),
        ("rows_0-2/**", 3),
        ("rows_0-2/**/*.safetensors", 2),
    ],
)
def test_patterns(tmp_path: Path, pattern: str, files: int) -> None:
    write(tmp_path / "top.safetensors", 1)
    write(tmp_path / "top.bin", 2)
    write(tmp_path / "rows_0-2" / "item_0.safetensors", 3)
    write(tmp_path / "rows_0-2" / "item_10.bin", 4)
    write(tmp_path / "rows_0-2" / "sub" / "item_1.safetensors", 5)
    write(tmp_path / "rows_2-4" / "item_2.safetensors", 6)
    write(tmp_path / "a" / "b" / "c" / "deep.safetensors", 7)
    write(tmp_path / "a" / "b" / "c" / "deep.bin", 8)
    assert OutputScanner(str(tmp_path), pattern).scan(LATER).files == files


def test_glob_matcher_directory_semantics() -> None:
    matcher = GlobMatcher("**/*.bin")
    assert matcher.matches("a.bin") and matcher.matches("x/y/a.bin")
    assert not matcher.matches("a.binx")
    star = GlobMatcher("*.bin")
    assert star.matches("a.bin") and not star.matches("x/a.bin")
    assert not star.may_descend("x")  # a fixed-depth pattern prunes the walk
    shards = GlobMatcher("rows_*/*.bin")
    assert shards.may_descend("rows_1") and not shards.may_descend("logs")
    assert not shards.may_descend("rows_1/sub")
    assert GlobMatcher("[!a]").matches("b") and not GlobMatcher("[!a]").matches("/")
    assert GlobMatcher("x[").matches("x[")  # an unclosed bracket is a literal
    with pytest.raises(ValueError):
        GlobMatcher("[z-a]")


def test_temp_files_and_dot_dirs_are_never_items(tmp_path: Path) -> None:
    write(tmp_path / "done.bin", 10)
    for name in ("x.tmp", ".x.tmp", ".hidden", "y.partial", "z.part", "w.incomplete"):
        write(tmp_path / name, 1000)
    write(tmp_path / ".staging" / "item.bin", 1000)
    write(tmp_path / "rows_0" / ".cache" / "deep" / "item.bin", 1000)
    result = OutputScanner(str(tmp_path)).scan(LATER)
    assert (result.files, result.bytes) == (1, 10)


def test_atomic_rename_from_temp_is_counted_next_scan(tmp_path: Path) -> None:
    scanner = OutputScanner(str(tmp_path), "**/*.safetensors")
    write(tmp_path / "rows_0" / "a.safetensors", 5)
    assert scanner.scan(LATER).files == 1
    wait_for_new_timestamp()
    write(tmp_path / "rows_0" / ".b.safetensors.tmp", 7)
    assert (scanner.scan(LATER).files, scanner.scan(LATER).bytes) == (1, 5)
    wait_for_new_timestamp()
    os.rename(tmp_path / "rows_0" / ".b.safetensors.tmp", tmp_path / "rows_0" / "b.safetensors")
    result = scanner.scan(LATER)
    assert (result.files, result.bytes) == (2, 12)


def test_atomic_replace_of_settled_file_is_seen(tmp_path: Path) -> None:
    scanner = OutputScanner(str(tmp_path))
    write(tmp_path / "a.bin", 5)
    assert scanner.scan(LATER).bytes == 5
    wait_for_new_timestamp()
    write(tmp_path / ".a.bin.tmp", 50)
    os.replace(tmp_path / ".a.bin.tmp", tmp_path / "a.bin")  # new inode, same name
    assert (scanner.scan(LATER).files, scanner.scan(LATER).bytes) == (1, 50)


def test_growing_file_is_tracked_until_it_settles(tmp_path: Path) -> None:
    scanner = OutputScanner(str(tmp_path), settle_s=10.0, dir_recheck_s=0.0,
                            active_recheck_s=2.0)
    path = tmp_path / "big.bin"
    write(path, 100)
    now = time.time()
    assert scanner.scan(now).bytes == 100
    with path.open("ab") as handle:  # in place: no directory change
        handle.write(b"y" * 900)
    early = scanner.scan(now + 1)  # new 1 s ago: statted again active_recheck_s after
    assert (early.bytes, early.files_statted, early.dirs_listed) == (100, 0, 0)
    grown = scanner.scan(now + 2.5)
    assert (grown.bytes, grown.files_statted, grown.dirs_listed) == (1000, 1, 0)
    with path.open("ab") as handle:
        handle.write(b"z" * 24)
    assert scanner.scan(now + 5).bytes == 1024  # it grew: again 2 s later
    # mtime old and size unchanged since the previous stat: settled, statted no more
    assert scanner.scan(now + 60).files_statted == 1
    assert scanner.scan(now + 61).files_statted == 0


def test_a_file_written_once_is_statted_a_few_times_not_every_scan(tmp_path: Path) -> None:
    """Write temp, rename: seen new, statted again `active_recheck_s` later (unchanged),
    then once when its mtime is `settle_s` old (settled): 3 stats over 15 scans a second
    apart, where statting every unsettled file each scan took 11."""
    scanner = OutputScanner(str(tmp_path), settle_s=10.0, dir_recheck_s=0.0,
                            active_recheck_s=2.0)
    write(tmp_path / "item.bin", 64)
    mtime = os.stat(tmp_path / "item.bin").st_mtime
    statted = [scanner.scan(mtime + 0.1 + second).files_statted for second in range(15)]
    assert sum(statted) == 3, statted
    assert statted[0] == 1 and statted[-1] == 0
    assert scanner.scan(mtime + 30).bytes == 64


def test_deleted_files_and_removed_dirs_are_reflected(tmp_path: Path) -> None:
    make_shards(tmp_path, dirs=3, per_dir=10)
    scanner = OutputScanner(str(tmp_path), "**/*.safetensors")
    first = scanner.scan(LATER)
    assert first.files == 30
    wait_for_new_timestamp()
    (tmp_path / "rows_0-10" / "item_3.safetensors").unlink()  # 3 bytes
    shutil.rmtree(tmp_path / "rows_10-20")
    result = scanner.scan(LATER)
    assert result.files == 19
    assert result.bytes == first.bytes - 3 - sum(index % 7 for index in range(10))
    shutil.rmtree(tmp_path / "rows_0-10")
    os.mkdir(tmp_path / "rows_0-10")  # re-created with the same name: a new inode
    assert scanner.scan(LATER).files == 10


def test_second_scan_without_changes_costs_no_listing_and_no_file_stat(tmp_path: Path) -> None:
    make_shards(tmp_path, dirs=10, per_dir=500)
    scanner = OutputScanner(str(tmp_path), "**/*.safetensors")
    first = scanner.scan(LATER)
    assert (first.files, first.dirs_listed, first.files_statted) == (5000, 11, 5000)
    second = scanner.scan(LATER)
    assert (second.files, second.bytes) == (first.files, first.bytes)
    assert (second.dirs_statted, second.dirs_listed, second.files_statted) == (11, 0, 0)

    wait_for_new_timestamp()
    write(tmp_path / "rows_1500-2000" / "item_new.safetensors", 9)
    third = scanner.scan(LATER)
    assert (third.files, third.bytes) == (5001, first.bytes + 9)
    assert (third.dirs_listed, third.files_statted) == (1, 1)  # just that directory
    assert scanner.scan(LATER).dirs_listed == 0


def test_recently_changed_directory_is_listed_once_more(tmp_path: Path) -> None:
    """Coarse timestamps: a change in the same tick as our listing must not be lost."""
    write(tmp_path / "a.bin", 1)
    scanner = OutputScanner(str(tmp_path), dir_recheck_s=2.0)
    now = time.time()
    assert scanner.scan(now).dirs_listed == 1
    assert scanner.scan(now + 0.5).dirs_listed == 1  # ctime within 2 s of now: again
    assert scanner.scan(now + 60).dirs_listed == 1
    assert scanner.scan(now + 61).dirs_listed == 0


def test_in_place_rewrites_are_the_documented_blind_spot(tmp_path: Path) -> None:
    write(tmp_path / "a.bin", 5)
    scanner = OutputScanner(str(tmp_path))
    scanner.scan(LATER)
    with (tmp_path / "a.bin").open("ab") as handle:
        handle.write(b"more")
    assert scanner.scan(LATER).bytes == 5  # missed by the incremental scan
    fresh = OutputScanner(str(tmp_path)).scan(LATER)  # a new scanner walks it all
    assert (fresh.bytes, fresh.dirs_listed, fresh.files_statted) == (9, 1, 1)


def test_missing_root_and_root_that_is_a_file(tmp_path: Path) -> None:
    scanner = OutputScanner(str(tmp_path / "not-yet"))
    assert scanner.scan(LATER) == ScanResult(0, 0, 1, 0, 0, None)
    write(tmp_path / "not-yet" / "x.bin", 3)
    assert scanner.scan(LATER).files == 1  # appears later: found
    shutil.rmtree(tmp_path / "not-yet")
    assert (scanner.scan(LATER).files, scanner.scan(LATER).bytes) == (0, 0)
    write(tmp_path / "file", 3)
    result = OutputScanner(str(tmp_path / "file")).scan(LATER)
    assert (result.files, result.bytes) == (0, 0)


def files_seen_unprivileged(root: Path) -> int:
    """Scan as an unprivileged user (a forked child drops root): root reads mode 000."""
    if os.geteuid() != 0:
        return OutputScanner(str(root)).scan(LATER).files
    child = os.fork()
    if child == 0:
        code = 255
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = OutputScanner(str(root)).scan(LATER).files
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def test_unreadable_directory_is_skipped() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tree:
        root = Path(tree)
        os.chmod(root, 0o755)
        write(root / "ok" / "a.bin", 1)
        write(root / "locked" / "b.bin", 1)
        os.chmod(root / "locked", 0)
        try:
            assert files_seen_unprivileged(root) == 1
        finally:
            os.chmod(root / "locked", 0o755)


def test_symlinked_directory_is_not_followed(tmp_path: Path) -> None:
    write(tmp_path / "out" / "a.bin", 1)
    os.symlink(tmp_path / "out", tmp_path / "out" / "loop")
    assert OutputScanner(str(tmp_path / "out")).scan(LATER).files == 1


# -- patterns: no backtracking, the same meaning as ever --------------------------------

@pytest.mark.parametrize(("pattern", "path", "expected"), [
    ("*a" * 8 + "c", "a" * 45 + "b", False),  # froze the daemon: 15.8 s with a regex
    ("*a" * 8 + "c", "a" * 45 + "c", True),
    ("*a" * 30 + "?c", "a" * 200 + "b", False),
    ("*[ab]" * 12 + "c", "ab" * 100, False),
    ("**/a" * 8 + "/b", "/".join(["a"] * 60 + ["c"]), False),  # the same across dirs
    ("**/a" * 8 + "/b", "/".join(["a"] * 60 + ["b"]), True),
    ("**/*a*a*a*a*a*a*a*a/**", "/".join(["a" * 40] * 20), True),
])
def test_many_stars_match_a_long_name_in_milliseconds(
        pattern: str, path: str, expected: bool) -> None:
    started = time.perf_counter()
    matcher = GlobMatcher(pattern)
    assert matcher.matches(path) is expected
    assert time.perf_counter() - started < 0.5


def test_glob_classes_and_edges_keep_their_meaning() -> None:
    cases = [
        ("[!-b]", {"a": True, "c": True, "-": False, "b": False}),  # "-" first: a literal
        ("[a-c-e]", {"b": True, "-": True, "e": True, "d": False}),  # after a range too
        ("[+--]", {"+": True, "-": True, ",": False}),  # "--": every "-" is a literal
        ("[]a]", {"]": True, "a": True, "b": False}),  # a leading "]" is a member
        ("[!]a]", {"]": False, "a": False, "b": True}),
        ("[^a]x", {"bx": True, "ax": False}),
        ("a**b", {"ab": True, "a-x-b": True, "a/b": False}),  # "**" inside: one "*"
        ("x[", {"x[": True, "x": False}),  # unclosed: a literal
        ("[a", {"[a": True, "a": False}),
        ("?", {"a": True, "ab": False, "": False}),
        ("a[+-0]b", {"a/b": False, "a.b": True}),  # no class ever matches "/"
        ("rows/**", {"rows": False, "rows/a": True, "rows/a/b": True}),  # one or more
        ("**/**/x", {"x": True, "a/x": True, "a/b/x": True}),
        ("a/**/b/**/c", {"a/b/c": True, "a/x/b/y/z/c": True, "a/c": False, "a/b/b": False}),
        ("**", {"a": True, "a/b/c": True}),
    ]
    for pattern, paths in cases:
        matcher = GlobMatcher(pattern)
        for path, expected in paths.items():
            assert matcher.matches(path) is expected, (pattern, path)


def test_check_pattern_says_what_is_wrong() -> None:
    for pattern, why in [("[z-a]", "the range z-a of a [...] class is reversed"),
                         ("", "empty"), ("/./", "empty"), ("a\x00", "NUL"),
                         ("x" * (MAX_PATTERN_CHARS + 1), "at most 1024")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            check_pattern(pattern)
        if pattern.strip("/."):  # GlobMatcher reads an empty pattern as the default
            with pytest.raises(ValueError, match="invalid glob pattern"):
                GlobMatcher(pattern)
    for pattern in ("**/*", "x[", "[!]", "*" * 1000, "rows_[0-9]*/item_?.bin", "a b/[--]"):
        check_pattern(pattern)
    assert GlobMatcher("").pattern == GlobMatcher("/").pattern == "**/*"


def _oracle(pattern: str) -> tuple[re.Pattern[str], list[re.Pattern[str]], bool]:
    """The regex translation the scanner used to compile patterns into (backtracking,
    so only fit for short patterns), as its docstrings describe it: with two slips
    mended, a class never matching "/" and a "-" first in "[!-...]" being a literal."""
    def component(part: str) -> str:
        out, i, n = [], 0, len(part)
        while i < n:
            char = part[i]
            i += 1
            if char == "*":
                while i < n and part[i] == "*":
                    i += 1
                out.append("[^/]*")
            elif char == "?":
                out.append("[^/]")
            elif char == "[":
                j = i + (1 if i < n and part[i] in "!^" else 0)
                j += 1 if j < n and part[j] == "]" else 0
                while j < n and part[j] != "]":
                    j += 1
                if j >= n:
                    out.append(re.escape(char))
                    continue
                body, i = part[i:j], j + 1
                negate = body[:1] in ("!", "^")
                body = body[1:] if negate else body
                if "--" in body:
                    members = "".join(c if c.isalnum() else "\\" + c for c in body)
                else:
                    members = "".join(c if c.isalnum() or c == "-" else "\\" + c for c in body)
                if members.startswith("-"):
                    members = "\\" + members
                out.append(("[^/" if negate else "(?!/)[") + members + "]")
            else:
                out.append(re.escape(char))
        return "".join(out)

    parts = [p for p in pattern.strip("/").split("/") if p not in ("", ".")] or ["**", "*"]
    regex = ""
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        if part == "**":
            regex += ".+" if last else "(?:[^/]+/)*"
        else:
            regex += component(part) + ("" if last else "/")
    fixed = parts[: parts.index("**")] if "**" in parts else parts
    return (re.compile(regex, re.DOTALL), [re.compile(component(p), re.DOTALL) for p in fixed],
            "**" in parts)


def test_glob_matcher_agrees_with_the_regex_it_replaced() -> None:
    """Random short patterns and paths (seeded): every match and every pruning decision
    is the one the old regex translation gives."""
    rng = random.Random(20240611)
    pattern_bits = ["a", "b", "-", "*", "**", "?", "[", "]", "!", "^", "/", "/**/", ".",
                    "z", "\\", "[!-", "[a-"]
    name_chars = "abcz-[]!^.\\"
    compared = 0
    for _ in range(3000):
        pattern = "".join(rng.choice(pattern_bits) for _ in range(rng.randint(0, 8)))
        try:
            full, fixed, globstar = _oracle(pattern)
        except re.error:
            with pytest.raises(ValueError):
                GlobMatcher(pattern)
            continue
        matcher = GlobMatcher(pattern)
        for _ in range(8):
            names = ["".join(rng.choice(name_chars) for _ in range(rng.randint(1, 4)))
                     for _ in range(rng.randint(1, 4))]
            path, directory = "/".join(names), names[:-1]
            assert matcher.matches(path) is (full.fullmatch(path) is not None), (
                pattern, path)
            descend = (globstar or len(directory) < len(fixed)) and all(
                r.fullmatch(p) is not None for r, p in zip(fixed, directory, strict=False))
            assert matcher.may_descend("/".join(directory)) is descend, (pattern, directory)
            compared += 1
    assert compared > 15_000


def test_incremental_totals_equal_a_fresh_scan_after_random_changes(tmp_path: Path) -> None:
    """Re-listings keep the totals by difference (files added, removed, replaced by a
    rename with another size, the newest one deleted): after each round of changes they
    equal what a new scanner finds by walking everything."""
    rng = random.Random(15)
    names = [f"item{i:04d}.bin" for i in range(300)]
    for name in names[:200]:
        write(tmp_path / name, rng.randint(1, 50))
    scanner = OutputScanner(str(tmp_path), "*.bin")
    scanner.scan(LATER)
    for _ in range(6):
        wait_for_new_timestamp()
        for name in rng.sample(names, 40):
            path = tmp_path / name
            action = rng.choice(["add", "delete", "replace"])
            if action == "delete":
                path.unlink(missing_ok=True)
            elif action == "replace" or path.exists():  # (an in-place rewrite of a
                write(tmp_path / f".{name}.tmp", rng.randint(1, 50))  # settled file is
                os.replace(tmp_path / f".{name}.tmp", path)  # a documented blind spot)
            else:
                write(path, rng.randint(51, 90))
        # about the names that changed are statted (40 of them), never all 200+
        assert scanner.scan(LATER, final=True).files_statted <= 60
        wait_for_new_timestamp()
        newest = tmp_path / "newest.bin"
        write(newest, 7)
        assert scanner.scan(LATER, final=True).newest_mtime == newest.stat().st_mtime_ns / 1e9
        newest.unlink()  # the newest file goes: the newest mtime must be found again
        got = scanner.scan(LATER, final=True)
        fresh = OutputScanner(str(tmp_path), "*.bin").scan(LATER, final=True)
        assert (got.files, got.bytes, got.newest_mtime) == (
            fresh.files, fresh.bytes, fresh.newest_mtime)
        assert got.files_statted == 0  # a name that went needs no stat; the others none
