"""Progress, resources, samples and forecasts of real jobs under a real daemon."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, select

from supervisor.storage import store
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from supervisor.storage.tables import Job, Sample
from tests.helpers import Daemon, job_module, wait_for

pytestmark = pytest.mark.slow


def writer(out: Path, n: int, delay: float, mode: str, linger: float = 0) -> list[str]:
    return job_module("item_writer", out, n, delay, mode, linger)


def test_progress_file_resources_and_forecast(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()  # a 5,000-byte output file from before the job (a config dump): in its
    (out / "config.bin").write_bytes(b"c" * 5000)  # bytes and files, not in its items
    job = daemon.submit(writer(out, 40, 0.1, "report", linger=30), output_dir=str(out),
                        pattern="*.bin", expected_items=40)

    def done_writing() -> dict | None:
        current = daemon.job(job["id"])
        return current if current["progress"]["items_done"] == 40 else None

    seen: list[dict] = []

    def midway() -> dict | None:  # a rate needs two progress points after the first
        seen.append(daemon.job(job["id"]))  # reading, however few readings came by item 15
        j = seen[-1]
        return j if ((j["progress"]["items_done"] or 0) >= 15
                     and j["forecast"]["rate_items_per_s"] is not None) else None

    mid = wait_for(midway, 20, what=lambda: f"progress and a rate; last seen: {seen[-1]}")
    assert mid["progress"]["source"] == "progress_file"
    assert mid["progress"]["items_total"] == 40
    assert mid["progress"]["metrics"]["loss"] == 1 / mid["progress"]["items_done"]
    assert 4 < mid["forecast"]["rate_items_per_s"] < 12  # 0.1 s per item plus overhead
    assert mid["forecast"]["eta_s"] is not None and mid["forecast"]["eta_s"] < 10
    assert mid["forecast"]["will_fit"] is True and mid["forecast"]["disk_free_bytes"] > 0
    assert mid["resources"]["num_procs"] >= 1 and mid["resources"]["rss_bytes"] > 1_000_000
    assert mid["resources"]["status"] in ("sleeping", "running")

    final = wait_for(done_writing, 20, what="all items")
    assert final["progress"]["files"] == 41 and final["progress"]["bytes_written"] == 45_000
    assert final["forecast"]["eta_s"] == 0
    assert final["progress"]["last_progress_at"] is not None

    samples = daemon.http.get(f"/api/v1/jobs/{job['id']}/samples").json()
    assert len(samples) >= 5
    # Bytes per item: the bytes grown over the items counted from the first counted item
    # to the latest reading (bytes over files or over items would count the config).
    # Each item is a 1000-byte file, but a reading's scan and its progress file are not
    # read at one instant (the scan first), so at either end the files may be ahead of
    # or behind the count: 14,000 bytes over 15 items (933) is as right as 1000. So the
    # figure is checked against the readings it was read from, the stored samples: the
    # first reading with a count, then the first with more
    counted = [s for s in samples if s["items_done"] is not None]
    first = next(s for s in counted if s["items_done"] > counted[0]["items_done"])
    latest = mid["progress"]
    assert mid["forecast"]["bytes_per_item"] == (
        (latest["bytes_written"] - first["bytes_written"])
        / (latest["items_done"] - first["items_done"]))
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)
    assert samples[-1]["files"] == 41
    since = daemon.http.get(f"/api/v1/jobs/{job['id']}/samples",
                            params={"since": samples[-2]["t"], "limit": 1}).json()
    assert [s["t"] for s in since] == [samples[-2]["t"]]
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_progress_from_tqdm_log_and_from_files(daemon: Daemon, tmp_path: Path) -> None:
    logged = daemon.submit(writer(tmp_path / "a", 10, 0.05, "tqdm", linger=30))
    counted = daemon.submit(writer(tmp_path / "b", 10, 0.05, "none", linger=30),
                            output_dir=str(tmp_path / "b"), pattern="*.bin", expected_items=20)

    def progress_of(job_id: str, done: int) -> dict | None:
        p = daemon.job(job_id)["progress"]
        return p if p["items_done"] == done else None

    by_log = wait_for(lambda: progress_of(logged["id"], 10), 15, what="log progress")
    assert by_log["source"] == "log" and by_log["items_total"] == 10
    by_files = wait_for(lambda: progress_of(counted["id"], 10), 15, what="file progress")
    assert by_files["source"] == "files" and by_files["items_total"] == 20
    assert by_files["files"] == 10  # the .tmp files never counted
    for job in (logged, counted):
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_submit_warns_when_the_output_cannot_fit(daemon: Daemon, tmp_path: Path) -> None:
    response = daemon.http.post("/api/v1/jobs", json={
        "name": "huge", "command": ["true"], "output_dir": str(tmp_path / "o"),
        "expected_items": 10_000, "bytes_per_item": 1e15})
    assert response.status_code == 201
    (warning,) = response.json()["warnings"]
    assert "exceeds" in warning and "free on its filesystem" in warning
    small = daemon.submit(["true"], output_dir=str(tmp_path / "o"), expected_items=10,
                          bytes_per_item=1000)
    assert small["warnings"] == []


def test_final_progress_survives_a_daemon_restart(daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "out"
    job = daemon.submit(writer(out, 5, 0.01, "report"), output_dir=str(out), pattern="*.bin")
    daemon.wait_state(job["id"], "succeeded")
    seen: list[dict] = []

    def final_reading_in() -> bool:  # its 5 fresh files may be read a tick after the end
        seen.append(daemon.job(job["id"])["progress"])
        p = seen[-1]
        return (p["items_done"], p["files"], p["observation_error"]) == (5, 5, None)

    wait_for(final_reading_in, 15, what=lambda: f"the final reading; last seen: {seen[-1]}")
    daemon.stop()  # (it ends the tick under way, which stores what that tick read)
    daemon.start()
    after = daemon.job(job["id"])
    assert after["progress"]["items_done"] == 5 and after["progress"]["files"] == 5
    assert after["forecast"]["rate_items_per_s"] is None  # ended: no forecast


def test_samples_are_downsampled_with_age(tmp_path: Path) -> None:
    """A 7-day job sampled every 2 s keeps ~15k rows, full resolution for 6 hours."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    now = time.time()
    start = now - 7 * 86400
    with sessions() as session:
        session.add(Job(id="j1", name="long", spec_json="{}", state="running",
                        created_at=start, attempt=1, restarts=0))
        session.commit()
        rows = [{"job_id": "j1", "t": start + i * 2.0, "items_done": i, "files": i,
                 "bytes_written": i * 10} for i in range(7 * 86400 // 2)]
        session.execute(insert(Sample), rows)
        session.commit()
        deleted = store.compact_samples(session, now=now)
        session.commit()
        kept = session.scalars(select(Sample.t).order_by(Sample.t)).all()
    assert deleted == len(rows) - len(kept)
    assert 14_000 < len(kept) < 16_000, len(kept)
    recent = [t for t in kept if t >= now - 6 * 3600]
    assert len(recent) >= 6 * 3600 // 2 - 1
    day_old = [t for t in kept if now - 30 * 3600 <= t < now - 29 * 3600]
    assert 55 <= len(day_old) <= 61  # one per minute
    engine.dispose()


def _samples_db(tmp_path: Path, name: str, start: float, seconds: int) -> tuple[Any, Any]:
    engine = make_engine(f"sqlite:///{tmp_path / name}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        session.add(Job(id="j1", name="long", spec_json="{}", state="running",
                        created_at=start, attempt=1, restarts=0))
        session.commit()
        session.execute(insert(Sample), [
            {"job_id": "j1", "t": start + i * 2.0, "items_done": i, "files": i,
             "bytes_written": i * 10} for i in range(seconds // 2)])
        session.commit()
    return engine, sessions


def test_incremental_downsampling_keeps_what_a_full_pass_keeps(tmp_path: Path) -> None:
    """Passes every 5 minutes that read only the newly aged rows end where one pass over
    everything ends; the windowed deletes are searched through the index on `t`."""
    start = 1_800_000_000.0
    now = start + 4 * 86400 + 7.0
    full_db, full = _samples_db(tmp_path, "full.sqlite", start, 4 * 86400)
    step_db, step = _samples_db(tmp_path, "step.sqlite", start, 4 * 86400)
    with full() as session:
        store.compact_samples(session, now=now)
        session.commit()
        expected = session.scalars(select(Sample.t).order_by(Sample.t)).all()

    plans: list[str] = []

    def explain(conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.startswith("DELETE FROM samples") and "t >=" in statement:
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            plans.append(" | ".join(str(r[-1]) for r in rows))

    first = now - 3 * 3600
    with step() as session:
        store.compact_samples(session, now=first)  # a daemon's first pass: everything
        session.commit()
        since = store.compaction_cutoffs(first)
        event.listen(step_db, "before_cursor_execute", explain)
        for t in (first + 300, now - 600, now):
            store.compact_samples(session, now=t, since=since)
            session.commit()
            since = store.compaction_cutoffs(t)
        event.remove(step_db, "before_cursor_execute", explain)
        kept = session.scalars(select(Sample.t).order_by(Sample.t)).all()
    assert kept == expected and 12_000 < len(kept) < 16_000  # 6 h at 2 s, then thinner
    assert plans and all("ix_samples_t" in plan for plan in plans), plans
    full_db.dispose()
    step_db.dispose()


def test_a_restarted_daemon_resumes_downsampling_where_the_last_one_was(
        tmp_path: Path) -> None:
    """A new daemon's first pass reads from a day before the newest sample, not the whole
    table, and ends where a full pass ends: the old daemon had compacted the rest."""
    start = 1_800_000_000.0
    stop = start + 4 * 86400
    dbs = [_samples_db(tmp_path, f"{name}.sqlite", start, 4 * 86400) for name in ("a", "b")]
    kept = []
    for (db, sessions), resume in zip(dbs, (False, True), strict=True):
        with sessions() as session:
            store.compact_samples(session, now=stop)  # the old daemon's last pass
            session.add_all(Sample(job_id="j1", t=stop + i * 2.0, items_done=0, files=0,
                                   bytes_written=0) for i in range(150))  # then 5 min more
            session.commit()
            since = store.compaction_resume_point(session) if resume else None
            if resume:
                assert since == store.compaction_cutoffs(stop + 298.0 - 86_400)
            store.compact_samples(session, now=stop + 3600, since=since)  # the new daemon
            session.commit()
            kept.append(session.scalars(select(Sample.t).order_by(Sample.t)).all())
        db.dispose()
    assert kept[0] == kept[1]
