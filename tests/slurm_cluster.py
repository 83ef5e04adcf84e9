"""A one-node SLURM cluster on loopback for the `slurm` backend's tests: munged,
slurmctld and slurmd from Debian's `munge` and `slurm-wlm` (dev.sh installs them),
each a child process in the foreground, with every file under one temporary directory.

No accounting database (`accounting_storage/none`: sacct has nothing to say, as on
many small clusters), `proctrack/linuxproc` and `task/none` (no cgroups needed), the
node declared with 8 CPUs whatever this machine has (`config_overrides`), so the tests'
jobs run side by side. `SLURM_CONF` in `os.environ` points the tools, and every
daemon the tests start, at it (`running`).

`SlurmCluster(preemption=True)`: a second partition, `urgent` (PriorityTier 2, over
`debug`'s 1), whose jobs cancel running `debug` jobs they need the room of
(`preempt/partition_prio`, `PreemptMode=CANCEL`): SLURM's PREEMPTED. Its own cluster
(tests/test_slurm_states.py), so the other modules' jobs are never preempted.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
CPUS = 8
KILL_WAIT_S = 2
"""SLURM's KillWait: seconds between its SIGTERM and SIGKILL at a time limit or a
scancel (the cluster's, not the job's)."""


def missing_tools() -> list[str]:
    return [tool for tool in NEEDED if shutil.which(tool) is None
            and not Path("/usr/sbin", tool).exists()]


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@contextlib.contextmanager
def running(*, preemption: bool = False) -> Iterator[SlurmCluster]:
    """A started cluster, `SLURM_CONF` pointing at it meanwhile (the daemons the tests
    start inherit it); stopped after. Fails, never skips, without SLURM."""
    missing = missing_tools()
    if missing:
        pytest.fail(f"SLURM is not installed here (no {', '.join(missing)}): install Debian's "
                    "slurm-wlm and munge (./dev.sh test does: apt-get install slurm-wlm munge)",
                    pytrace=False)
    slurm = SlurmCluster(preemption=preemption)
    saved = os.environ.get("SLURM_CONF")
    try:
        slurm.start()
        os.environ["SLURM_CONF"] = str(slurm.conf)
        yield slurm
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        slurm.stop()


class SlurmCluster:
    def __init__(self, *, preemption: bool = False) -> None:
        self.preemption = preemption
        # munged wants every directory above its socket searchable by all (pytest's
        # tmp_path is 0700), so the cluster gets a directory of its own
        self.dir = Path(tempfile.mkdtemp(prefix="jobsup-slurm-"))
        self.dir.chmod(0o755)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        self._spawn("munged", [_tool("munged"), "--foreground", f"--key-file={key}",
                               f"--socket={munge / 'munge.sock'}",
                               f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}",
                               f"--seed-file={munge / 'seed'}"])
        wait_for(lambda: (munge / "munge.sock").exists(), 10,
                 what=f"munged's socket; log: {self._log('munged')}")
        self.conf.write_text(self._config(munge / "munge.sock"))
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i"])
        wait_for(self._controller_answers, 30,
                 what=f"slurmctld to answer; log: {self._log('slurmctld')}")
        self._spawn("slurmd", [_tool("slurmd"), "-D", "-N", self.host])
        wait_for(lambda: self._node_state() == "idle", 30,
                 what=f"node {self.host} idle; slurmd log: {self._log('slurmd')}")
        return self

    def _config(self, munge_socket: Path) -> str:
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
        d, user = self.dir, getpass.getuser()  # root here; slurmd may need root anyway
        partitions = f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP"
        if self.preemption:
            partitions = (
                "PreemptType=preempt/partition_prio\nPreemptMode=CANCEL\n"
                f"{partitions} PriorityTier=1\n"
                f"PartitionName=urgent Nodes={self.host} MaxTime=INFINITE State=UP PriorityTier=2")
        return f"""\
ClusterName=jobsuptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge=300
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory={memory_mb} State=UNKNOWN
{partitions}
"""

    def stop_controller(self) -> None:
        """slurmctld goes down (SIGTERM); jobs running on the node go on."""
        proc = self.procs["slurmctld"]
        proc.terminate()
        proc.wait(15)

    def start_controller(self) -> None:
        """slurmctld comes back, with the jobs in its state directory."""
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i"])
        wait_for(self._controller_answers, 30,
                 what=f"slurmctld to answer; log: {self._log('slurmctld')}")

    def node_down(self, reason: str) -> None:
        """The administrator's `scontrol update state=down`: SLURM ends the jobs running
        on the node (NODE_FAIL, or a requeue where the job allows one)."""
        self.run("scontrol", "update", f"nodename={self.host}", "state=down",
                 f"reason={reason}")

    def node_resume(self) -> None:
        """`state=resume`, and back to idle (after its jobs' processes are gone)."""
        self.run("scontrol", "update", f"nodename={self.host}", "state=resume", check=False)
        wait_for(lambda: self._node_state() == "idle", 30,
                 what=f"node {self.host} idle again (sinfo: {self._node_state()!r})")

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.dir / "log" / f"{name}.out" if name != "munged"
                  else self.dir / "munge" / "munged.out", "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True)

    def _log(self, name: str) -> str:
        proc = self.procs.get(name)
        dead = f"(exited {proc.returncode}) " if proc and proc.poll() is not None else ""
        paths = {"munged": [self.dir / "munge" / "munged.out", self.dir / "munge" / "munged.log"],
                 "slurmctld": [self.dir / "log" / "slurmctld.out",
                               self.dir / "log" / "slurmctld.log"],
                 "slurmd": [self.dir / "log" / "slurmd.out", self.dir / "log" / "slurmd.log"]}
        text = "".join(p.read_text(errors="replace")[-3000:] for p in paths[name] if p.exists())
        return dead + text

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, check=check,
                              timeout=30, env={**os.environ, **self.env})

    def _controller_answers(self) -> bool:
        if self.procs["slurmctld"].poll() is not None:
            raise AssertionError(f"slurmctld exited: {self._log('slurmctld')}")
        return self.run("scontrol", "ping", check=False).returncode == 0

    def _node_state(self) -> str:
        if self.procs["slurmd"].poll() is not None:
            raise AssertionError(f"slurmd exited: {self._log('slurmd')}")
        listed = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False).stdout
        return " ".join(sorted(set(listed.split())))  # the node once per partition

    def state_of(self, slurm_id: str) -> dict[str, str]:
        """`scontrol show job -o`'s fields."""
        out = self.run("scontrol", "show", "job", "-o", slurm_id).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged; remove the files."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.run("scancel", "--full", f"--user={os.getuid()}", check=False)
                with contextlib.suppress(AssertionError):
                    wait_for(lambda: not self.run("squeue", "--noheader", "--states=R,CG",
                                                  check=False).stdout.strip(), 15)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

