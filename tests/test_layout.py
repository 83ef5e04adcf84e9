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
