"""The package layout carries rules the code relies on, checked on the imports the
modules' source makes (their AST): `supervisor/runtime/`, the job side, imports the
standard library alone (the shim must start fast, in any Python environment, and outlive
the daemon); only the daemon's wiring imports the HTTP API; the workers never import the
supervisor; neither package has an import circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def imported_by(module: str) -> list[str]:
    code = (f"import json, sys; import {module}; "
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    return json.loads(result.stdout)


def test_the_shim_imports_only_the_standard_library_and_runtime() -> None:
    modules = imported_by("supervisor.runtime.shim")
    outside = [m for m in modules
               if m.split(".")[0] not in sys.stdlib_module_names
               and m.split(".")[0] not in ("supervisor", "_distutils_hack")
               and not m.startswith("_")]
    ours = [m for m in modules if m.startswith("supervisor.")]
    assert outside == []
    assert all(m == "supervisor.runtime" or m.startswith("supervisor.runtime.")
               for m in ours), ours


def catches_import_errors(node: ast.Try) -> bool:
    """The `try` has a handler for ImportError (or any Exception, or everything)."""
    return any(handler.type is None or any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
        for n in ast.walk(handler.type)) for handler in node.handlers)


def imports_in(node: ast.AST, guarded: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every `import` and `from ... import` below `node`, wherever it is (in a function,
    under `if TYPE_CHECKING:`), each with whether it is guarded: inside the body of a
    `try` that catches its ImportError (the module works without it)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, guarded
    elif isinstance(node, ast.Try):
        for child in node.body:
            yield from imports_in(child, guarded or catches_import_errors(node))
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            yield from imports_in(child, guarded)
        return
    for child in ast.iter_child_nodes(node):
        yield from imports_in(child, guarded)


def imports_of(root: Path) -> dict[str, dict[str, bool]]:
    """{module: {imported module: whether every import of it is guarded}} for every
    module under `root` (a package folder), read from the AST: imports inside functions
    and under `if TYPE_CHECKING:` count (a lazy or a typing import is still an arrow),
    and `from a import b` is an arrow to `a.b` when that is a module, else to `a`.
    Relative imports are resolved; names from outside are kept as written, so a check
    can see an import of another package."""
    modules = {}
    for source in sorted(root.rglob("*.py")):
        parts = source.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = source
    found_by: dict[str, dict[str, bool]] = {}
    for name, source in modules.items():
        here = name if source.name == "__init__.py" else name.rpartition(".")[0]
        found: dict[str, bool] = {}
        for node, guarded in imports_in(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            for imported in names:
                found[imported] = found.get(imported, True) and guarded
        found.pop(name, None)
        found_by[name] = found
    return found_by


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the modules it imports} for every module under `root` (`imports_of`)."""
    return {module: set(found) for module, found in imports_of(root).items()}


