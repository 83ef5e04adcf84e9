"""`jobsup` in a shell: completion in a real bash (and the zsh/fish protocol), and the
live table `jobsup watch` on a real terminal (tmux) at 80 and 200 columns."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.client.tui import NARROW_COLUMNS
from tests.helpers import REPO, Daemon, wait_for
from tests.test_cli import jobsup

pytestmark = pytest.mark.slow

WATCHED_NAME = "tokenize-the-whole-corpus-for-the-draft-model-" + "y" * 14
"""A name longer than an 80-column terminal can show beside the other columns."""


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `jobsup` on PATH running this checkout (what the completion scripts call)."""
    path = tmp_path_factory.mktemp("bin")
    exe = path / "jobsup"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m supervisor \"$@\"\n")
    exe.chmod(0o755)
    return path


def shell_env(bin_dir: Path, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()  # COLUMNS would override a terminal's size
           if not k.startswith("JOBSUP_") and k not in ("COLUMNS", "LINES")}
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
    env["JOBSUP_URL"] = url
    return env


def bash_complete(bin_dir: Path, url: str, *words: str) -> list[str]:
    """What bash offers for the last of `words`, through the printed script."""
    quoted = " ".join(f"'{w}'" for w in ("jobsup", *words))
    script = (f"source <(jobsup completion bash) || exit 9\n"
              f"COMP_WORDS=({quoted}); COMP_CWORD={len(words)}\n"
              f"_jobsup_completion jobsup\n"
              f"printf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    result = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], text=True,
                            capture_output=True, env=shell_env(bin_dir, url), timeout=60)
    assert result.returncode == 0, result
    return [line for line in result.stdout.splitlines() if line]


def test_bash_completion(shared: Daemon, bin_dir: Path) -> None:
    job = shared.submit(["true"], name="completed")
    assert bash_complete(bin_dir, shared.url, "re") == ["restart"]
    assert set(bash_complete(bin_dir, shared.url, "")) >= {
        "submit", "ls", "show", "logs", "stop", "restart", "wait", "watch", "alerts",
        "completion"}
    assert bash_complete(bin_dir, shared.url, "ls", "--state", "r") == ["running"]
    assert bash_complete(bin_dir, shared.url, "submit", "--restart", "") == [
        "never", "on-failure"]
    assert bash_complete(bin_dir, shared.url, "completion", "") == ["bash", "zsh", "fish"]
    assert {"--json", "--quiet", "--label", "--state"} <= set(
        bash_complete(bin_dir, shared.url, "ls", "--"))
    assert "--attempt" in bash_complete(bin_dir, shared.url, "logs", "--a")
    assert bash_complete(bin_dir, shared.url, "show", job["id"][:6]) == [job["id"]]
    assert job["id"] in bash_complete(bin_dir, shared.url, "wait", "x", "")
    # no daemon at the URL: no ids, no error, no wait
    assert bash_complete(bin_dir, "http://127.0.0.1:9", "show", "") == []


@pytest.mark.parametrize(("shell", "marker"), [("zsh", "compdef _jobsup_completion jobsup"),
                                                ("fish", "complete --command jobsup")])
