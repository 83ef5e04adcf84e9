"""Remote observation: the shim reads its own job (process tree, GPU memory, output files,
free disk) and appends the readings to the attempt's `observed.jsonl`; a daemon that
cannot read the job's node (`JOBSUP_OBSERVE=shim` here, a SLURM node there) builds its
samples, progress, forecasts and alerts from those lines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.observe.remote import STALE_MIN_S, ShimFeed
from supervisor.runtime import files, observed
from supervisor.runtime.procfs import all_stats
from supervisor.runtime.publish import Publisher
from tests.helpers import PY, REPO, Daemon, exit_recorded, identity, job_module, wait_for

SHIM_ENV = {"JOBSUP_OBSERVE": "shim"}


def lines_of(adir: Path) -> list[observed.Observed]:
    """Every reading left in the attempt's observed.jsonl and its rotated file, in order."""
    out = []
    for name in (files.OBSERVED_ROTATED, files.OBSERVED):
        try:
            raw = (adir / name).read_bytes()
        except FileNotFoundError:
            continue
        for line in raw.splitlines():
            parsed = observed.parse_observed(line)
            assert parsed is not None, line
            out.append(parsed)
    return out


def size_of(path: Path) -> int:
    """The file's size, 0 while it does not exist (between a rotation and the next line)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


# -- the shim's side: the publisher thread and the file ----------------------------------

def test_the_publisher_thread_reads_the_tree_and_the_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(3):
        (out / f"item{i}.bin").write_bytes(b"x" * 100)
    (out / "notes.txt").write_text("not an item")
    # a worker with a child spinning a quarter of a core: two processes under a parent
    # standing in for the shim (not this test process: an xdist worker may have other
    # children, such as its PostgreSQL server, that are not the job's)
    worker = subprocess.Popen(
        [PY, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
         *job_module("busy_writer", tmp_path / "unused", 0, 0)], process_group=0)
    worker_pid = wait_for(lambda: [s.pid for s in all_stats() if s.ppid == worker.pid], 10,
                          what="the worker under its stand-in shim")[0]
    publisher = Publisher(tmp_path, files.Observe(
        interval_s=0.1, output_dir=str(out), pattern="*.bin", gpu=True),
        shim_pid=worker.pid, worker_pid=worker_pid, cwd=str(tmp_path))
    try:
        publisher.start()
        wait_for(lambda: any(line["num_procs"] == 2 for line in lines_of(tmp_path)), 10,
                 what="a reading of both processes")
        for i in range(3, 5):
            (out / f"item{i}.bin").write_bytes(b"x" * 100)
        wait_for(lambda: lines_of(tmp_path)[-1]["files"] == 5, 10, what="the new items")
        first = next(line for line in lines_of(tmp_path) if line["num_procs"] == 2)
        wait_for(lambda: lines_of(tmp_path)[-1]["cpu_time_s"] > first["cpu_time_s"] + 0.05,
                 20, what="the spinner's CPU time in the readings")
    finally:
        stop_group(worker)
    assert publisher.stop()
    lines = lines_of(tmp_path)
    time.sleep(0.3)
    assert len(lines_of(tmp_path)) == len(lines)  # stopped: nothing more is written
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert [line["final"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["num_procs"] == 0 and lines[-1]["status"] is None  # the worker is gone
    live = [line for line in lines if line["num_procs"] == 2]
    assert live and all(line["status"] in ("sleeping", "running") for line in live)
    assert all(line["rss_bytes"] > 1_000_000 for line in live)
    cpu = [line["cpu_time_s"] for line in live]
    assert cpu == sorted(cpu) and cpu[-1] - cpu[0] > 0.05  # the spinner's work counts
    assert lines[-1]["files"] == 5 and lines[-1]["bytes_written"] == 500
    assert all(line["node"] == socket.gethostname() for line in lines)
    assert lines[-1]["disk_device"] == os.stat(out).st_dev
    assert 0 < lines[-1]["disk_free_bytes"] <= lines[-1]["disk_total_bytes"]
    assert all(line["error"] is None for line in lines)
    # GPU memory: None where NVML is absent (this machine), else the tree's bytes
    assert all(line["gpu_memory_bytes"] is None or line["gpu_memory_bytes"] >= 0
               for line in lines)


def test_the_file_is_capped_and_the_feed_reads_across_rotations(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path, files.Observe(
        interval_s=1, output_dir=None, pattern="**/*", gpu=False, max_bytes=4096),
        shim_pid=os.getpid(), worker_pid=os.getpid(), cwd=str(tmp_path))
    feed = ShimFeed(tmp_path)
    seen: list[int] = []
    for i in range(200):
        publisher.publish(final=False)
        for name in (files.OBSERVED, files.OBSERVED_ROTATED):
            assert size_of(tmp_path / name) <= 4096
        if i % 5 == 0:
            seen += [r.seq for r in feed.read(time.time())]
    seen += [r.seq for r in feed.read(time.time())]
    assert seen == list(range(1, 201))  # none lost, none twice, across every rotation
    assert (tmp_path / files.OBSERVED_ROTATED).exists()
    # a daemon (re)started now finds the backlog the two files hold, the newest last
    backlog = [r.seq for r in ShimFeed(tmp_path).read(time.time())]
    assert backlog[-1] == 200 and backlog == list(range(backlog[0], 201))
    assert len(backlog) == len(lines_of(tmp_path)) > 10

    # a line still being written is not read until it is whole
    line = json.dumps({**lines_of(tmp_path)[-1], "seq": 201}).encode() + b"\n"
    with open(tmp_path / files.OBSERVED, "ab") as f:
        f.write(line[:40])
    assert feed.read(time.time()) == []
    with open(tmp_path / files.OBSERVED, "ab") as f:
        f.write(line[40:])
    assert [r.seq for r in feed.read(time.time())] == [201]


def test_lines_are_put_on_the_daemons_clock_as_read_not_as_of_the_ticks_start(
        tmp_path: Path) -> None:
    """A line's time moves onto the daemon's clock by the two clocks' offset read at
    the same moment; the tick's `now` (its start, seconds old by a slow read) is no part
    of it: it put every line that much early (16 ms seen on an idle machine, more under
    load). The daemon's clock 100 s behind the system's (a step since its start), the
    tick begun 5 s ago."""
    publisher = Publisher(tmp_path, files.Observe(
        interval_s=1, output_dir=None, pattern="**/*", gpu=False),
        shim_pid=os.getpid(), worker_pid=os.getpid(), cwd=str(tmp_path))

    def daemon_clock() -> float:
        return time.time() - 100.0

    feed = ShimFeed(tmp_path, daemon_clock)
    publisher.publish(final=False)
    (reading,) = feed.read(daemon_clock() - 5.0)
    line_t = lines_of(tmp_path)[-1]["t"]
    assert abs(reading.t - (line_t - 100.0)) < 0.5, reading.t - line_t


def test_a_feed_goes_stale_when_no_new_line_comes(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path, files.Observe(
        interval_s=0.5, output_dir=None, pattern="**/*", gpu=False),
        shim_pid=os.getpid(), worker_pid=os.getpid(), cwd=str(tmp_path))
    feed = ShimFeed(tmp_path)
    publisher.publish(final=False)
    now = time.time()
    (reading,) = feed.read(now)
    assert abs(reading.t - now) < 1 and feed.stale(now + STALE_MIN_S - 0.5) is None
    message = feed.stale(now + STALE_MIN_S + 0.5)
    assert message is not None and socket.gethostname() in message
    publisher.publish(final=True)  # the shim's last reading: the job ended, nothing is late
    feed.read(now + 1)
    assert feed.stale(now + 1000) is None


def test_the_shim_publishes_bounded_readings_and_the_last_one_before_the_exit(
        tmp_path: Path) -> None:
    adir, out = tmp_path / "attempt-1", tmp_path / "out"
    adir.mkdir()
    (adir / files.LAUNCH).write_text(json.dumps(files.Launch(
        job_id="j", attempt=1, argv=job_module("item_writer", out, 40, 0.03, "none"),
        cwd=str(tmp_path), env={}, log_path=str(adir / files.OUTPUT_LOG), stop_grace_s=5,
        observe=files.Observe(interval_s=0.02, output_dir=str(out), pattern="*.bin",
                              gpu=False, max_bytes=4096))))
    shim = subprocess.Popen([PY, "-m", "supervisor.runtime.shim", str(adir)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    while shim.poll() is None:
        for name in (files.OBSERVED, files.OBSERVED_ROTATED):
            assert size_of(adir / name) <= 4096
        time.sleep(0.01)
    assert shim.returncode == 0 and exit_recorded(adir / files.STATUS)
    lines = lines_of(adir)
    assert lines[-1]["seq"] > len(lines)  # rotated, and the oldest readings were dropped
    assert [line["seq"] for line in lines] == list(range(lines[0]["seq"], lines[-1]["seq"] + 1))
    assert lines[-1]["final"] and lines[-1]["files"] == 40
    exit_status = files.read_exit(adir)
    assert exit_status is not None and exit_status.exit_code == 0
    assert exit_status.ended_at >= lines[-1]["t"]  # the final reading came first


# -- the daemon's side: a real daemon observing through the shims ------------------------

def busy_writer(daemon: Daemon, out: Path, items: int, delay_s: float,
                **spec: Any) -> dict[str, Any]:
    return daemon.submit(job_module("busy_writer", out, items, delay_s), output_dir=str(out),
                         pattern="*.bin", **spec)


def samples_of(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    return daemon.http.get(f"/api/v1/jobs/{job_id}/samples", params={"limit": 5000}).json()


def epoch(iso_time: str) -> float:
    from supervisor.formatting import from_iso

    return from_iso(iso_time)


@pytest.mark.slow
def test_progress_eta_and_resources_come_from_the_shim(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(env=SHIM_ENV)
    out = tmp_path / "out"
    job = busy_writer(daemon, out, 30, 0.15, expected_items=60)
    seen: list[dict[str, Any]] = []

    def midway() -> dict[str, Any] | None:  # a rate needs two progress points after the
        seen.append(daemon.job(job["id"]))  # first reading, however few came by item 10
        j = seen[-1]
        return j if (j["progress"]["files"] >= 10
                     and j["forecast"]["rate_items_per_s"] is not None) else None

    mid = wait_for(midway, 20, what=lambda: f"10 items and a rate; last seen: {seen[-1]}")
    p, f, r = mid["progress"], mid["forecast"], mid["resources"]
    assert p["source"] == "files" and p["items_done"] == p["files"]
    assert p["bytes_written"] == 1000 * p["files"] and p["observation_error"] is None
    assert 2 < f["rate_items_per_s"] < 10
    assert f["eta_s"] is not None and f["eta_s"] > 0 and f["bytes_per_item"] == 1000
    assert f["disk_free_bytes"] > 0 and f["will_fit"] is True
    assert r["node"] == socket.gethostname()
    assert r["num_procs"] == 2 and r["rss_bytes"] > 1_000_000
    assert r["status"] in ("sleeping", "running")
    wait_for(lambda: daemon.job(job["id"])["resources"]["cpu_percent"] > 5, 10,
             what="the spinner's CPU")
    final = wait_for(lambda: (j := daemon.job(job["id"]))["progress"]["files"] == 30 and j, 20,
                     what="30 items")
    assert final["progress"]["bytes_written"] == 30_000

    adir = daemon.data_dir / "jobs" / job["id"] / "attempt-1"
    launch = files.read_launch(adir)
    assert launch is not None and launch["observe"]["output_dir"] == str(out)
    # the stored samples carry the shim's figures (the daemon's own reading of the tree
    # would include the shim's CPU time, which the shim leaves out)
    published = {line["cpu_time_s"] for line in lines_of(adir)}
    samples = samples_of(daemon, job["id"])
    assert len(samples) >= 5 and all(s["cpu_time_s"] in published for s in samples)
    assert samples[-1]["num_procs"] == 2 and samples[-1]["files"] == 30
    shown = subprocess.run([PY, "-m", "supervisor", "show", job["id"], "--url", daemon.url],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert f"node\t{socket.gethostname()}\n" in shown.stdout, shown.stderr
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    daemon.wait_state(job["id"], "stopped")


@pytest.mark.slow
def test_a_restarted_daemon_stores_the_readings_it_missed(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(env=SHIM_ENV)
    job = busy_writer(daemon, tmp_path / "out", 200, 0.2, expected_items=200)
    wait_for(lambda: daemon.job(job["id"])["progress"]["files"] >= 5, 20, what="5 items")
    daemon.kill()
    down_at = time.time()
    adir = daemon.data_dir / "jobs" / job["id"] / "attempt-1"

    def readings_while_down() -> list[observed.Observed]:
        """At the shim's own pace, not in a fixed 4 s; inside the window `missed` takes,
        with a second's margin at each end."""
        return [line for line in lines_of(adir) if down_at + 1 < line["t"] < time.time() - 1]

    wait_for(lambda: len(readings_while_down()) >= 4, 30,
             what=lambda: f"4 readings published while the daemon is down; "
                          f"{len(readings_while_down())} so far")
    up_at = time.time()
    daemon.start()

    def missed() -> list[dict[str, Any]]:
        return [s for s in samples_of(daemon, job["id"])
                if down_at + 0.5 < epoch(s["t"]) < up_at - 0.5]

    gap = wait_for(lambda: len(missed()) >= 4 and missed(), 10,
                   what=lambda: f"the backlog's samples; down {down_at}, up {up_at}; stored: "
                                f"{[epoch(s['t']) for s in samples_of(daemon, job['id'])]}; "
                                f"published: {[line['t'] for line in lines_of(adir)]}")
    lines = lines_of(daemon.data_dir / "jobs" / job["id"] / "attempt-1")
    times = [epoch(s["t"]) for s in gap]
    assert times == sorted(times) and len(set(times)) == len(times)
    for sample, t in zip(gap, times, strict=True):
        # each at its reading's own time, with its figures
        line = min(lines, key=lambda line: abs(line["t"] - t))
        assert abs(line["t"] - t) < 0.2, t
        assert sample["cpu_time_s"] == line["cpu_time_s"]
        assert sample["files"] == line["files"] and sample["items_done"] == line["files"]
    assert gap[-1]["files"] > gap[0]["files"]  # the job went on while the daemon was down
    after = wait_for(lambda: (j := daemon.job(job["id"]))["progress"]["observation_error"]
                     is None and j["forecast"]["rate_items_per_s"] and j, 10,
                     what="fresh figures and a rate after the restart")
    assert after["progress"]["files"] >= gap[-1]["files"]
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    daemon.wait_state(job["id"], "stopped")


