"""SLURM's NODE_FAIL and PREEMPTED, produced for real on a one-node cluster of this
module's own (`tests/slurm_cluster.py` with `preemption=True`: a second partition,
`urgent`, whose jobs cancel running `debug` jobs), through a real daemon. Its own
cluster because both cases end every job running on the node, which would cut short
the other modules' jobs (test_slurm.py's one-minute time limit case)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.backends.slurm_query import SLURM_FILE
from supervisor.runtime.fileio import read_json
from supervisor.runtime.files import attempt_dir
from tests.helpers import Daemon, python_job, wait_for
from tests.slurm_cluster import CPUS, SlurmCluster, running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

ENDED = ("succeeded", "failed", "stopped", "lost", "pending")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """This module's cluster, with the `urgent` partition that preempts `debug`."""
    with running(preemption=True) as slurm:
        yield slurm


@pytest.fixture(scope="module")
def daemon(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("slurm-states") / "data",
               {"JOBSUP_BACKEND": "slurm"}).start()
    try:
        yield d
    finally:
        d.shut_down()


def slurm_id(daemon: Daemon, job: dict[str, Any]) -> str:
    data = wait_for(lambda: read_json(attempt_dir(daemon.data_dir / "jobs", job["id"],
                                                  job["attempt"] or 1) / SLURM_FILE),
                    10, what="slurm.json")
    return str(data["job_id"])


def running_job(daemon: Daemon, name: str, **spec: Any) -> tuple[dict[str, Any], str]:
    job = daemon.submit(python_job("import time; print('up', flush=True); time.sleep(600)"),
                        name=name, **spec)
    wait_for(lambda: "up" in daemon.logs(job["id"]), 30, what=f"{name}'s first line")
    return job, slurm_id(daemon, job)


def test_a_job_on_a_node_set_down_ends_node_fail(daemon: Daemon,
                                                 cluster: SlurmCluster) -> None:
    """`scontrol update state=down` under a running job: SLURM ends it NODE_FAIL (no
    requeue: jobsup submits `--no-requeue`), jobsup records `node_fail` naming the node.
    The node is resumed, and idle again, before the next test."""
    job, sid = running_job(daemon, "on-a-failing-node")
    try:
        cluster.node_down("jobsup-test")
        done = daemon.wait_state(job["id"], *ENDED, timeout=30)
    finally:
        cluster.node_resume()
    assert cluster.state_of(sid)["JobState"] == "NODE_FAIL"
    assert (done["state"], done["exit_reason"]) == ("failed", "node_fail"), done
    assert done["reason"] == (f"SLURM job {sid}: a node of its allocation failed "
                              f"({cluster.host}) (NODE_FAIL)")


def test_a_job_preempted_by_a_higher_partition_ends_preempted(daemon: Daemon,
                                                              cluster: SlurmCluster) -> None:
    """A `debug` job holding every CPU of the node; an `urgent` job (PriorityTier 2)
    needs one: SLURM cancels the first (PREEMPTED), jobsup records `preempted`, and the
    urgent job runs."""
    low, sid = running_job(daemon, "preemptible", slurm={"cpus_per_task": CPUS})
    urgent = daemon.submit(python_job("print('urgent')"), name="urgent",
                           slurm={"partition": "urgent"})
    done = daemon.wait_state(low["id"], *ENDED, timeout=30)
    assert cluster.state_of(sid)["JobState"] == "PREEMPTED"
    assert (done["state"], done["exit_reason"]) == ("failed", "preempted"), done
    assert done["reason"] == f"SLURM job {sid} was preempted by SLURM (PREEMPTED)"
    ran = daemon.wait_state(urgent["id"], "succeeded", "failed", "lost", timeout=30)
    assert ran["state"] == "succeeded", ran
