"""`jobsup demo`: the EAGLE-3 pipeline on a tiny local model under the daemon.

Starts a daemon unless one answers at the URL, builds a tiny random Llama (no download)
once, submits the five steps (generation with the transformers backend on the prompts
shipped in `workers/data/`, the last 16 held out for the evaluate step), shows them live
until they end, and says where to look.
"""

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
from supervisor.tui import follow_jobs

DAEMON_START_TIMEOUT_S = 30.0
DEMO_PROMPTS = Path(__file__).resolve().parent.parent / "workers" / "data" / "demo_prompts.jsonl"


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


def tiny_model(path: Path, console: Console) -> Path:
    if (path / "config.json").exists():
        return path
    try:
        from workers.tiny import build_tiny_llama
    except ImportError as exc:
        raise JobsupError(f"the demo needs the workers extra ({exc.name} is missing)",
                          hint="pip install -e '.[workers]' (./dev.sh demo does it)") from None
    console.print(f"building a tiny random Llama in {path} (no download) ...")
    return build_tiny_llama(path)


def run_demo(*, url: str, data_dir: Path | None, keep_daemon: bool, console: Console,
             max_tokens: int = 48, epochs: int = 3) -> int:
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

    demo_dir = settings.data_dir / "demo"
    model = tiny_model(demo_dir / "tiny-llama", console)
    out = demo_dir / time.strftime("run-%Y%m%d-%H%M%S")
    jobs = client.post("/api/v1/pipelines/eagle3", json={
        "model": str(model), "prompts": str(DEMO_PROMPTS), "out": str(out),
        "name": "demo", "backend": "transformers", "device": "cpu", "dtype": "fp32",
        "max_tokens": max_tokens, "draft_vocab_size": 128, "ttt_steps": 3, "epochs": epochs,
        "train_batch_tokens": 512, "eval_max_new_tokens": max_tokens,
        "stall_timeout_s": 300, "labels": {"demo": "1"},
    })
    console.print(f"EAGLE-3 pipeline submitted ({len(jobs)} jobs), output in {out}")
    ok = follow_jobs(client, [j["id"] for j in jobs], console)
    train = next(j["id"] for j in jobs if j["name"] == "demo-train")
    console.print(
        f"\n{'all steps succeeded' if ok else 'a step did not succeed'}: "
        f"`jobsup show ID` and `jobsup logs ID` tell more.\n"
        f"draft model:  {out / 'train' / 'draft'}\n"
        f"acceptance:   {out / 'evaluate' / 'eval.json'}\n"
        f"API:          {url}/api/v1/jobs   (docs at {url}/docs)\n"
        f"metrics:      {url}/metrics  (training loss: jobsup_job_metric{{job_id=\"{train}\"}})\n"
        f"live table:   jobsup watch --all\n"
        f"Grafana:      import dashboards/grafana/jobsup.json, or run the stack: "
        f"docker compose -f docker/compose.yaml up")
    if daemon is not None:
        if keep_daemon:
            console.print(f"the daemon keeps running (pid {daemon.pid}); "
                          f"stop it with: kill {daemon.pid}")
        else:
            daemon.terminate()
            daemon.wait(timeout=15)
    return 0 if ok else 1
