"""SLURM's words, for the `slurm` backend (`slurm.py`): its job states, the sbatch
command line of an attempt, and a final state as jobsup's exit reason. Pure: no
process is run here, so the state table is tested without a cluster."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from supervisor.backends.base import SchedulerEnd
from supervisor.runtime import files, rank
from supervisor.spec import ExitReason, JobSpec

BATCH_SCRIPT = "slurm-batch.sh"
"""The script sbatch runs in the attempt directory: it execs the shim."""

ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED",
    "RESIZING", "SIGNALING", "STAGE_OUT", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
    "RESV_DEL_HOLD", "SPECIAL_EXIT",
})
"""SLURM states in which the allocation may still hold the job's processes."""

QUEUED_STATES = frozenset({"PENDING", "CONFIGURING"})
"""SLURM states before the job's batch script runs: waiting in the queue, or its nodes
still being readied (booted, configured). Its time there is no time it could work."""

PENDING_REASONS = {
    "Resources": "waiting for resources",
    "Priority": "waiting behind jobs of higher priority",
    "BeginTime": "its start time has not come",
    "Dependency": "waiting for a SLURM dependency",
    "JobHeldUser": "held by its user (scontrol release)",
    "JobHeldAdmin": "held by an administrator",
    "ReqNodeNotAvail": "a requested node is not available",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "PartitionTimeLimit": "its time limit exceeds the partition's",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "QOSMaxJobsPerUserLimit": "its QOS allows no more running jobs of this user",
    "AssocGrpGRES": "its account's GRES limit is reached",
    "NodeDown": "a node it needs is down",
}
"""SLURM's pending reasons, in words (others are shown as SLURM names them)."""


@dataclass(frozen=True)
class SlurmJob:
    """One job as squeue, scontrol or sacct lists it."""

    id: str
    name: str
    state: str
    reason: str
    nodes: str
    cancelled_by: str | None = None
    """The uid sacct names in `CANCELLED by UID`; None without accounting."""
    exit_code: int | None = None
    signal: int | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def queued(self) -> bool:
        return self.state in QUEUED_STATES


def job_name(job_id: str, number: int) -> str:
    return f"jobsup-{job_id}-{number}"


def sbatch_argv(spec: JobSpec, adir: Path, name: str) -> list[str]:
    """sbatch's arguments for one attempt: jobsup's own options, then the spec's."""
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={adir / files.SHIM_LOG}",
            f"--chdir={adir}", "--no-requeue", "--export=NONE"]
    res = spec.slurm
    if res is None:
        return [*argv, str(adir / BATCH_SCRIPT)]
    options = {"--partition": res.partition, "--nodes": res.nodes,
               "--ntasks-per-node": res.tasks_per_node, "--gpus-per-node": res.gpus_per_node,
               "--gres": res.gres, "--cpus-per-task": res.cpus_per_task, "--mem": res.mem,
               "--time": res.time, "--account": res.account, "--qos": res.qos}
    argv += [f"{option}={value}" for option, value in options.items() if value is not None]
    return [*argv, *res.extra, str(adir / BATCH_SCRIPT)]


def worker_argv(spec: JobSpec) -> list[str]:
    """What the shim starts: the command itself, or for several ranks srun running it
    once per rank through `rank.py` (the torchrun variables; by path, so a rank needs
    no PYTHONPATH). `--kill-on-bad-exit`: one failing rank ends the others, and srun's
    log line names it (`srun: error: NODE: task N: Exited with exit code C`).
    `--export=ALL`: the ranks get the job's environment (its `env`, JOBSUP_*), which
    srun would otherwise drop, following the SLURM_EXPORT_ENV=NONE that sbatch's
    `--export=NONE` leaves in the allocation."""
    if spec.slurm is None or spec.slurm.ranks == 1:
        return spec.command
    return ["srun", "--kill-on-bad-exit=1", "--export=ALL", sys.executable, rank.__file__,
            "--", *spec.command]


def parse_exit_code(text: str) -> tuple[int | None, int | None]:
    """SLURM's `ExitCode=3:0` (code:signal) as (exit code, signal); the signal wins."""
    code, _, sig = text.partition(":")
    try:
        exit_code, signal = int(code), int(sig or 0)
    except ValueError:
        return None, None
    return (None, signal) if signal else (exit_code, None)


def end_of(job: SlurmJob, *, jobsup_cancelled: bool, shim_recorded: bool) -> SchedulerEnd | None:
    """SLURM's final state as jobsup's exit reason, when it is the reason; None when the
    shim's exit code tells (COMPLETED, FAILED) or jobsup cancelled it (a stop)."""
    where = f"SLURM job {job.id}"
    state = job.state
    if state in ("COMPLETED", "FAILED"):
        if shim_recorded:
            return None
        return SchedulerEnd(state, ExitReason.EXIT,
                            f"{where} {state} before its shim recorded an exit (see shim.log)")
    if state in ("TIMEOUT", "DEADLINE"):
        what = "time limit" if state == "TIMEOUT" else "deadline"
        return SchedulerEnd(state, ExitReason.TIMEOUT,
                            f"{where} reached its {what} and was ended by SLURM ({state})")
    if state == "CANCELLED":
        if jobsup_cancelled:
            return None
        who = (f"by uid {job.cancelled_by}" if job.cancelled_by else
               "by someone outside jobsup (who is recorded only with SLURM accounting, "
               "sacct)")
        return SchedulerEnd(state, ExitReason.CANCELLED,
                            f"{where} cancelled {who}", restartable=False)
    if state == "OUT_OF_MEMORY":
        return SchedulerEnd(state, ExitReason.OOM,
                            f"{where} ran out of memory (SLURM OUT_OF_MEMORY)")
    if state == "PREEMPTED":
        return SchedulerEnd(state, ExitReason.PREEMPTED,
                            f"{where} was preempted by SLURM (PREEMPTED)")
    if state in ("NODE_FAIL", "BOOT_FAIL"):
        nodes = f" ({job.nodes})" if job.nodes else ""
        return SchedulerEnd(state, ExitReason.NODE_FAIL,
                            f"{where}: a node of its allocation failed{nodes} ({state})")
    return SchedulerEnd(state, ExitReason.LOST, f"{where} ended {state}")