def test_zsh_and_fish_scripts_and_protocol(shared: Daemon, bin_dir: Path, shell: str,
                                           marker: str) -> None:
    printed = jobsup("completion", shell, url=None)
    assert printed.returncode == 0 and marker in printed.stdout
    env = {**shell_env(bin_dir, shared.url), "_JOBSUP_COMPLETE": f"complete_{shell}",
           "_TYPER_COMPLETE_ARGS": "jobsup ls --state su",
           "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
    answer = subprocess.run(["jobsup"], text=True, capture_output=True, env=env, timeout=60)
    assert answer.returncode == 0, answer
    assert "succeeded" in answer.stdout and "running" not in answer.stdout
    binary = shutil.which(shell)
    if binary:  # the shell's own syntax check, where the shell is installed
        checked = subprocess.run([binary, "-n"], input=printed.stdout, text=True,
                                 capture_output=True, timeout=30)
        assert checked.returncode == 0, checked


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Callable[[str], list[str]]]:
    """tmux servers on sockets of their own (one per terminal size: a server's later
    sessions take its first one's size), without the user's configuration."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed: ./dev.sh test installs it (system_packages)")
    servers: list[list[str]] = []

    def server(name: str) -> list[str]:
        servers.append(["tmux", "-S", str(tmp_path / f"{name}.sock"), "-f", "/dev/null"])
        return servers[-1]

    try:
        yield server
    finally:
        for base in servers:
            subprocess.run([*base, "kill-server"], capture_output=True, timeout=10)


ID_ROW = re.compile(r"^ ?[0-9a-f]{8}  ")


def test_watch_on_a_real_terminal(make_daemon, bin_dir: Path,
                                  tmux: Callable[[str], list[str]]) -> None:
    daemon: Daemon = make_daemon()
    ticker = daemon.submit([sys.executable, str(REPO / "tests" / "jobs" / "progress_ticker.py")],
                           name=WATCHED_NAME)
    short = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"], name="nap")
    daemon.wait_state(ticker["id"], "running")
    daemon.wait_state(short["id"], "running")  # its row is asserted below
    env = shell_env(bin_dir, daemon.url)
    for width, header in ((80, NARROW_COLUMNS),
                          (200, ("ID", "NAME", "STATE", "PROGRESS", "RATE", "ETA", "WRITTEN",
                                 "CPU", "RSS", "GPU", "ALERTS"))):
        session = f"watch{width}"
        server = tmux(session)
        command = shlex.join(["env", f"PYTHONPATH={env['PYTHONPATH']}",
                              f"JOBSUP_URL={daemon.url}", sys.executable, "-m", "supervisor",
                              "watch", "--interval", "0.3"])
        subprocess.run([*server, "new-session", "-d", "-s", session, "-x", str(width), "-y", "30",
                        command], check=True, timeout=30, env=env)

        def screen(session: str = session, server: list[str] = server) -> list[str]:
            shown = subprocess.run([*server, "capture-pane", "-p", "-t", session],
                                   text=True, capture_output=True, timeout=10).stdout
            return [line for line in shown.splitlines() if line.strip()]

        def ticker_rated(lines: list[str]) -> bool:
            """The ticker's row with its count and a rate: a rate is read from two steps
            of progress after the daemon's first reading (`HistoryBuilder`), so it can
            reach the screen a tick or two after the count does."""
            row = next((line for line in lines if line.lstrip().startswith(ticker["id"])), "")
            return bool(re.search(r"\d+/1000000", row) and re.search(r"\d+\.\d\d/s", row))

        try:
            lines = wait_for(lambda: (s := screen()) and len(s) >= 3 and ticker_rated(s) and s,
                             60, interval=0.3,
                             what=f"the live table at {width} columns, with the rate")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the screen:\n" + "\n".join(screen())) from None
        assert lines[0].split() == list(header), lines
        # the disk runway: a line under the table, not a column repeated on each row
        disk = [line for line in lines if line.startswith("disk: ")]
        assert len(disk) <= 1 and all("free" in line for line in disk), lines
        lines = [line for line in lines if not line.startswith("disk: ")]
        assert len(lines) == 3, lines  # the header and one line per job: nothing folded
        assert all(len(line) <= width for line in lines)
        rows = {line.split()[0]: line for line in lines[1:]}
        assert set(rows) == {ticker["id"], short["id"]} and all(ID_ROW.match(r) for r in lines[1:])
        row = rows[ticker["id"]]
        name_cell = row.split()[1]
        assert WATCHED_NAME.startswith(name_cell.rstrip("…")) and len(name_cell) >= 8
        assert (name_cell == WATCHED_NAME) == (width == 200)
        assert "running" in row and re.search(r"\d+/1000000", row), row
        assert re.search(r"\d+\.\d\d/s", row), row  # the rate column
        if width == 200:
            assert re.search(r"\d+/1000000 \(0%\)", row) and "free" not in row, row
        assert "nap" in rows[short["id"]] and "running" in rows[short["id"]]
