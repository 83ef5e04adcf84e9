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
  has a different inode (the name was atomically replaced);
* directories that cannot hold a match (``rows_*/*.bin`` never needs ``logs/``) and
  dot-directories are never entered.

Known blind spots, by design (call :meth:`OutputScanner.rescan` rarely, e.g. every few
minutes or on demand, to correct them):

* a settled file rewritten or appended to in place, without a rename, is missed: nothing
  in its directory changes. So is a writer that pauses longer than ``settle_s`` between
  writes to the same file, and a file whose mtime lags ``now`` by more than ``settle_s``
  because the file server's clock is behind ours (NFS, Lustre);
* on filesystems with coarse timestamps two changes within one timestamp tick look like
  one. A directory whose ctime is within ``dir_recheck_s`` of ``now`` is therefore
  listed again on the next scan even if its ctime did not move; ``now`` must be the wall
  clock (``time.time()``) for that to hold.

Cost: O(directories) stats per scan, plus one listing per changed directory (O(entries)
in it) plus one stat per new or unsettled file. A huge flat directory (1M files in one
directory) is one stat per scan while idle, but every new file re-lists all of it; shard
outputs into directories of a few thousand files. Even the O(directories) stats could be
avoided with inotify/fanotify, which do not see writes made by other NFS/Lustre clients;
at ~7 us per directory (3-5 ms per scan for 1M files in 500 shards, against ~4 s for
``du``) it is not worth it below ~100k directories. Memory: ~220 bytes per matching file.
The first scan stats every file and costs about twice ``du`` (~9 s for 1M files).

Temp files are never items: names ending ``.tmp``, ``.partial``, ``.part`` or
``.incomplete``, dotfiles, and anything inside a dot-directory. Symlinked directories are
not followed (no cycles); symlinks to files count with the size of their target.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

TEMP_SUFFIXES: tuple[str, ...] = (".tmp", ".partial", ".part", ".incomplete")
"""Name endings of files a writer has not finished; never counted as items."""

DEFAULT_PATTERN = "**/*"
"""Pattern used when a job gives none: every non-temp file at any depth."""

MAX_PATTERN_CHARS = 1024
"""Longest item pattern a job may give (a real one is a few dozen characters)."""


@dataclass(frozen=True)
class _CharClass:
    """A bracket expression (``[abc]``, ``[a-z]``, ``[!a-z]``/``[^a-z]``); never ``/``."""

    negate: bool
    chars: frozenset[str]
    ranges: tuple[tuple[str, str], ...]

    def matches(self, char: str) -> bool:
        if char == "/":
            return False
        if char in self.chars:
            return not self.negate
        for low, high in self.ranges:
            if low <= char <= high:
                return not self.negate
        return self.negate


_ANY_CHAR = _CharClass(negate=True, chars=frozenset(), ranges=())
"""``?``: any one character but ``/``."""

_Token = str | _CharClass
"""One character of a glob: a literal character, or a class (``?`` is one too)."""



@dataclass(frozen=True)
class _Mixed:
    """Tokens between two ``*`` with a class among them: (offset, literal run or class)."""

    length: int
    parts: tuple[tuple[int, str | _CharClass], ...]

    def __len__(self) -> int:
        return self.length


_Piece = str | _Mixed
"""The tokens between two ``*``: plain text when all are literal (matched with the str
methods). Either way its length is the number of characters it matches."""


def _class_members(body: str) -> tuple[frozenset[str], tuple[tuple[str, str], ...]]:
    """The single characters and ``low-high`` ranges of a bracket expression's body.

    A ``-`` first or last is a literal, and so is one right after a range (``a-c-e`` is
    ``a-c``, ``-``, ``e``); with ``--`` anywhere in the body every ``-`` is a literal (the
    rules patterns have always been read with). A reversed range raises ValueError.
    """
    if "--" in body:
        return frozenset(body), ()
    chars: set[str] = set()
    ranges: list[tuple[str, str]] = []
    i, n = 0, len(body)
    while i < n:
        if i + 2 < n and body[i + 1] == "-":
            low, high = body[i], body[i + 2]
            if low > high:
                raise ValueError(f"the range {low}-{high} of a [...] class is reversed "
                                 f"(write {high}-{low})")
            ranges.append((low, high))
            i += 3
        else:
            chars.add(body[i])
            i += 1
    return frozenset(chars), tuple(ranges)


def _bracket(component: str, start: int) -> tuple[_CharClass, int] | None:
    """The class whose ``[`` is just before ``start``, and the index after its ``]``;
    None when no ``]`` closes it (the ``[`` is then a literal)."""
    n = len(component)
    j = start
    if j < n and component[j] in "!^":
        j += 1
    if j < n and component[j] == "]":  # a leading "]" is part of the class
        j += 1
    while j < n and component[j] != "]":
        j += 1
    if j >= n:
        return None
    body = component[start:j]
    negate = body[:1] in ("!", "^")
    chars, ranges = _class_members(body[1:] if negate else body)
    return _CharClass(negate, chars, ranges), j + 1


def _pieces(component: str) -> list[_Piece]:
    """One path component of a glob (no ``/``), split at its runs of ``*``.

    ``*`` matches any run of characters, ``?`` one character, ``[abc]``/``[a-z]`` a class
    and ``[!abc]``/``[^abc]`` its complement; none of them ever matches ``/``. An unclosed
    ``[`` is a literal. ``**`` inside a component (``a**b``) means the same as ``*``.
    One piece means no ``*``; ``*.bin`` gives ``["", ".bin"]``.
    """
    pieces: list[list[_Token]] = [[]]
    i, n = 0, len(component)
    while i < n:
        char = component[i]
        i += 1
        if char == "*":
            while i < n and component[i] == "*":
                i += 1
            pieces.append([])
        elif char == "?":
            pieces[-1].append(_ANY_CHAR)
        elif char == "[" and (bracket := _bracket(component, i)) is not None:
            token, i = bracket
            pieces[-1].append(token)
        else:
            pieces[-1].append(char)
    return [_plain(tokens) for tokens in pieces]


def _plain(tokens: list[_Token]) -> _Piece:
    """Plain text if every token is literal, else a `_Mixed` piece."""
    texts = [token for token in tokens if isinstance(token, str)]
    if len(texts) == len(tokens):
        return "".join(texts)
    parts: list[tuple[int, str | _CharClass]] = []
    for offset, token in enumerate(tokens):
        if isinstance(token, str) and parts and isinstance(parts[-1][1], str) \
                and parts[-1][0] + len(parts[-1][1]) == offset:
            parts[-1] = (parts[-1][0], parts[-1][1] + token)  # extend the literal run
        else:
            parts.append((offset, token))
    return _Mixed(len(tokens), tuple(parts))


def _piece_at(name: str, pos: int, piece: _Piece) -> bool:
    """Whether ``piece`` matches ``name`` at ``pos`` (which leaves room for it)."""
    if isinstance(piece, str):
        return name.startswith(piece, pos)
    for offset, part in piece.parts:
        if isinstance(part, str):
            if not name.startswith(part, pos + offset):
                return False
        elif not part.matches(name[pos + offset]):
            return False
    return True


def _find_piece(name: str, piece: _Piece, start: int, end: int) -> int:
    """The first position in ``name[start:end]`` where ``piece`` matches whole, or -1."""
    if isinstance(piece, str):
        return name.find(piece, start, end)
    for pos in range(start, end - len(piece) + 1):
        if _piece_at(name, pos, piece):
            return pos
    return -1


def _match_pieces(pieces: list[_Piece], name: str) -> bool:
    """Whether ``name`` matches a glob component split at its stars, without backtracking.

    Between two ``*`` a piece matches a fixed number of characters, so the pieces can be
    placed greedily: the first at the start, the last at the end, each one in between at
    its leftmost place after the previous one (a later place never leaves more room for
    the rest). That is O(len(name) * len(component)) at worst, whatever the stars.
    """
    first, last = pieces[0], pieces[-1]
    if len(pieces) == 1:  # no star
        return len(name) == len(first) and _piece_at(name, 0, first)
    start, end = len(first), len(name) - len(last)
    if end < start or not _piece_at(name, 0, first) or not _piece_at(name, end, last):
        return False
    for piece in pieces[1:-1]:
        found = _find_piece(name, piece, start, end)
        if found < 0:
            return False
        start = found + len(piece)
    return True


_NameMatch = Callable[[str], bool]
"""Whether one path component (a file or directory name) matches a glob component."""


def _compile_component(component: str) -> _NameMatch:
    """A matcher for one component of a glob: str methods for the usual shapes (``x``,
    ``*``, ``*.bin``, ``rows_*``, ``item_*.bin``), ``_match_pieces`` for the rest."""
    pieces = _pieces(component)
    texts = [piece for piece in pieces if isinstance(piece, str)]
    if len(texts) == len(pieces) == 1:
        return texts[0].__eq__
    if len(texts) == len(pieces) == 2:
        head, tail = texts
        if not head and not tail:
            return _any_name
        if not head:
            return lambda name: name.endswith(tail)
        if not tail:
            return lambda name: name.startswith(head)
        least = len(head) + len(tail)
        return lambda name: (len(name) >= least and name.startswith(head)
                             and name.endswith(tail))
    return functools.partial(_match_pieces, pieces)


def _any_name(_name: str) -> bool:
    return True


def _all_match(matchers: Sequence[_NameMatch], names: Sequence[str], start: int) -> bool:
    """Whether ``names[start:]`` begin with one name matching each of ``matchers``."""
    return all(matcher(names[start + k]) for k, matcher in enumerate(matchers))


def _components(pattern: str) -> list[str]:
    return [part for part in pattern.strip("/").split("/") if part not in ("", ".")]


def check_pattern(pattern: str) -> None:
    """Raise ValueError, saying what is wrong, unless ``pattern`` can be a job's item
    pattern: not empty, no NUL byte, at most ``MAX_PATTERN_CHARS`` characters, and no
    reversed range in a class (``[z-a]``). Any other string is a valid glob."""
    if "\x00" in pattern:
        raise ValueError("the pattern must not contain NUL bytes")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the pattern is {len(pattern)} characters long; at most "
                         f"{MAX_PATTERN_CHARS} are allowed")
    parts = _components(pattern)
    if not parts:
        raise ValueError(f"the pattern is empty; give a glob such as {DEFAULT_PATTERN!r} "
                         f"(the default)")
    for part in parts:
        _pieces(part)  # raises for a reversed range


