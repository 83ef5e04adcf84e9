"""Asking SLURM about jobsup's jobs (`SlurmQueries`, a part of `SlurmBackend`): one
squeue listing per tick, parsed and cached; an ended job's exit code (scontrol) and who
cancelled it (sacct), looked up once; the SLURM job id an attempt recorded in
`slurm.json`; scancel. A controller that does not answer is `SlurmUnreachable`, asked
again only after `UNREACHABLE_RETRY_S`. What the backend makes of the answers, and
sbatch, are `slurm.py`'s; the pure parts (states, the sbatch line) `slurm_jobs.py`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

from supervisor.backends.base import Attempt
from supervisor.backends.launch import scrubbed_env
from supervisor.backends.slurm_jobs import SlurmJob, job_name, parse_exit_code
from supervisor.runtime.fileio import read_json

log = logging.getLogger(__name__)


SLURM_FILE = "slurm.json"
"""`{"job_id": "123", "name": "jobsup-ID-N"}`, written after sbatch answered."""
COMMAND_TIMEOUT_S = 30.0
"""How long one sbatch, squeue, scontrol, sacct or scancel may take."""
QUERY_TTL_S = 1.0
"""One squeue answer serves every job of a tick (and at most this long)."""
UNREACHABLE_RETRY_S = 15.0
"""After squeue failed, SLURM jobs count as running without asking again for this long:
squeue takes ~9 s to give up on a controller that is down, which would stall each tick."""


class SlurmUnreachable(Exception):
    """squeue failed: the controller is down or slow; nothing can be concluded."""


class SlurmQueries:
    """The scheduler's tools, for `SlurmBackend`, which holds the caches they fill."""

    _listing: dict[str, SlurmJob] | None
    _listed_at: float
    _unreachable: str | None
    _failed_at: float
    _finals: dict[str, SlurmJob | None]
    _ids: dict[Path, str]

    # -- the scheduler's tools --------------------------------------------------------
    def _run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        env = scrubbed_env(os.environ)
        return subprocess.run(argv, capture_output=True, text=True, env=env,
                              timeout=COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL)

    def _jobs(self) -> dict[str, SlurmJob]:
        """This user's jobsup jobs in SLURM's memory, by job name (one squeue a tick);
        SlurmUnreachable when squeue fails."""
        now = time.monotonic()
        if self._listing is not None and now - self._listed_at < QUERY_TTL_S:
            return self._listing
        if self._unreachable is not None and now - self._failed_at < UNREACHABLE_RETRY_S:
            raise SlurmUnreachable(self._unreachable)
        try:
            done = self._run(["squeue", "--noheader", "--all", "--states=all",
                              f"--user={os.getuid()}", "--format=%i|%j|%T|%r|%N"])
            if done.returncode != 0:
                raise SlurmUnreachable(done.stderr.strip()
                                       or f"squeue exited {done.returncode}")
        except (OSError, subprocess.SubprocessError, SlurmUnreachable) as exc:
            self._failed_at = time.monotonic()
            raise SlurmUnreachable(str(exc)) from None
        listing: dict[str, SlurmJob] = {}
        for line in done.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 5 and parts[1].startswith("jobsup-"):
                job = SlurmJob(parts[0], parts[1], parts[2], parts[3], parts[4])
                # a name submitted twice (a daemon that died right after sbatch): newest
                if parts[1] not in listing or int(job.id) > int(listing[parts[1]].id):
                    listing[parts[1]] = job
        self._listing, self._listed_at = listing, now
        return listing

    def _find(self, attempt: Attempt) -> SlurmJob | None:
        """The attempt's SLURM job: SlurmUnreachable when the controller does not
        answer; None when SLURM knows no such job (not submitted, or forgotten)."""
        name = job_name(attempt.job_id, attempt.number)
        listed = self._jobs().get(name)
        recorded = self.slurm_id(attempt)
        if listed is not None and (recorded is None or listed.id == recorded):
            return listed
        if recorded is None:
            return None
        if recorded not in self._finals:  # past MinJobAge: accounting may know it
            self._finals[recorded] = self._from_sacct(recorded, name)
        return self._finals[recorded]

    def _final(self, job: SlurmJob) -> SlurmJob:
        """An ended job with its exit code (scontrol) and who cancelled it (sacct)."""
        cached = self._finals.get(job.id)
        if cached is not None:
            return cached
        exit_code, sig = None, None
        try:
            done = self._run(["scontrol", "show", "job", "-o", job.id])
            fields = dict(word.split("=", 1) for word in done.stdout.split() if "=" in word)
            exit_code, sig = parse_exit_code(fields.get("ExitCode", ""))
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
        accounted = self._from_sacct(job.id, job.name) if job.state == "CANCELLED" else None
        final = SlurmJob(job.id, job.name, job.state, job.reason, job.nodes,
                         accounted.cancelled_by if accounted else None, exit_code, sig)
        self._finals[job.id] = final
        return final

    def _from_sacct(self, slurm_id: str, name: str) -> SlurmJob | None:
        """The job as accounting recorded it; None without accounting (sacct fails)."""
        try:
            done = self._run(["sacct", "--noheader", "--parsable2", "--allocations",
                              f"--jobs={slurm_id}", "--format=JobID,State,ExitCode,NodeList"])
        except (OSError, subprocess.SubprocessError):
            return None
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            parts = line.split("|")
            if len(parts) == 4 and parts[0] == slurm_id:
                state, _, by = parts[1].partition(" by ")
                exit_code, sig = parse_exit_code(parts[2])
                return SlurmJob(slurm_id, name, state.strip(), "", parts[3],
                                by.strip() or None, exit_code, sig)
        return None

    def slurm_id(self, attempt: Attempt) -> str | None:
        data = read_json(attempt.dir / SLURM_FILE)
        value = data.get("job_id") if isinstance(data, dict) else None
        return value if isinstance(value, str) and value.isdigit() else None

    def scheduler_job_id(self, attempt: Attempt) -> str | None:
        """The attempt's SLURM job id, read from `slurm.json` once it is there."""
        known = self._ids.get(attempt.dir)
        if known is None:
            known = self.slurm_id(attempt)
            if known is not None:
                self._ids[attempt.dir] = known
        return known

    def _find_quietly(self, attempt: Attempt) -> SlurmJob | None:
        try:
            self._listing = None
            job = self._find(attempt)
        except SlurmUnreachable as exc:
            log.warning("job %s: cannot find its SLURM job to stop it (%s); the stop is "
                        "retried by the backstop", attempt.job_id, exc)
            return None
        return job if job is not None and job.active else None

    def _scancel(self, slurm_id: str, *options: str) -> None:
        try:
            done = self._run(["scancel", *options, slurm_id])
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("scancel %s failed: %s", slurm_id, exc)
            return
        if done.returncode != 0:
            log.warning("scancel %s failed: %s", slurm_id, done.stderr.strip())
        self._listing = None
