"""The supervisor's view of multi-GPU jobs, on a real multi-GPU host: a daemon runs
(1) a split extraction (`--gpus-per-model N`) and (2) a data-parallel one (`--gpus N`)
whose rank N-1 is SIGKILLed half-way. Prints the per-device GPU memory the job view
showed (largest reading per device), `jobsup show` while the split job ran, and how
the crashed job ended: state, reason and the `crashed` alert, which must name the rank.

Run after bench/extract_split_gpu.py (it reuses its model and data):
`python bench/gpu_job_view.py --work /tmp/split`. `--cpu` is a dry run of the script on
CPU ranks with the tiny model (no GPU memory to show)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch

PORT = 8799
URL = f"http://127.0.0.1:{PORT}"


def submit(http: httpx.Client, name: str, out: Path, argv: list[str]) -> str:
    response = http.post("/api/v1/jobs", json={
        "name": name, "command": [sys.executable, "-m", "workers.extract", *argv],
        "cwd": str(Path(__file__).resolve().parent.parent), "output_dir": str(out),
        "pattern": "rows_*/*.safetensors"})
    response.raise_for_status()
    return str(response.json()["id"])


def nvml_processes() -> str:
    """What NVML itself lists per device (to tell an empty job view from an empty NVML
    answer, e.g. in a sandbox that hides other processes' pids)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        lines = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            lines.append(f"gpu{i}: used {used / 1e9:.1f} GB, processes " + ", ".join(
                f"{p.pid}:{(p.usedGpuMemory or 0) / 1e9:.1f} GB" for p in procs))
        return "\n".join(lines)
    except Exception as exc:  # a diagnostic only
        return f"NVML: {exc!r}"


def watch(http: httpx.Client, job_id: str, timeout: float,
          on_running: Any = None) -> tuple[dict[str, Any], dict[int, int]]:
    """Poll the job until it ends; returns its last view and the largest memory seen
    per device index."""
    peak: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/api/v1/jobs/{job_id}").json()
        for device in job["resources"].get("gpu_devices") or []:
            peak[device["index"]] = max(peak.get(device["index"], 0), device["memory_bytes"])
        if on_running is not None and job["state"] == "running":
            on_running(job)
        if job["state"] not in ("pending", "running"):
            return job, peak
        time.sleep(1.0)
    raise SystemExit(f"job {job_id} did not end in {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, default=Path("/tmp/split"))
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU ranks")
    args = parser.parse_args()
    model, data = args.work / "model", args.work / "conv.jsonl"
    if args.cpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.workers_util import make_conversations, make_model

        n = 2
        make_model(model)
        make_conversations(data, copies=16)
        split_flags, dp_flags = ["--device", "cpu,cpu"], ["--ranks", "2", "--device", "cpu",
                                                          "--batch-tokens", "64"]
    else:
        if not (model / "config.json").exists():  # a fresh machine: build them again
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from extract_multi_gpu import build

            build(args.work, 512)
        n = torch.cuda.device_count()
        split_flags, dp_flags = ["--gpus-per-model", str(n)], ["--gpus", str(n)]
    data_dir = args.work / "daemon"
    env = {**os.environ, "JOBSUP_SAMPLE_INTERVAL": "1"}
    with open(args.work / "daemon.log", "wb") as daemon_log:
        daemon = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--port",
                                   str(PORT), "--data-dir", str(data_dir)], env=env,
                                  stdout=daemon_log, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=URL, timeout=10)
    try:
        for _ in range(60):
            try:
                http.get("/api/v1/jobs").raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        common = ["--model", str(model), "--data", str(data), "--max-length", "1450",
                  "--store", "dtype"]  # bf16, as the documented runs
        shown: list[str] = []

        def show_once(job: dict[str, Any]) -> None:
            if not shown and (job["progress"]["items_done"] or 0) > 32:
                shown.append(subprocess.run(
                    [sys.executable, "-m", "supervisor", "show", job["id"], "--url", URL],
                    capture_output=True, text=True, env={**os.environ, "COLUMNS": "120"}
                ).stdout + "\nNVML at that moment:\n" + nvml_processes())

        split_id = submit(http, "extract-split", args.work / "job_split",
                          [*common, "--out", str(args.work / "job_split"), *split_flags])
        job, peak = watch(http, split_id, 540, show_once)
        print(f"split job: {job['state']}, exit {job['exit_code']}, "
              f"{job['progress']['items_done']} items")
        print("largest per-device GPU memory in the job view: " + ", ".join(
            f"gpu{i} {b / 1e9:.1f} GB" for i, b in sorted(peak.items())))
        print("\n`jobsup show` while it ran:\n" + (shown[0] if shown else "(not captured)"))
        shutil.rmtree(args.work / "job_split", ignore_errors=True)  # disk for the next job

        def kill_last_rank(job: dict[str, Any]) -> None:
            if not shown[1:] and (job["progress"]["items_done"] or 0) > 64:
                ranks = subprocess.run(["pgrep", "-f", "--", f"--rank {n - 1} "],
                                       capture_output=True, text=True).stdout.split()
                for pid in ranks:
                    os.kill(int(pid), signal.SIGKILL)
                shown.append(f"killed rank {n - 1}: pids {ranks}")

        dp_id = submit(http, "extract-dp", args.work / "job_dp",
                       [*common, "--out", str(args.work / "job_dp"), *dp_flags])
        job, peak = watch(http, dp_id, 540, kill_last_rank)
        print(shown[1] if shown[1:] else "rank not killed (job ended first)")
        print("largest per-device GPU memory: " + ", ".join(
            f"gpu{i} {b / 1e9:.1f} GB" for i, b in sorted(peak.items())))
        alerts = http.get("/api/v1/alerts").json()
        print(f"data-parallel job: {job['state']}, exit {job['exit_code']}, "
              f"reason: {job['reason']}")
        print("alerts: " + json.dumps([{k: a[k] for k in ("rule", "message")}
                                      for a in alerts if a["job_id"] == dp_id], indent=1))
    finally:
        http.close()
        daemon.terminate()
        daemon.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
