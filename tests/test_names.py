"""Names have one address, in the module that owns them (#31): no private name is
imported from another module, no name is re-exported, a constant is defined once, and
the alert rules compare states as the enums they are. Read from the source (AST)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from supervisor.observe.readings import ObservedJob
from supervisor.spec import JobSpec

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "supervisor"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@functools.cache
def names_used_from_modules(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for each `from module import name` and `module.name` in
    `path`, where module is one of the supervisor's."""
    found, aliases = [], {}
    nodes = list(ast.walk(tree(path)))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:  # a module, imported by name
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module in MODULES:
                    found.append((node.lineno, node.module, alias.name))
        elif isinstance(node, ast.Import):
            aliases |= {alias.asname: alias.name for alias in node.names
                        if alias.asname and alias.name in MODULES}
    found += [(node.lineno, aliases[node.value.id], node.attr) for node in nodes
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in aliases]
    return found


@functools.cache
def imported_names(module: str) -> frozenset[str]:
    """The names `module` imports at its top from the supervisor's other modules."""
    return frozenset(alias.asname or alias.name for node in tree(MODULES[module]).body
                     if isinstance(node, ast.ImportFrom) and node.module in MODULES
                     for alias in node.names)


def test_no_private_name_is_used_outside_its_module() -> None:
    private = [f"{path.relative_to(REPO)}:{line} {module}.{name}"
               for path in MODULES.values()
               for line, module, name in names_used_from_modules(path)
               if name.startswith("_") and not name.startswith("__")
               and module != module_name(path)]
    assert private == []


EVERY_MODULE = sorted(module for module, path in MODULES.items() if path.name != "__init__.py")
"""Each module of the supervisor: none offers its neighbours' names as its own (#31 found
`notify`, `forecast`, `loop`, `observer`, `files`, `launcher`, `slurm`, `outputs` and
`recovery` doing it)."""


@pytest.mark.parametrize("module", EVERY_MODULE)
def test_no_name_is_imported_from_a_module_that_only_imports_it(module: str) -> None:
    readers = [*MODULES.values(), *sorted((REPO / "tests").glob("*.py")),
               *sorted((REPO / "bench").glob("*.py"))]
    second_addresses = [f"{path.relative_to(REPO)}:{line} {name}"
                        for path in readers
                        for line, used_from, name in names_used_from_modules(path)
                        if used_from == module and name in imported_names(module)]
    assert second_addresses == []


def test_the_log_tail_length_is_defined_once() -> None:
    defined_in = [module for module, path in MODULES.items() for node in tree(path).body
                  if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "LOG_TAIL_LINES"
                          for t in node.targets)]
    assert defined_in == ["supervisor.alerting.rules"]


def test_an_observed_job_takes_keywords_only() -> None:
    """Its pids and times are easily swapped by position (`-1, None, None`)."""
    spec = JobSpec(name="j", command=["true"])
    with pytest.raises(TypeError):
        ObservedJob("j", spec, 1, -1, None, None)  # type: ignore[misc]
    job = ObservedJob(job_id="j", spec=spec, attempt=1, root_pid=-1, root_create_time=None,
                      worker_pid=None)
    assert (job.root_pid, job.worker_pid, job.remote) == (-1, None, False)


def test_the_alert_rules_compare_states_as_enums() -> None:
    """`job.state == "running"` reads as a typo waiting to happen; `JobState.RUNNING`
    is checked by mypy and found by a rename."""
    def literal(node: ast.expr) -> bool:
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)
                or isinstance(node, ast.Tuple | ast.List | ast.Set)
                and any(literal(element) for element in node.elts))

    compared = [f"rules.py:{node.lineno}" for node in ast.walk(tree(
                    PACKAGE / "alerting" / "rules.py"))
                if isinstance(node, ast.Compare)
                and any(isinstance(side, ast.Attribute) and side.attr in ("state", "exit_reason")
                        for side in (node.left, *node.comparators))
                and any(literal(side) for side in (node.left, *node.comparators))]
    assert compared == []