class GlobMatcher:
    """A compiled glob over ``/``-separated paths relative to the output directory.

    ``**`` as a whole component matches zero or more directories (``**/*.bin`` matches
    ``a.bin`` and ``x/y/a.bin``); as the last component it matches everything below.

    No regex: each component is matched by ``_match_pieces`` (or a str method), and a
    path component by component with the same greedy placement, ``**`` playing the part
    of ``*`` between fixed runs of components. The cost is polynomial in the lengths of
    the path and the pattern, never exponential. Paths given to it are relative, with no
    empty component. Raises ValueError for an invalid pattern (``check_pattern``); an
    empty one means ``DEFAULT_PATTERN``.
    """

    def __init__(self, pattern: str) -> None:
        parts = _components(pattern)
        if not parts:
            parts = DEFAULT_PATTERN.split("/")
        else:
            try:
                check_pattern(pattern)
            except ValueError as error:
                raise ValueError(f"invalid glob pattern {pattern!r}: {error}") from error
        self.pattern = "/".join(parts)
        # runs of components between two "**"; a last "**" is one or more components
        # of any name: "?*" then "**"
        runs: list[list[_NameMatch]] = [[]]
        for index, part in enumerate(parts):
            if part != "**":
                runs[-1].append(_compile_component(part))
            elif index == len(parts) - 1:
                runs[-1].append(_compile_component("?*"))
                runs.append([])
            elif runs[-1] or len(runs) == 1:  # "**/**" is one "**"
                runs.append([])
        self._runs = [tuple(run) for run in runs]
        self._has_globstar = "**" in parts
        fixed = parts[: parts.index("**")] if self._has_globstar else parts
        self._fixed = [_compile_component(part) for part in fixed]
        self.matches: Callable[[str], bool] = self._matches
        """Whether a file at this relative path is an item."""
        self._last_directory: tuple[str | None, bool] = (None, False)
        if len(self._runs) == 1:
            self.matches = self._matches_fixed  # "rows_*/*.bin": no "**"
        elif len(self._runs) == 2 and not self._runs[0] and len(self._runs[1]) == 1:
            self.matches = self._matches_last  # "**/*.bin"

    def _matches(self, relative_path: str) -> bool:
        names = relative_path.split("/")
        runs = self._runs
        first, last = runs[0], runs[-1]
        if len(runs) == 1:  # no "**": one name per component
            return len(names) == len(first) and _all_match(first, names, 0)
        start, end = len(first), len(names) - len(last)
        if end < start or not _all_match(first, names, 0) or not _all_match(last, names, end):
            return False
        for run in runs[1:-1]:
            for pos in range(start, end - len(run) + 1):
                if _all_match(run, names, pos):
                    start = pos + len(run)
                    break
            else:
                return False
        return True

    def _matches_fixed(self, relative_path: str) -> bool:
        directory, _, name = relative_path.rpartition("/")
        if not self._fixed[-1](name):
            return False
        last_directory, last_result = self._last_directory  # the scan asks dir by dir
        if directory != last_directory:
            parents = directory.split("/") if directory else []
            last_result = len(parents) == len(self._fixed) - 1 and all(
                matcher(part) for matcher, part in zip(self._fixed, parents, strict=False))
            self._last_directory = (directory, last_result)  # one assignment: no torn pair
        return last_result

    def _matches_last(self, relative_path: str) -> bool:
        return self._runs[1][0](relative_path[relative_path.rfind("/") + 1:])

    def may_descend(self, relative_dir: str) -> bool:
        """Whether a file below this relative directory could match: prunes the walk."""
        dir_parts = relative_dir.split("/") if relative_dir else []
        if not self._has_globstar and len(dir_parts) >= len(self._fixed):
            return False  # the pattern's depth is fixed and this directory is too deep
        return all(matcher(part) for matcher, part in zip(self._fixed, dir_parts, strict=False))


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


