"""One rank of a multi-rank `slurm` job: `python -m supervisor.runtime.rank -- ARGV...`.

The shim of a job with several ranks (`slurm.nodes` x `slurm.tasks_per_node` > 1) runs
`srun ... python -m supervisor.runtime.rank -- ARGV`; srun starts this once per task,
and it execs ARGV with the environment torchrun would give it, from srun's own:

    RANK        SLURM_PROCID        WORLD_SIZE        SLURM_NTASKS
    LOCAL_RANK  SLURM_LOCALID       LOCAL_WORLD_SIZE  tasks on this node
    NODE_RANK   SLURM_NODEID        MASTER_ADDR       the allocation's first node
    MASTER_PORT 20000 + the SLURM job id modulo 20000 (the same on every rank)

A variable the job's own environment sets already is left as it is. Stdlib only, like
the shim.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

MASTER_PORT_BASE = 20_000
MASTER_PORT_SPAN = 20_000


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`vm`, `gpu[03-05,07]`, `a1,b2`), through
    `scontrol show hostnames` when the list is compressed."""
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                             capture_output=True, text=True, timeout=30).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        head, _, rest = nodelist.partition("[")  # gpu[03-05] -> gpu03
        return head + rest.split(",")[0].split("-")[0].rstrip("]")


def _tasks_on_node(env: Mapping[str, str]) -> str:
    """SLURM_TASKS_PER_NODE's count for this node (`2(x3)` -> 2; `3,2` -> by node id)."""
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    node = int(env.get("SLURM_NODEID", "0") or 0)
    counts: list[str] = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [count] * (int(times.rstrip(")")) if times else 1)
    return counts[node] if node < len(counts) else env.get("SLURM_NTASKS", "1")


def rank_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the torchrun variables set from SLURM's (see the module docstring)."""
    out = dict(env)
    job_id = int(env.get("SLURM_JOB_ID", "0") or 0)
    derived = {
        "RANK": env.get("SLURM_PROCID", "0"),
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": _tasks_on_node(env),
        "NODE_RANK": env.get("SLURM_NODEID", "0"),
        "MASTER_PORT": str(MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN),
    }
    if "MASTER_ADDR" not in env:
        derived["MASTER_ADDR"] = first_host(env.get("SLURM_JOB_NODELIST", "localhost"))
    for name, value in derived.items():
        out.setdefault(name, value)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m supervisor.runtime.rank -- ARGV...", file=sys.stderr)
        return 2
    env = rank_environment(os.environ)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        print(f"jobsup rank {env['RANK']}: cannot start {argv[0]!r}: {exc.strerror}",
              file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
