"""`GET /api/v1/jobs` pages (#30: 10,000 jobs answered 11.9 MB in one list): newest
first, `limit` jobs (100 by default), `X-Total-Count`, a `Link: rel="next"` cursor that
stays put while jobs are submitted, filters across pages; the CLI's client follows the
pages (`jobsup ls` lists every job). A real daemon over loopback."""

from __future__ import annotations

import json

import pytest

from supervisor.client.http import Client
from tests.helpers import Daemon
from tests.test_cli import jobsup

pytestmark = pytest.mark.timeout(120)


def names(answer: object) -> list[str]:
    assert isinstance(answer, list)
    return [job["name"] for job in answer]


def test_jobs_come_in_pages_newest_first(daemon: Daemon) -> None:
    blocker = daemon.submit(["sleep", "60"], name="blocker")["id"]
    for i in range(104):
        daemon.submit(["true"], name=f"w{i:03d}", depends_on=[blocker],
                      labels={"parity": str(i % 2)})
    first = daemon.http.get("/api/v1/jobs")
    assert first.status_code == 200
    # before: all 105 jobs, oldest first, and no count
    assert len(first.json()) == 100 and first.headers["X-Total-Count"] == "105"
    assert names(first.json())[:2] == ["w103", "w102"]
    following = first.links["next"]["url"]
    daemon.submit(["true"], name="late", depends_on=[blocker])  # a cursor stays put
    second = daemon.http.get(following)
    assert names(second.json()) == ["w003", "w002", "w001", "w000", "blocker"]
    assert "next" not in second.links and second.headers["X-Total-Count"] == "106"

    oldest = daemon.http.get("/api/v1/jobs", params={"order": "oldest", "limit": 3})
    assert names(oldest.json()) == ["blocker", "w000", "w001"]
    odd = daemon.http.get("/api/v1/jobs", params={"label": "parity=1", "limit": 50})
    assert odd.headers["X-Total-Count"] == "52" and len(odd.json()) == 50
    rest = daemon.http.get(odd.links["next"]["url"]).json()
    assert names(rest) == ["w003", "w001"]
    running = daemon.http.get("/api/v1/jobs", params={"state": "running"})
    assert names(running.json()) == ["blocker"] and running.headers["X-Total-Count"] == "1"

    for bad in ({"limit": 0}, {"limit": 1001}, {"cursor": "not-one"}, {"order": "up"}):
        refused = daemon.http.get("/api/v1/jobs", params=bad)
        assert refused.status_code == 422, (bad, refused.text)
    assert daemon.http.get("/api/v1/jobs", params={"cursor": "x"}).json()["field"] == "cursor"

    client = Client(daemon.url)
    try:  # what `jobsup ls` does: every page, oldest first
        listed = client.get_all("/api/v1/jobs", params={"order": "oldest", "limit": 7})
    finally:
        client.close()
    assert len(listed) == 106 and names(listed)[:2] == ["blocker", "w000"]
    shown = jobsup("ls", "--json", url=daemon.url)
    assert shown.returncode == 0, shown.stderr
    assert [j["id"] for j in json.loads(shown.stdout)] == [j["id"] for j in listed]
