"""The guarantees of docs/security.md, each against a real daemon over real HTTP on
loopback: who may talk to the API (token, Host, Origin), how much it reads (body cap),
what a job may set (environment) and how it runs (argv, never a shell)."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.api import guard as guard_module
from supervisor.api.guard import Guard, allowed_hosts, same_origin, split_host
from supervisor.config import Settings
from supervisor.spec import CODE_LOADING_ENV, refused_env
from tests.helpers import PY, Daemon, python_job

TOKEN = "s3cret-token"
EVIL = "http://evil.example"


# -- helpers ---------------------------------------------------------------------------
def raw_http(port: int, request: bytes, host: str = "127.0.0.1",
             timeout: float = 10) -> tuple[int, bytes]:
    """Send bytes as they are; (status, head and whatever body arrived with it)."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def job_names(daemon: Daemon) -> list[str]:
    return [j["name"] for j in daemon.http.get("/api/v1/jobs").json()]


def spec(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "command": python_job("pass"), **fields}


def cors_headers(response: httpx.Response) -> list[str]:
    return [k for k in response.headers if k.lower().startswith("access-control-")]


def schema_operations(daemon: Daemon, headers: dict[str, str]) -> list[tuple[str, str]]:
    paths = daemon.http.get("/openapi.json", headers=headers).json()["paths"]
    return [(method.upper(), path.replace("{job_id}", "nope"))
            for path, methods in paths.items() for method in methods]