_FileState = tuple[int, int, int]
"""(size in bytes, mtime_ns, inode) of one matching file. A plain tuple of ints, not an
object: less memory (~220 bytes per file in all), and the garbage collector stops tracking
it, where a full collection over 1M tracked objects would cost ~0.2 s in the daemon."""


@dataclass
class _DirState:
    inode: int
    ctime_ns: int
    recheck: bool  # list again next scan even if the ctime did not move
    subdirs: dict[str, str] = field(default_factory=dict)  # name -> path relative to root
    files: dict[str, _FileState] = field(default_factory=dict)  # matching files by name
    unsettled: set[str] = field(default_factory=set)  # names to stat again next scan
    bytes_total: int = 0  # sum of the sizes in files, in bytes
    newest_mtime_ns: int | None = None

    def refresh_totals(self) -> None:
        self.bytes_total = sum(entry[0] for entry in self.files.values())
        self.newest_mtime_ns = max((entry[1] for entry in self.files.values()), default=None)


@dataclass
class _Cost:
    dirs_statted: int = 0
    dirs_listed: int = 0
    files_statted: int = 0


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
    ) -> None:
        """``settle_s``: a file whose mtime is older than this, and whose size and mtime
        did not change since the previous stat, is settled and not statted again.
        ``dir_recheck_s``: a directory changed less than this before ``now`` is listed
        again next scan, to cover coarse timestamps (see the module docstring)."""
        self.root = root
        self._root_prefix = root.rstrip("/") + "/"
        self.matcher = GlobMatcher(pattern)
        self.settle_s = settle_s
        self.dir_recheck_s = dir_recheck_s
        self._dirs: dict[str, _DirState] = {}  # by path relative to root, "" for the root

    def scan(self, now: float) -> ScanResult:
        """Bring the state up to date with the disk and return the totals.

        Never raises for a missing root, a root that is a file, a directory or file that
        vanishes mid-scan, or an unreadable directory (skipped, logged at debug level).
        """
        cost = _Cost()
        listed: set[str] = set()
        pending = [""]
        while pending:
            relative_dir = pending.pop()
            state = self._visit(relative_dir, now, cost, listed)
            if state is not None:
                pending.extend(state.subdirs.values())
        for relative_dir, state in self._dirs.items():
            if state.unsettled and relative_dir not in listed:
                self._restat_unsettled(relative_dir, state, now, cost)
        return self._result(cost)

    def rescan(self, now: float) -> ScanResult:
        """Forget all state and walk the whole tree again, statting every file.

        Corrects the blind spots of :meth:`scan`; costs as much as ``du``, use it rarely.
        """
        self._dirs.clear()
        return self.scan(now)

    def _path(self, relative_path: str) -> str:
        return self._root_prefix + relative_path if relative_path else self.root

    def _visit(
        self, relative_dir: str, now: float, cost: _Cost, listed: set[str]
    ) -> _DirState | None:
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
        old: _DirState | None,
        now: float,
        cost: _Cost,
    ) -> _DirState:
        """List a directory, keeping what is known of entries that did not change."""
        cost.dirs_listed += 1
        recent_ns = int((now - self.dir_recheck_s) * 1e9)
        state = _DirState(
            inode=dir_stat.st_ino,
            ctime_ns=dir_stat.st_ctime_ns,
            recheck=dir_stat.st_ctime_ns >= recent_ns,
        )
        old_files = old.files if old is not None else {}
        old_unsettled = old.unsettled if old is not None else set()
        path = self._path(relative_dir)
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    known = old_files.get(entry.name)
                    if (
                        known is not None
                        and entry.name not in old_unsettled
                        and entry.inode() == known[2]
                    ):
                        state.files[entry.name] = known  # settled, not replaced: no stat
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
        known: _FileState | None,
        state: _DirState,
        now: float,
        cost: _Cost,
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
        known: _FileState | None,
        state: _DirState,
        now: float,
        cost: _Cost,
    ) -> None:
        """Stat one file into ``state``; drops it if it is gone."""
        cost.files_statted += 1
        try:
            file_stat = os.stat(path)
        except OSError:  # deleted between listing and stat: not an item any more
            state.files.pop(name, None)
            state.unsettled.discard(name)
            return
        if not stat.S_ISREG(file_stat.st_mode):
            state.files.pop(name, None)
            state.unsettled.discard(name)
            return
        current = (file_stat.st_size, file_stat.st_mtime_ns, file_stat.st_ino)
        changed = known is not None and known[:2] != current[:2]  # size or mtime moved
        settled = not changed and file_stat.st_mtime_ns <= int((now - self.settle_s) * 1e9)
        state.files[name] = current
        if settled:
            state.unsettled.discard(name)
        else:
            state.unsettled.add(name)

    def _restat_unsettled(
        self, relative_dir: str, state: _DirState, now: float, cost: _Cost
    ) -> None:
        for name in sorted(state.unsettled):
            known = state.files.get(name)
            path = self._path(_join(relative_dir, name))
            self._stat_file(path, name, known, state, now, cost)
        state.refresh_totals()

    def _forget(self, relative_dir: str) -> None:
        """Drop a directory and everything known below it."""
        state = self._dirs.pop(relative_dir, None)
        if state is not None:
            self._forget_all(state.subdirs.values())

    def _forget_all(self, relative_dirs: Iterable[str]) -> None:
        for relative_dir in list(relative_dirs):
            self._forget(relative_dir)

    def _result(self, cost: _Cost) -> ScanResult:
        states = self._dirs.values()
        newest_ns = max(
            (state.newest_mtime_ns for state in states if state.newest_mtime_ns is not None),
            default=None,
        )
        return ScanResult(
            files=sum(len(state.files) for state in states),
            bytes=sum(state.bytes_total for state in states),
            dirs_statted=cost.dirs_statted,
            dirs_listed=cost.dirs_listed,
            files_statted=cost.files_statted,
            newest_mtime=newest_ns / 1e9 if newest_ns is not None else None,
        )
