"""A job's outcome as the exit code of `jobsup wait`, `submit --wait` and `logs -f`, and
the waiting itself (polling the API).

    0      succeeded (also: a server stopped because the jobs it served ended)
    N      failed: the job exited with code N (1-255)
    128+S  failed: killed by signal S (137: SIGKILL, e.g. the OOM killer)
    1      failed with no exit status of its own (never started, a dependency
           failed); also any error of the CLI (daemon unreachable, unknown id)
    2      usage error: a wrong option, caught before any request
    121    stopped (`jobsup stop`, or stopped before it started)
    122    lost: its process vanished with no recorded exit status
    124    `--timeout` passed with a job still pending or running (as timeout(1))
    130    interrupted (Ctrl-C)

A job's own exit code passes through, so one that exits 2, 121, 122 or 124 itself reads
as those; `--json` gives the job's state and exit to tell them apart."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from supervisor.client.http import Client
from supervisor.spec import JobState

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_STOPPED = 121
EXIT_LOST = 122
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_CODES_HELP = (
    "Exit codes: 0 succeeded; N the failed job's own exit code; 128+S killed by signal S; "
    "1 failed without an exit code (or the CLI's own error); 2 usage error; 121 stopped; "
    "122 lost; 124 --timeout passed; 130 interrupted. With several jobs: 0 when all "
    "succeeded, else the code of the first (in the order given) that did not.")


def ended(job: dict[str, Any]) -> bool:
    return JobState(job["state"]).ended


def ended_well(job: dict[str, Any]) -> bool:
    """Succeeded, or a server stopped because the jobs it served ended (done, too)."""
    return job["state"] == JobState.SUCCEEDED or (
        job["state"] == JobState.STOPPED and bool(job["spec"].get("stop_when_ended")))


def exit_code(job: dict[str, Any]) -> int:
    """The exit code standing for an ended job's outcome (module docstring)."""
    if ended_well(job):
        return EXIT_SUCCEEDED
    state = job["state"]
    if state == JobState.STOPPED:
        return EXIT_STOPPED
    if state == JobState.LOST:
        return EXIT_LOST
    code, sig = job.get("exit_code"), job.get("signal")
    if sig is not None and 0 < sig < 128:
        return 128 + int(sig)
    if code is not None and 0 < code < 256:
        return int(code)
    return EXIT_FAILED


def combined_exit_code(jobs: Sequence[dict[str, Any]]) -> int:
    """0 when every job ended well, else the code of the first one that did not."""
    for job in jobs:
        code = exit_code(job)
        if code != EXIT_SUCCEEDED:
            return code
    return EXIT_SUCCEEDED


def wait_for_jobs(client: Client, ids: Sequence[str], *, timeout_s: float | None = None,
                  poll_s: float = 0.5,
                  on_end: Callable[[dict[str, Any]], None] | None = None,
                  ) -> tuple[list[dict[str, Any]], bool]:
    """Poll until every job has ended, or `timeout_s` passed. The jobs as last read (in
    the order of `ids`) and whether all ended; `on_end` sees each job once, as it ends."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    latest: dict[str, dict[str, Any]] = {}
    while True:
        for job_id in ids:
            if job_id in latest and ended(latest[job_id]):
                continue
            job = client.get(f"/api/v1/jobs/{job_id}")
            latest[job_id] = job
            if ended(job) and on_end is not None:
                on_end(job)
        jobs = [latest[job_id] for job_id in ids]
        if all(ended(job) for job in jobs):
            return jobs, True
        if deadline is not None and time.monotonic() >= deadline:
            return jobs, False
        pause = poll_s if deadline is None else min(poll_s, max(0.0, deadline - time.monotonic()))
        time.sleep(pause)


def follow_log(client: Client, job_id: str, offset: int, attempt: int,
               poll_s: float = 0.5) -> dict[str, Any]:
    """Print new output, across the job's later attempts, until the job has ended and
    everything was read; the job as it ended."""
    last_job: dict[str, Any] | None = None
    while True:
        response = client.request("GET", f"/api/v1/jobs/{job_id}/logs",
                                  params={"offset": offset, "attempt": attempt}
                                  if attempt else {"offset": offset})
        chunk = response.text
        if chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()
        offset = int(response.headers.get("x-jobsup-log-offset", offset))
        if chunk:
            continue
        job: dict[str, Any] = client.get(f"/api/v1/jobs/{job_id}")
        if job["attempt"] > attempt:
            if attempt:
                print(f"--- jobsup: attempt {attempt + 1} ---", flush=True)
            attempt, offset = attempt + 1, 0
            continue
        if ended(job):
            if last_job is not None:  # nothing more after the end was seen: all read
                return job
            last_job = job  # one more read: output written just before the end
            continue
        time.sleep(poll_s)