# -- 1. the token ----------------------------------------------------------------------
def test_token_guards_every_route_in_the_schema(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(env={"JOBSUP_TOKEN": TOKEN})
    good = {"Authorization": f"Bearer {TOKEN}"}
    operations = schema_operations(daemon, good)
    assert ("GET", "/metrics") in operations and ("POST", "/api/v1/jobs") in operations
    # the schema's own routes and unknown paths too: an unknown path is 401, not 404
    operations += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
                   ("GET", "/no/such/path")]
    for method, path in operations:
        if path == "/healthz":
            continue
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"},
                        {"Authorization": f"Bearer {TOKEN[:-1]}"}):
            response = daemon.http.request(method, path, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            if path == "/docs":  # a page of the daemon's own (page.DOCS_PATH): the login
                assert 'action="/login" id="login"' in response.text, response.text
            else:
                assert response.json()["error"] == "missing or wrong bearer token"
        answered = daemon.http.request(method, path, headers=good)
        assert answered.status_code != 401, (method, path)
    assert daemon.http.get("/healthz").json()["status"] == "ok"
    scrape = daemon.http.get("/metrics", headers=good)  # not public: behind the token
    assert scrape.status_code == 200 and "jobsup_tick_duration_seconds" in scrape.text
    assert daemon.http.get("/api/v1/jobs", headers={"Authorization": f"bearer {TOKEN}"}) \
        .status_code == 200  # the scheme is case-insensitive (RFC 7235)


def test_metrics_public_keeps_everything_else_behind_the_token(
        make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(env={"JOBSUP_TOKEN": TOKEN, "JOBSUP_METRICS_PUBLIC": "1"})
    metrics = daemon.http.get("/metrics")
    assert metrics.status_code == 200 and "jobsup_tick_duration_seconds" in metrics.text
    good = {"Authorization": f"Bearer {TOKEN}"}
    for method, path in schema_operations(daemon, good):
        if path in ("/healthz", "/metrics"):
            assert daemon.http.request(method, path).status_code == 200
        else:
            assert daemon.http.request(method, path).status_code == 401, (method, path)
    schema = daemon.http.get("/openapi.json", headers=good).json()
    assert schema["security"] == [{"bearer": []}]
    assert schema["paths"]["/metrics"]["get"]["security"] == []
    assert schema["paths"]["/healthz"]["get"]["security"] == []


@pytest.mark.parametrize("variable", ["JOBSUP_TOKEN", "jobsup_token", "Jobsup_Token"])
def test_jobs_never_see_the_token(make_daemon: Callable[..., Daemon], variable: str) -> None:
    """However the variable is spelled: settings are read case-insensitively, so each
    spelling turns the token on, and none may reach a job or its files (#30 item 10)."""
    daemon = make_daemon(env={variable: TOKEN})
    assert daemon.http.get("/api/v1/jobs").status_code == 401  # the token is on
    daemon.http.headers["Authorization"] = f"Bearer {TOKEN}"
    job = daemon.submit(python_job(  # (the token reversed: the command is in job.json)
        "import os; print(any(k.upper() == 'JOBSUP_TOKEN' for k in os.environ),"
        f" any({TOKEN[::-1]!r}[::-1] in v for v in os.environ.values()))"), name="no-token")
    daemon.wait_state(job["id"], "succeeded")
    assert daemon.logs(job["id"]).split() == ["False", "False"]
    job_dir = daemon.data_dir / "jobs" / job["id"]
    written = [f for f in job_dir.rglob("*") if f.is_file()]
    assert any(f.name == "launch.json" for f in written)
    assert not [f for f in written if TOKEN.encode() in f.read_bytes()]


def test_job_records_holding_the_env_are_the_owners_only(make_daemon: Callable[..., Daemon]
                                                         ) -> None:
    """job.json and launch.json hold the job's env (an HF_TOKEN, say): mode 0600, not
    readable by other users of the machine (#30 item 11)."""
    daemon = make_daemon()
    job = daemon.submit(python_job("pass"), name="private", env={"HF_TOKEN": "hf_secret"})
    daemon.wait_state(job["id"], "succeeded")
    job_dir = daemon.data_dir / "jobs" / job["id"]
    records = [job_dir / "job.json", job_dir / "attempt-1" / "launch.json"]
    assert all(b"hf_secret" in f.read_bytes() for f in records)
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in job_dir.rglob("*.json")}
    assert modes and set(modes.values()) == {"0o600"}, modes


def test_token_is_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant time by construction: every token check goes through
    hmac.compare_digest of two SHA-256 digests (timing is not reliably measurable in a
    test)."""
    calls: list[tuple[bytes, bytes]] = []
    real = guard_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    guard = Guard(_ok_app, settings=Settings(token=TOKEN), public_paths=frozenset())
    assert asyncio.run(_asgi_status(guard, {"authorization": "Bearer nope"})) == 401
    assert asyncio.run(_asgi_status(guard, {"authorization": f"Bearer {TOKEN}"})) == 200
    # digests of equal length, so not even the token's length shows in the timing
    assert len(calls) == 2 and {len(x) for pair in calls for x in pair} == {32}
    assert calls[0][0] != calls[0][1] and calls[1][0] == calls[1][1]


async def _ok_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _asgi_status(app: Any, headers: dict[str, str]) -> int:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/api/v1/jobs", "query_string": b"",
             "headers": [(k.encode(), v.encode())
                         for k, v in {"host": "127.0.0.1", **headers}.items()]}
    await app(scope, receive, send)
    return int(sent[0]["status"])


def test_non_loopback_bind_with_a_token_serves_behind_it(
        make_daemon: Callable[..., Daemon]) -> None:
    """(Without a token the daemon refuses to start: tests/test_cli.py::
    test_non_loopback_bind_without_token_refuses.)"""
    daemon = make_daemon(env={"JOBSUP_HOST": "0.0.0.0", "JOBSUP_TOKEN": TOKEN})
    assert daemon.http.get("/api/v1/jobs").status_code == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert daemon.http.get("/api/v1/jobs", headers=good).status_code == 200
    # every interface: the machine's own name is an allowed Host, a foreign one is not
    named = {**good, "Host": f"{socket.gethostname()}:{daemon.port}"}
    assert daemon.http.get("/api/v1/jobs", headers=named).status_code == 200
    rebound = {**good, "Host": f"evil.example:{daemon.port}"}
    assert daemon.http.get("/api/v1/jobs", headers=rebound).status_code == 403


def _non_loopback_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(sock.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_specific_non_loopback_bind_allows_that_address(
        make_daemon: Callable[..., Daemon]) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this machine "
                    "(test_allowed_hosts_rules covers the rule)")
    daemon = make_daemon(env={"JOBSUP_HOST": address, "JOBSUP_TOKEN": TOKEN}, start=False)
    daemon.url = f"http://{address}:{daemon.port}"
    daemon.http = httpx.Client(base_url=daemon.url, timeout=10,
                               headers={"Authorization": f"Bearer {TOKEN}"})
    daemon.start()
    assert daemon.http.get("/api/v1/jobs").status_code == 200  # Host: ADDRESS:PORT
    assert daemon.http.get("/api/v1/jobs", headers={"Host": "evil.example"}).status_code == 403


# -- 2. Host and Origin: DNS rebinding, drive-by browser requests -------------------------
@pytest.mark.slow
def test_loopback_hosts_are_answered(shared: Daemon) -> None:
    port = shared.port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "localhost",
                 f"LocalHost:{port}", f"[::1]:{port}", "[::1]", f"127.0.0.2:{port}"):
        for path in ("/healthz", "/api/v1/jobs"):
            response = shared.http.get(path, headers={"Host": host})
            assert response.status_code == 200, (host, path, response.text)


REBINDING_HOSTS = ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}",
                   "localhost.evil.example:{port}", "localhost.:{port}", "{hostname}:{port}",
                   "0.0.0.0:{port}", "127.0.0.1:{port}:1", "127.0.0.1:notaport",
                   "[::1:{port}", "evil.example@127.0.0.1:{port}"]


@pytest.mark.parametrize("template", REBINDING_HOSTS)
def test_foreign_host_is_refused_on_every_route(shared: Daemon, template: str) -> None:
    host = template.format(port=shared.port, hostname=socket.gethostname())
    for method, path in [("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/api/v1/jobs"),
                         ("GET", "/openapi.json"), ("POST", "/api/v1/jobs"),
                         ("POST", "/api/v1/jobs/nope/stop")]:
        body = spec(f"rebound-{template}") if method == "POST" else None
        response = shared.http.request(method, path, json=body, headers={"Host": host})
        assert response.status_code == 403, (host, method, path, response.text)
        assert "not allowed" in response.json()["error"]
    assert f"rebound-{template}" not in job_names(shared)


def test_missing_or_empty_host_is_refused(shared: Daemon) -> None:
    status, _ = raw_http(shared.port, b"GET /api/v1/jobs HTTP/1.0\r\n\r\n")
    assert status == 403
    status, _ = raw_http(shared.port, b"GET /api/v1/jobs HTTP/1.1\r\nHost: \r\n"
                                      b"Connection: close\r\n\r\n")
    assert status in (400, 403)  # the HTTP parser may refuse it before jobsup does


@pytest.mark.slow
def test_allowed_hosts_setting(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(env={"JOBSUP_ALLOWED_HOSTS": "jobs.example.org, 10.1.2.3,[fd00::1]"})
    for host in ("jobs.example.org", f"JOBS.example.org:{daemon.port}", "10.1.2.3:80",
                 f"[fd00::1]:{daemon.port}", f"127.0.0.1:{daemon.port}"):
        assert daemon.http.get("/api/v1/jobs", headers={"Host": host}).status_code == 200, host
    for host in ("other.example.org", "sub.jobs.example.org", "jobs.example.org.evil.example",
                 "10.1.2.4"):
        assert daemon.http.get("/api/v1/jobs", headers={"Host": host}).status_code == 403, host
    # an allowed host's page is same-origin with it, and only with it
    same = {"Host": "jobs.example.org", "Origin": "http://jobs.example.org"}
    assert daemon.http.get("/api/v1/jobs", headers=same).status_code == 200
    cross = {"Host": "10.1.2.3", "Origin": "http://jobs.example.org"}
    assert daemon.http.get("/api/v1/jobs", headers=cross).status_code == 403


FOREIGN_ORIGINS = [EVIL, "http://evil.example:{port}", "null", "http://localhost:{port}",
                   "http://127.0.0.1", "http://127.0.0.1:1", "http://[::1]:{port}",
                   "file://", "chrome-extension://abcdef", "http://127.0.0.1:{port}/path",
                   "http://user@127.0.0.1:{port}", "not an origin"]
METHODS = [("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs"), ("POST", "/api/v1/jobs/x/stop"),
           ("GET", "/api/v1/jobs/x/logs"), ("GET", "/healthz"), ("GET", "/metrics"),
           ("OPTIONS", "/api/v1/jobs"), ("PUT", "/api/v1/jobs"), ("DELETE", "/api/v1/jobs/x"),
           ("PATCH", "/api/v1/jobs/x"), ("HEAD", "/healthz")]


@pytest.mark.parametrize("template", FOREIGN_ORIGINS)
def test_cross_origin_request_is_refused_for_every_method(shared: Daemon,
                                                          template: str) -> None:
    origin = template.format(port=shared.port)
    name = f"cross-origin-{template}"
    for method, path in METHODS:
        body = spec(name) if method == "POST" else None
        response = shared.http.request(method, path, json=body, headers={"Origin": origin})
        assert response.status_code == 403, (origin, method, path, response.text)
        assert cors_headers(response) == []
    assert name not in job_names(shared)


def test_browser_form_post_from_another_site_runs_nothing(shared: Daemon,
                                                          tmp_path: Path) -> None:
    """What a page on evil.example can make a browser send without a preflight: a
    form POST (or fetch with mode no-cors) with a simple content type. Also the DNS
    rebinding variant, where Host and Origin are both the attacker's name."""
    marker = tmp_path / "pwned"
    body = json.dumps(spec("drive-by", command=python_job(f"open({str(marker)!r}, 'w')")))
    attempts = [
        ({"Origin": EVIL, "Content-Type": "text/plain"}, body),
        ({"Origin": EVIL, "Content-Type": "application/x-www-form-urlencoded"}, body),
        ({"Origin": EVIL, "Content-Type": "multipart/form-data; boundary=x"}, body),
        ({"Origin": EVIL, "Content-Type": "application/json"}, body),
        ({"Origin": f"http://evil.example:{shared.port}",
          "Host": f"evil.example:{shared.port}", "Content-Type": "application/json"}, body),
        ({"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors",
          "Content-Type": "text/plain"}, body),
    ]
    for headers, content in attempts:
        response = shared.http.post("/api/v1/jobs", content=content, headers=headers)
        assert response.status_code == 403, (headers, response.text)
    shared.wait_ticks(3)  # a job that had been recorded would have started
    assert "drive-by" not in job_names(shared)
    assert not marker.exists()


def test_same_origin_requests_pass(shared: Daemon) -> None:
    port = shared.port
    for host, origin in [(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
                         (f"localhost:{port}", f"http://LOCALHOST:{port}"),
                         (f"[::1]:{port}", f"http://[::1]:{port}"),
                         ("localhost", "http://localhost"),
                         ("localhost:80", "http://localhost")]:
        headers = {"Host": host, "Origin": origin}
        response = shared.http.get("/api/v1/jobs", headers=headers)
        assert response.status_code == 200, (host, origin)
        assert cors_headers(response) == []
    created = shared.http.post("/api/v1/jobs", json=spec("same-origin"),
                               headers={"Origin": f"http://127.0.0.1:{port}"})
    assert created.status_code == 201, created.text
    shared.wait_state(created.json()["id"], "succeeded")


def test_no_cors_headers_ever(shared: Daemon) -> None:
    preflight = shared.http.options("/api/v1/jobs", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert preflight.status_code == 403
    assert cors_headers(preflight) == []
    own = shared.http.options("/api/v1/jobs", headers={
        "Origin": shared.url, "Access-Control-Request-Method": "POST"})
    assert own.status_code == 405 and cors_headers(own) == []
    assert sorted(own.headers["allow"].split(", ")) == ["GET", "POST"]
    for path in ("/healthz", "/api/v1/jobs", "/metrics", "/openapi.json"):
        assert cors_headers(shared.http.get(path)) == []


def test_fetch_metadata_cross_site_is_refused_but_navigation_is_not(shared: Daemon) -> None:
    """Browsers send `Sec-Fetch-Site` even where they send no Origin (an <img> or
    <script> GET): another site's page may link to the daemon, nothing more."""
    cases = [
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}, 403),
        ("GET", {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors"}, 403),
        ("POST", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}, 403),
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}, 200),
        ("GET", {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}, 200),
        ("GET", {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"}, 200),
    ]
    for method, headers, status in cases:
        path = "/api/v1/jobs" if method == "GET" else "/api/v1/jobs/nope/stop"
        assert shared.http.request(method, path, headers=headers).status_code == status, \
            (method, headers)


def test_host_and_origin_rules() -> None:
    assert split_host("LocalHost:8765") == ("localhost", 8765)
    assert split_host("[::1]:80") == ("::1", 80)
    assert split_host("[::1]") == ("::1", None)
    for bad in ("", ":80", "::1", "[::1", "[::1]x", "a:b", "a:99999", "a:１２"):
        assert split_host(bad) is None, bad
    assert same_origin("http://127.0.0.1:8765", ("127.0.0.1", 8765))
    assert same_origin("https://jobs.example.org", ("jobs.example.org", None))
    assert same_origin("http://jobs.example.org:80", ("jobs.example.org", None))
    assert not same_origin("http://jobs.example.org", ("jobs.example.org", 8765))
    assert not same_origin("http://localhost:8765", ("127.0.0.1", 8765))
    assert not same_origin("null", ("127.0.0.1", 8765))
    assert not same_origin("http://127.0.0.1:99999", ("127.0.0.1", 8765))


def test_allowed_hosts_rules() -> None:
    assert allowed_hosts("127.0.0.1", []) == frozenset()
    assert allowed_hosts("localhost", ["A.example", " ", "[fd00::1]"]) == {"a.example",
                                                                          "fd00::1"}
    assert allowed_hosts("10.0.0.7", []) == {"10.0.0.7"}
    assert allowed_hosts("gpu-7.example.org", []) == {"gpu-7.example.org"}
    everywhere = allowed_hosts("0.0.0.0", [])
    assert socket.gethostname().lower() in everywhere
    assert allowed_hosts("::", []) == everywhere
    assert "0.0.0.0" not in everywhere and "evil.example" not in everywhere


# -- 3. body size ------------------------------------------------------------------------
def test_body_over_the_limit_is_413(shared: Daemon) -> None:
    big = spec("too-big", labels={"pad": "x" * (2 << 20)})
    response = shared.http.post("/api/v1/jobs", json=big)
    assert response.status_code == 413, response.text
    assert "larger than 1048576 bytes" in response.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]

    chunked = shared.http.post("/api/v1/jobs", content=chunks(),
                               headers={"Content-Type": "application/json"})
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413, chunked.text
    assert "too-big" not in job_names(shared)


def test_declared_oversized_body_is_refused_before_it_is_sent(shared: Daemon) -> None:
    """A Content-Length over the limit is answered at once: the daemon reads nothing."""
    status, head = raw_http(shared.port, (
        f"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{shared.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n\r\n").encode())
    assert status == 413, head


@pytest.mark.slow
def test_max_body_bytes_is_configurable_and_chunked_bodies_stop_at_limit_plus_one(
        make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(env={"JOBSUP_MAX_BODY_BYTES": "1000"})
    exact = json.dumps(spec("exact")).encode()
    exact += b" " * (1000 - len(exact))
    assert len(exact) == 1000
    created = daemon.http.post("/api/v1/jobs", content=exact,
                               headers={"Content-Type": "application/json"})
    assert created.status_code == 201, created.text
    over = daemon.http.post("/api/v1/jobs", content=exact + b" ",
                            headers={"Content-Type": "application/json"})
    assert over.status_code == 413
    assert "larger than 1000 bytes" in over.json()["error"]
    # a chunked body that never ends: refused as soon as byte 1001 arrives
    head = (f"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{daemon.port}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    status, _ = raw_http(daemon.port, head + b"3e8\r\n" + b" " * 1000 + b"\r\n1\r\n \r\n")
    assert status == 413
    # exactly the limit, chunked, is accepted
    body = b"".join(b"%x\r\n%s\r\n" % (len(exact[i:i + 300]), exact[i:i + 300])
                    for i in range(0, 1000, 300))
    status, response = raw_http(daemon.port, head + body + b"0\r\n\r\n")
    assert status == 201, response


def test_a_body_cut_short_is_never_acted_on(shared: Daemon) -> None:
    """The client promises more bytes than it sends and goes away: even though what
    arrived is a complete JobSpec, nothing is submitted."""
    body = json.dumps(spec("cut-short")).encode()
    with socket.create_connection(("127.0.0.1", shared.port), timeout=10) as sock:
        sock.sendall((f"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{shared.port}\r\n"
                      f"Content-Type: application/json\r\n"
                      f"Content-Length: {len(body) + 10}\r\n\r\n").encode() + body)
        time.sleep(0.3)
    time.sleep(1)
    assert "cut-short" not in job_names(shared)


def test_invalid_content_length_is_refused(shared: Daemon) -> None:
    status, _ = raw_http(shared.port, (
        f"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{shared.port}\r\n"
        "Content-Length: -5\r\nConnection: close\r\n\r\n").encode())
    assert status == 400


# -- 4. environment variables that load code ------------------------------------------------
REFUSED_KEYS = sorted(CODE_LOADING_ENV) + ["LD_DEBUG", "LD_BIND_NOW", "BASH_FUNC_ls%%"]


@pytest.mark.parametrize("key", REFUSED_KEYS)
def test_code_loading_env_is_refused_naming_the_key(shared: Daemon, key: str) -> None:
    response = shared.http.post("/api/v1/jobs",
                                json=spec(f"env-{key}", env={key: "/tmp/x", "OK": "1"}))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == "env"
    assert body["error"].startswith(f"env: {key} may not be set by a job")
    assert f"JOBSUP_ALLOWED_ENV={key}" in body["hint"]
    assert f"env-{key}" not in job_names(shared)


def test_several_refused_keys_are_all_named(shared: Daemon) -> None:
    response = shared.http.post("/api/v1/jobs", json=spec(
        "env-many", env={"LD_PRELOAD": "a", "PYTHONSTARTUP": "b", "LD_AUDIT": "c"}))
    assert response.status_code == 422
    assert response.json()["error"].startswith("env: LD_AUDIT, LD_PRELOAD, PYTHONSTARTUP ")


def test_pythonpath_and_ordinary_env_reach_the_job(shared: Daemon, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0", "ld_preload": "lower",
           "HF_HOME": str(tmp_path)}
    job = shared.submit(python_job(
        "import os; print(os.environ['PYTHONPATH'], os.environ['CUDA_VISIBLE_DEVICES'],"
        " os.environ['ld_preload'])"), name="env-ok", env=env)
    shared.wait_state(job["id"], "succeeded")
    assert shared.logs(job["id"]).split() == [str(tmp_path), "0", "lower"]


@pytest.mark.slow
def test_allowed_env_setting_lets_named_keys_through(make_daemon: Callable[..., Daemon],
                                                     tmp_path: Path) -> None:
    daemon = make_daemon(env={"JOBSUP_ALLOWED_ENV": "LD_LIBRARY_PATH, NODE_OPTIONS"})
    job = daemon.submit(python_job("import os; print(os.environ['LD_LIBRARY_PATH'])"),
                        name="allowed", env={"LD_LIBRARY_PATH": str(tmp_path)})
    daemon.wait_state(job["id"], "succeeded")
    assert daemon.logs(job["id"]).strip() == str(tmp_path)
    refused = daemon.http.post("/api/v1/jobs", json=spec("still-refused",
                                                         env={"LD_PRELOAD": "x"}))
    assert refused.status_code == 422 and "LD_PRELOAD" in refused.json()["error"]


def test_pipeline_env_is_checked_too(shared: Daemon, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "1", "messages": [{"role": "user", "content": "hi"}]}\n')
    response = shared.http.post("/api/v1/pipelines/eagle3", json={
        "model": str(model), "prompts": str(prompts), "out": str(tmp_path / "out"),
        "name": "env-pipeline", "env": {"LD_PRELOAD": "/tmp/evil.so"}})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "env"
    assert "LD_PRELOAD" in response.json()["error"]
    assert not [n for n in job_names(shared) if n.startswith("env-pipeline")]


def test_refused_env_rule() -> None:
    assert refused_env({"PATH": "", "PYTHONPATH": "", "LD": "", "XLD_PRELOAD": ""}) == []
    assert refused_env(["LD_PRELOAD", "LD_FOO", "BASH_FUNC_f%%", "PERL5OPT"]) == [
        "BASH_FUNC_f%%", "LD_FOO", "LD_PRELOAD", "PERL5OPT"]
    assert refused_env(["LD_PRELOAD", "LD_AUDIT"], allowed={"LD_AUDIT"}) == ["LD_PRELOAD"]


# -- 5. argv, never a shell ----------------------------------------------------------------
def test_shell_metacharacters_run_literally(shared: Daemon, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("still here")
    markers = [tmp_path / f"marker{i}" for i in range(5)]
    args = [f"; rm -rf {victim}", f"$(touch {markers[0]})", f"`touch {markers[1]}`",
            f"&& touch {markers[2]}", f"| tee {markers[3]}", f"> {markers[4]}", "*", "$HOME",
            "'quoted'", '"double"', "a\nb"]
    job = shared.submit([PY, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *args],
                        name="argv-literal")
    shared.wait_state(job["id"], "succeeded")
    assert json.loads(shared.logs(job["id"])) == args
    assert (victim / "keep.txt").read_text() == "still here"
    assert [m for m in markers if m.exists()] == []


def test_a_shell_string_as_the_program_is_not_run(shared: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    for command in ([f"touch {marker}; true"], [f"/bin/sh -c 'touch {marker}'"],
                    [f"$(touch {marker})"]):
        response = shared.http.post("/api/v1/jobs", json={"name": "shell", "command": command})
        assert response.status_code == 422, response.text
        assert response.json()["field"] == "command"
    time.sleep(1)
    assert not marker.exists()
    assert "shell" not in job_names(shared)