@pytest.mark.slow
def test_a_silent_shim_goes_stale_and_the_job_stalls(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(env=SHIM_ENV)
    job = busy_writer(daemon, tmp_path / "out", 1000, 0.3, stall_timeout_s=3)
    wait_for(lambda: daemon.job(job["id"])["progress"]["files"] >= 3, 20, what="3 items")
    shim = identity(daemon.data_dir, job["id"], "shim.json").pid
    os.kill(shim, signal.SIGSTOP)  # the job runs on; its readings stop coming
    try:
        stale = wait_for(
            lambda: (j := daemon.job(job["id"]))["progress"]["observation_error"] and j, 15,
            what="stale figures")
        assert "no reading from the shim on" in stale["progress"]["observation_error"]
        # the last figures, said to be old: never zeros
        assert stale["progress"]["files"] >= 3 and stale["resources"]["num_procs"] == 2
        assert stale["resources"]["rss_bytes"] > 1_000_000
        stored = len(samples_of(daemon, job["id"]))
        alert = wait_for(lambda: daemon.job(job["id"])["alerts"], 15, what="the stall alert")
        assert [a["rule"] for a in alert] == ["stalled"] and "no new item" in alert[0]["message"]
        assert len(samples_of(daemon, job["id"])) == stored  # no sample from stale figures
        files_then = daemon.job(job["id"])["progress"]["files"]
    finally:
        os.kill(shim, signal.SIGCONT)
    fresh = wait_for(lambda: (j := daemon.job(job["id"]))["progress"]["observation_error"]
                     is None and j["alerts"] == [] and j, 15, what="fresh figures, resolved")
    assert fresh["progress"]["files"] > files_then  # what the job wrote meanwhile
    assert len(samples_of(daemon, job["id"])) > stored
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    daemon.wait_state(job["id"], "stopped")


@pytest.mark.slow
def test_a_crash_is_told_with_the_shims_final_figures(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(env=SHIM_ENV)
    out = tmp_path / "out"
    code = (f"import os, time; os.makedirs({str(out)!r})\n"
            f"for i in range(4):\n"
            f"    open(os.path.join({str(out)!r}, f'{{i}}.bin'), 'wb').write(b'x' * 10)\n"
            f"    time.sleep(0.05)\n"
            f"raise SystemExit(3)")
    job = daemon.submit([PY, "-c", code], output_dir=str(out), pattern="*.bin",
                        expected_items=10)
    failed = daemon.wait_state(job["id"], "failed")
    assert failed["exit_code"] == 3
    ended = wait_for(lambda: (j := daemon.job(job["id"]))["progress"]["files"] == 4 and j, 10,
                     what="the final reading's figures")
    assert ended["progress"]["bytes_written"] == 40
    alerts = daemon.http.get("/api/v1/alerts", params={"state": "firing"}).json()
    assert [a["rule"] for a in alerts if a["job_id"] == job["id"]] == ["crashed"]
    lines = lines_of(daemon.data_dir / "jobs" / job["id"] / "attempt-1")
    assert lines[-1]["final"] and lines[-1]["files"] == 4


def test_figures_a_job_could_forge_are_kept_in_range() -> None:
    """observed.jsonl sits in a directory the job can write: a count beyond int4, an
    integer beyond 64 bits, NaN or negative times must not reach the database (one bad
    value would fail the tick's single insert of every job's samples)."""
    line = (b'{"seq": 3, "t": 1000.5, "node": "n1", "files": 3000000000, '
            b'"bytes_written": 100000000000000000000, "num_procs": -4, '
            b'"cpu_time_s": NaN, "rss_bytes": 12, "interval_s": Infinity}')
    parsed = observed.parse_observed(line)
    assert parsed is not None
    assert (parsed["files"], parsed["bytes_written"], parsed["num_procs"]) == (None, None, 0)
    assert (parsed["cpu_time_s"], parsed["rss_bytes"], parsed["interval_s"]) == (0.0, 12, 2.0)
    assert observed.parse_observed(b'{"seq": 1, "t": NaN, "node": "n1"}') is None
    assert observed.parse_observed(b'{"seq": 1, "t": -1, "node": "n1"}') is None
