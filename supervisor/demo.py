"""`jobsup demo`: a daemon (started here unless one answers) and a demo job under it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console

from supervisor.client import Client
from supervisor.config import Settings
from supervisor.errors import JobsupError

DAEMON_START_TIMEOUT_S = 30.0


def daemon_answers(client: Client) -> bool:
    try:
        client.get("/healthz")
    except JobsupError:
        return False
    return True


def start_daemon(url: str, data_dir: Path) -> subprocess.Popen[bytes]:
    """A detached `jobsup serve` (its own session, log in the data dir)."""
    parsed = urlparse(url)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "daemon.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--host", parsed.hostname or
             "127.0.0.1", "--port", str(parsed.port or 8765), "--data-dir", str(data_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_demo(*, url: str, data_dir: Path | None, items: int, keep_daemon: bool,
             console: Console) -> int:
    settings = Settings(data_dir=data_dir) if data_dir else Settings()
    client = Client(url, token=settings.token)
    daemon = None
    if daemon_answers(client):
        console.print(f"using the jobsup daemon at {url}")
    else:
        console.print(f"starting a jobsup daemon at {url} (data dir {settings.data_dir})")
        daemon = start_daemon(url, settings.data_dir)
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while not daemon_answers(client):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise JobsupError(
                    f"the daemon did not start; see {settings.data_dir / 'daemon.log'}")
            time.sleep(0.2)

    out = settings.data_dir / "demo" / time.strftime("%Y%m%d-%H%M%S")
    job = client.post("/api/v1/jobs", json={
        "name": "demo-writer",
        "command": [sys.executable, "-m", "supervisor.demo_job", "--out", str(out),
                    "--items", str(items)],
        "cwd": str(Path(__file__).resolve().parent.parent),
        "output_dir": str(out), "pattern": "item-*.bin", "expected_items": items,
        "stall_timeout_s": 60, "labels": {"demo": "1"},
    })
    console.print(f"submitted job {job['id']} ({job['name']}): {items} items into {out}")
    while job["state"] in ("pending", "running"):
        time.sleep(0.5)
        job = client.get(f"/api/v1/jobs/{job['id']}")
        files = len(list(out.glob("item-*.bin"))) if out.is_dir() else 0
        console.print(f"  {job['state']:<9} {files}/{items} items", highlight=False)
    console.print(f"job {job['id']} {job['state']}: {job.get('reason') or ''}")
    console.print(f"\nAPI:     {url}/api/v1/jobs/{job['id']}\n"
                  f"logs:    jobsup logs {job['id']}\n"
                  f"history: jobsup show {job['id']}")
    if daemon is not None:
        if keep_daemon:
            console.print(f"the daemon keeps running (pid {daemon.pid}); "
                          f"stop it with: kill {daemon.pid}")
        else:
            daemon.terminate()
            daemon.wait(timeout=15)
    return 0 if job["state"] == "succeeded" else 1



