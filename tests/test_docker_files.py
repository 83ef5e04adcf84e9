"""docker/: every Dockerfile passes hadolint, compose.yaml validates against the Compose
Specification schema (the copy vendored in check-jsonschema: `vendor.compose-spec`), and
the files keep what #16 asked of them: pinned bases, constraints.txt in every pip
install, the NVIDIA request, a stop grace longer than the jobs', same-path bind mounts.
Both tools are real programs from the `dev` extra; each is shown a broken file too, so a
tool that checks nothing fails here. No Docker daemon is needed."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from supervisor.daemon.checks import STOP_BACKSTOP_S
from supervisor.daemon.loop import EXIT_STOP_MARGIN_S
from tests.helpers import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("**/Dockerfile*") if p.suffix != ".dockerignore")
COMPOSE = DOCKER / "compose.yaml"
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: it comes with the dev extra (pip install -e '.[dev]')")
    return str(path)


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    # the default failure threshold is `info`: any finding fails
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60)


def compose_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=60)


def stages(dockerfile: Path) -> dict[str, str]:
    """Stage name -> its text (from its FROM to the next)."""
    text = dockerfile.read_text()
    parts = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    out = {}
    for part in parts[1:]:
        match = re.match(r"FROM \S+ AS (\S+)", part)
        assert match, part.splitlines()[0]
        out[match.group(1)] = part
    return out


def arg_defaults(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), flags=re.MULTILINE))


def jobsup_service() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]["jobsup"]


def duration_s(value: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


def test_there_are_dockerfiles() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_is_clean(dockerfile: Path) -> None:
    result = hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\n"
                   "CMD jobsup serve\n")
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3025"):  # :latest, unpinned apt, shell-form CMD
        assert rule in result.stdout, result.stdout


def test_compose_matches_the_compose_spec() -> None:
    result = compose_check(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_spec_check_catches_a_bad_file(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    assert "capabilities: [gpu]" in text
    bad = tmp_path / "compose.yaml"
    bad.write_text(text.replace("capabilities: [gpu]", "capabilities: gpu")
                   .replace("stop_grace_period: 90s", "stop_grace_period: [90]"))
    result = compose_check(bad)
    assert result.returncode != 0, result.stdout
    assert "capabilities" in result.stdout + result.stderr


def test_base_images_are_pinned_by_tag_and_digest() -> None:
    dockerfile = DOCKER / "Dockerfile"
    args = arg_defaults(dockerfile)
    for name, text in stages(dockerfile).items():
        image = text.split()[1]
        image = args.get(image.strip("${}"), image)
        assert re.fullmatch(r"[\w./-]+:[\w.-]*\d[\w.-]*@sha256:[0-9a-f]{64}", image), \
            (name, image)
        assert ":latest" not in image
    assert set(stages(dockerfile)) == {"gpu", "daemon"}


def test_every_pip_install_uses_the_constraints() -> None:
    """Dependencies are installed with the constraints; the project itself after them
    with --no-deps (nothing left for it to resolve)."""
    text = (DOCKER / "Dockerfile").read_text()
    installs = re.findall(r"pip install[^\n]*", text)
    assert len(installs) == 4
    for line in installs:
        assert "-c /tmp/jobsup-deps/constraints.txt" in line \
            or line.strip() == "pip install --no-deps /tmp/jobsup-src \\", line


def test_a_source_edit_does_not_reinstall_the_dependencies() -> None:
    """In each stage the dependencies (torch's CUDA wheels: GBs) are installed from
    pyproject.toml and the constraints alone, before the source is copied in, so Docker's
    layer cache keeps them across source edits (#32 item 11: `COPY .` came first)."""
    text = (DOCKER / "Dockerfile").read_text()
    for name, body in stages(DOCKER / "Dockerfile").items():
        lines = [line.strip() for line in body.splitlines()]
        copies = [i for i, line in enumerate(lines) if line.startswith("COPY ")]
        deps = next(i for i, line in enumerate(lines) if "-r /tmp/jobsup-deps/requirements.txt"
                    in line)
        assert lines[copies[0]] == "COPY pyproject.toml constraints.txt /tmp/jobsup-deps/", name
        assert copies[0] < deps < copies[1] and lines[copies[1]] == "COPY . /tmp/jobsup-src", name
    script = re.search(r'ARG REQUIREMENTS="([^"]+)"', text)
    assert script is not None
    for extra in ("workers", "postgresql"):  # the script lists what pip would install
        listed = subprocess.run(
            [sys.executable, "-c", script[1].replace("/tmp/jobsup-deps/", f"{REPO}/"), extra],
            capture_output=True, text=True, check=True).stdout.split("\n")
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        wanted = project["dependencies"] + project["optional-dependencies"][extra]
        assert [line for line in listed if line] == wanted


def test_constraints_pin_every_runtime_worker_and_postgresql_dependency() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, line
            pins[canonicalize_name(name)] = version
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["workers"], *extras["postgresql"],
              "psycopg-binary"]  # psycopg[binary]'s wheel
    for requirement in map(Requirement, wanted):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            (name, str(requirement.specifier), pins[name])
    assert "psutil" not in {canonicalize_name(Requirement(r).name)
                            for r in project["dependencies"]}


def test_gpu_image_runs_the_workers_on_cuda() -> None:
    gpu = stages(DOCKER / "Dockerfile")["gpu"]
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in gpu
    assert re.search(r'"torch==\$\{TORCH_VERSION\}" -r /tmp/jobsup-deps/requirements.txt', gpu)
    assert '"$REQUIREMENTS" workers > /tmp/jobsup-deps/requirements.txt' in gpu
    args = arg_defaults(DOCKER / "Dockerfile")
    assert args["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/cu")
    torch_pin = next(line for line in (REPO / "constraints.txt").read_text().splitlines()
                     if line.startswith("torch=="))
    assert args["TORCH_VERSION"].split("+")[0] == torch_pin.split("==")[1]
    for text in stages(DOCKER / "Dockerfile").values():
        assert "JOBSUP_STOP_JOBS_ON_EXIT=1" in text


def test_compose_requests_gpus_and_outlasts_the_jobs_grace() -> None:
    service = jobsup_service()
    assert service["build"]["target"] == "gpu"
    assert service["init"] is True
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    env = service["environment"]
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["JOBSUP_STOP_JOBS_ON_EXIT"] == "1"
    needed_s = float(env["JOBSUP_STOP_GRACE_S"]) + STOP_BACKSTOP_S + EXIT_STOP_MARGIN_S
    assert duration_s(service["stop_grace_period"]) > needed_s


def test_compose_mounts_code_and_data_at_their_host_paths() -> None:
    mounts = [v for v in jobsup_service()["volumes"] if v.startswith("${")]
    assert len(mounts) == 2
    for mount in mounts:
        source, target = re.fullmatch(r"\$\{(\w+):\?[^}]*\}:\$\{(\w+)\}(?::ro)?", mount).groups()
        assert source == target, mount


def test_the_daemon_and_the_cli_run_without_psutil() -> None:
    """psutil left the runtime dependencies: nothing the daemon or the CLI loads imports it."""
    code = ("import sys; import supervisor.daemon.app, supervisor.client.cli, "
            "supervisor.runtime.shim; print('psutil' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation of one value (`$VAR`, `${VAR}`, `${VAR:-default}`,
    `${VAR-default}`, `${VAR:?error}`, `$$`), as `docker compose config` does it."""
    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        given = env.get(name)
        if op == ":-":
            return given if given else arg
        if op == "-":
            return given if given is not None else arg
        if op == ":?":
            assert given, f"compose would refuse: {arg}"
        return given or ""

    return re.sub(r"(?P<escaped>\$\$)|\$\{(?P<name>\w+)(?:(?P<op>:-|-|:\?)(?P<arg>[^}]*))?\}"
                  r"|\$(?P<bare>\w+)", one, value)


def daemon_settings(environment: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The daemon's Settings from the container's environment (JOBSUP_* only)."""
    from supervisor.config import Settings

    for name in [n for n in os.environ if n.startswith("JOBSUP_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        if name.startswith("JOBSUP_"):
            monkeypatch.setenv(name, value)
    return Settings()


@pytest.mark.parametrize("given", [
    {},
    {"JOBSUP_PUBLIC_URL": "https://jobs.example.org", "JOBSUP_HOSTNAME": "gpu-07",
     "JOBSUP_GRAFANA_URL": "https://grafana.example.org/d/jobsup/jobsup"}],
    ids=["defaults", "set"])
def test_compose_gives_the_daemon_links_a_browser_reaches_and_the_hosts_name(
        given: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """#32 item 6: compose left JOBSUP_PUBLIC_URL and JOBSUP_GRAFANA_URL unset (links to
    http://jobsup-docker:8765, a name nothing resolves) and JOBSUP_HOSTNAME the same on
    every machine. Now: URLs on the published ports by default (or the user's), and the
    host's own name (`uts: host`: the container's host name is the host's)."""
    service = jobsup_service()
    required = {"JOBSUP_TOKEN": "t" * 32, "JOBSUP_CODE_DIR": "/srv/code",
                "JOBSUP_WORK_DIR": "/srv/work"}
    environment = {name: interpolate(str(value), {**required, **given})
                   for name, value in service["environment"].items()}
    settings = daemon_settings(environment, monkeypatch)
    published = {port.split(":")[-1] for port in service["ports"]}
    assert published == {str(settings.port)}
    grafana_port = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]["ports"]
    assert [p.split(":", 1)[1] for p in grafana_port] == ["3000:3000"]

    assert service["uts"] == "host"
    if given:
        assert settings.resolved_public_url == given["JOBSUP_PUBLIC_URL"]
        assert settings.grafana_url == given["JOBSUP_GRAFANA_URL"]
        assert settings.resolved_hostname == "gpu-07"
    else:
        # the ports published on the host's loopback: a browser there (or through
        # `ssh -L`) opens them; the Host check admits `localhost`
        assert settings.resolved_public_url == "http://localhost:8765"
        assert settings.grafana_url == "http://localhost:3000/d/jobsup/jobsup"
        grafana_uid = json.loads((REPO / "dashboards/grafana/jobsup.json").read_text())["uid"]
        assert settings.grafana_url.split("/d/")[1].split("/")[0] == grafana_uid
        # under `uts: host` the daemon's gethostname() is the host's
        assert settings.resolved_hostname == socket.gethostname()
    assert "jobsup-docker" not in COMPOSE.read_text()
    from supervisor.api.guard import LOOPBACK_NAMES
    assert "localhost" in LOOPBACK_NAMES


def test_the_interpolation_helper_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}|${EMPTY:-d}|${UNSET:-d}|${EMPTY-d}|${UNSET-d}|$$SET|$SET",
                       env) == "x|d|d||d|$SET|x"
    with pytest.raises(AssertionError, match="need it"):
        interpolate("${UNSET:?need it}", env)