def import_circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among the modules of `arrows` (each found once, from the
    depth-first walk that closes it)."""
    circles, done, path = [], set(), []

    def walk(module: str) -> None:
        if module in path:
            circles.append([*path[path.index(module):], module])
            return
        if module in done:
            return
        path.append(module)
        for imported in sorted(arrows.get(module, set()) & arrows.keys()):
            walk(imported)
        path.pop()
        done.add(module)

    for module in sorted(arrows):
        walk(module)
    return circles


SUPERVISOR = imports_of(REPO / "supervisor")
RUNTIME = "supervisor.runtime"

OPTIONAL_OUTSIDE_IMPORTS = {"pynvml"}
"""What `runtime/` may import from outside the standard library, and only inside a `try`
that catches its ImportError: NVML's binding (`runtime/gpu.py`: no binding, no driver,
no GPU is a supported state, read as None)."""


def in_runtime(module: str) -> bool:
    return module == RUNTIME or module.startswith(RUNTIME + ".")


def test_runtime_imports_only_the_standard_library() -> None:
    """Every import in every module under `runtime/`, and in the `supervisor` package's
    own `__init__` (which the shim imports first), is of the standard library or of
    `runtime/`: the shim runs under `python -S` (no site-packages) in whatever Python
    environment the job has, and its publisher takes its readings with the same
    readers as the daemon."""
    checked = {module: found for module, found in SUPERVISOR.items()
               if module == "supervisor" or in_runtime(module)}
    assert {"supervisor.runtime.shim", "supervisor.runtime.sampler",
            "supervisor.runtime.patterns"} <= checked.keys()  # the walk found the package
    outside = {module: sorted(
        name for name, guarded in found.items()
        if name.split(".")[0] not in sys.stdlib_module_names and not in_runtime(name)
        and not (guarded and name in OPTIONAL_OUTSIDE_IMPORTS)) for module, found in
        checked.items()}
    assert {module: names for module, names in outside.items() if names} == {}


def test_the_import_walk_sees_lazy_typing_and_guarded_imports(tmp_path: Path) -> None:
    """The walk the checks rely on: an import in a function or under TYPE_CHECKING is
    found, a relative import resolved, and only a `try` catching ImportError guards."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import typed_only\n"
        "def f():\n    from . import b\n    import lazy\n"
        "try:\n    import optional\nexcept ImportError:\n    optional = None\n"
        "try:\n    import unguarded\nexcept KeyError:\n    pass\n")
    (package / "b.py").write_text("from .a import f\n")
    found = imports_of(package)
    assert found["pkg.a"] == {"typing": False, "typed_only": False, "pkg.b": False,
                              "lazy": False, "optional": True, "unguarded": False}
    assert found["pkg.b"] == {"pkg.a": False}
    assert import_circles(module_imports(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


API = "supervisor.api"
BELOW_THE_DAEMON = sorted({module.split(".")[1] for module in SUPERVISOR
                           if module.count(".") >= 1} - {"api", "daemon"})
"""The parts of `supervisor` by their first name below it (`alerting`, `spec`, ...):
all but the daemon, whose wiring serves the HTTP API, and the API itself."""


@pytest.mark.parametrize("part", BELOW_THE_DAEMON)
def test_nothing_below_the_daemon_imports_the_api(part: str) -> None:
    """The HTTP API is the daemon's outside: what the daemon is built from (the
    backends, the observer, the store, the alerting, the job side, the contract) and
    the CLI (which talks HTTP) never import `api/`, so none of them depends on the
    shapes of its answers. Only the daemon's wiring (`daemon/`) and `api/` itself do."""
    modules = {module: found for module, found in SUPERVISOR.items()
               if module.split(".")[1:2] == [part]}
    assert modules
    importers = {module: sorted(name for name in found if name == API
                                or name.startswith(API + "."))
                 for module, found in modules.items()}
    assert {module: names for module, names in importers.items() if names} == {}


def test_no_import_circle_inside_the_supervisor() -> None:
    circles = import_circles(module_imports(REPO / "supervisor"))
    assert circles == [], circles_text(circles)


WORKERS = module_imports(REPO / "workers")
STEPS = {"workers.generate", "workers.extract", "workers.vocab", "workers.train",
         "workers.evaluate", "workers.export"}
"""The steps' entry points (`python -m workers.<step>`): public names, kept at the top."""


def test_the_workers_do_not_import_the_supervisor() -> None:
    assert len(WORKERS) > 30  # the walk found the rooms, not only the top folder
    outside = {module: sorted(m for m in imported if m.split(".")[0] == "supervisor")
               for module, imported in WORKERS.items()}
    assert {module: names for module, names in outside.items() if names} == {}


def circles_text(circles: list[list[str]]) -> str:
    return "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


def test_no_import_circle_inside_the_workers() -> None:
    circles = import_circles(WORKERS)
    assert circles == [], circles_text(circles)
    # the walk sees circles: one made up here is found
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_workers_rooms() -> None:
    """The top of `workers/` holds the steps and what every worker shares; the library
    (`workers.eagle3`) never imports a step; the fixtures (tiny models, stub server,
    SmolLM2, demo prompts) are imported by the tests, the benchmarks and the demo, never
    by a step or the library."""
    top = {m for m in WORKERS if m.count(".") == 1}
    assert top == STEPS | {"workers.common", "workers.eagle3", "workers.fixtures"}
    library = {m for m in WORKERS if m.startswith("workers.eagle3")}
    assert {m: sorted(WORKERS[m] & STEPS) for m in library if WORKERS[m] & STEPS} == {}
    fixtures = {m for m in WORKERS if m.startswith("workers.fixtures")}
    users = {m: sorted(i for i in imported if i.startswith("workers.fixtures"))
             for m, imported in WORKERS.items() if m not in fixtures}
    assert {m: names for m, names in users.items() if names} == {}
    supervisor = module_imports(REPO / "supervisor")
    assert {m for m, imported in supervisor.items()
            if any(i.startswith("workers.fixtures") for i in imported)} == {
        "supervisor.client.demo"}


def test_every_supervisor_module_sits_in_a_package_with_a_docstring() -> None:
    top = {p.name for p in (REPO / "supervisor").glob("*.py")}
    # the public contract and the few things every process shares stay at the top
    assert top == {"__init__.py", "__main__.py", "spec.py", "pipeline.py", "errors.py",
                   "config.py", "clock.py", "formatting.py"}
    for init in (REPO / "supervisor").glob("*/__init__.py"):
        assert init.read_text().startswith('"""'), init


def test_paths_computed_from_module_files_point_at_the_checkout() -> None:
    """Modules moved into subpackages compute paths from `__file__`: the shim's
    PYTHONPATH must be the folder holding `supervisor/` (never `supervisor/` itself, whose
    subpackages `api`, `client`, ... would shadow a job's own modules), and the demo's
    prompts must exist."""
    from supervisor.backends.launch import package_root_on_path
    from supervisor.client.demo import DEMO_PROMPTS

    first = Path(package_root_on_path().split(":")[0])
    assert (first / "supervisor" / "__init__.py").is_file()
    assert first.resolve() == REPO.resolve()
    assert DEMO_PROMPTS.is_file()
