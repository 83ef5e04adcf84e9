"""Item patterns (`JobSpec.pattern`): glob patterns over paths relative to a job's output
directory, with `*`, `?`, `[...]` classes and `**` for any depth, matched without regexes
in time polynomial in the lengths (a pattern with many `*` against a long name cannot
freeze the daemon), and checked when a job is submitted (`check_pattern`: an invalid one
is refused naming the field). Used by the output scanner (runtime/outputs.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
