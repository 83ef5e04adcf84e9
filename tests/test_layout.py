"""The package layout carries rules the code relies on: the per-job shim imports the
standard library and `supervisor.runtime` alone (it must start fast, in any Python
environment, and outlive the daemon), and the workers never import the supervisor."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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


PUBLISHER_READERS = {"supervisor.observe", "supervisor.observe.sampler",
                     "supervisor.observe.gpu", "supervisor.observe.outputs",
                     "supervisor.observe.outputs_state", "supervisor.observe.patterns",
                     "supervisor.observe.dirwatch"}
"""The daemon's readers the shim's publisher imports when it takes its first reading
(`runtime/publish.py`): they must stay standard library only, like the shim."""


def test_the_publishing_shim_imports_only_the_standard_library_and_its_readers(
        tmp_path: Path) -> None:
    code = ("import json, os, sys\n"
            "from supervisor.runtime import files\n"
            "from supervisor.runtime.publish import Publisher\n"
            f"p = Publisher(__import__('pathlib').Path({str(tmp_path)!r}), files.Observe("
            f"interval_s=1, output_dir={str(tmp_path)!r}, pattern='*', gpu=True), "
            "shim_pid=os.getpid(), worker_pid=os.getpid(), cwd='/')\n"
            "assert p.publish(final=True)['error'] is None\n"
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    modules = json.loads(result.stdout)
    outside = [m for m in modules
               if m.split(".")[0] not in sys.stdlib_module_names
               and m.split(".")[0] not in ("supervisor", "_distutils_hack", "pynvml")
               and not m.startswith("_")]
    ours = {m for m in modules if m.startswith("supervisor.")}
    assert outside == []  # pynvml, imported where it is installed, is NVML's binding
    assert ours - PUBLISHER_READERS <= {m for m in ours if m.startswith("supervisor.runtime")}
    assert ours >= PUBLISHER_READERS  # the readers were imported: the list is not vacuous


def module_imports(root: Path) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports} for every module under `root`
    (a package folder), read from the AST: imports inside functions count (a
    lazy import is still an arrow), and `from a import b` is an arrow to `a.b` when
    that is a module, else to `a`. Names from outside are kept as written, so a
    check can see an import of another package."""
    modules = {}
    for source in sorted(root.rglob("*.py")):
        parts = source.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = source
    arrows: dict[str, set[str]] = {}
    for name, source in modules.items():
        here = name if source.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                              else base)
        arrows[name] = {m for m in found if m != name}
    return arrows


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


WORKERS = module_imports(REPO / "workers")
STEPS = {"workers.generate", "workers.extract", "workers.vocab", "workers.train",
         "workers.evaluate", "workers.export"}
"""The steps' entry points (`python -m workers.<step>`): public names, kept at the top."""


def test_the_workers_do_not_import_the_supervisor() -> None:
    assert len(WORKERS) > 30  # the walk found the rooms, not only the top folder
    outside = {module: sorted(m for m in imported if m.split(".")[0] == "supervisor")
               for module, imported in WORKERS.items()}
    assert {module: names for module, names in outside.items() if names} == {}


def test_no_import_circle_inside_the_workers() -> None:
    assert import_circles(WORKERS) == []
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
    from supervisor.client.demo import DEMO_PROMPTS
    from supervisor.runtime.launcher import package_root_on_path

    first = Path(package_root_on_path().split(":")[0])
    assert (first / "supervisor" / "__init__.py").is_file()
    assert first.resolve() == REPO.resolve()
    assert DEMO_PROMPTS.is_file()
