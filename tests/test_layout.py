"""The package layout carries rules the code relies on: the per-job shim imports the
standard library and `supervisor.runtime` alone (it must start fast, in any Python
environment, and outlive the daemon), and the workers never import the supervisor."""

from __future__ import annotations

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


def test_the_workers_do_not_import_the_supervisor() -> None:
    sources = sorted((REPO / "workers").glob("*.py"))
    assert sources
    for source in sources:
        text = source.read_text()
        assert "import supervisor" not in text and "from supervisor" not in text, source


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
    from supervisor.runtime.launcher import _package_root_on_path

    first = Path(_package_root_on_path().split(":")[0])
    assert (first / "supervisor" / "__init__.py").is_file()
    assert first.resolve() == REPO.resolve()
    assert DEMO_PROMPTS.is_file()
