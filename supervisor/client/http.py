"""A small HTTP client of the daemon for the CLI; errors become JobsupError."""

from __future__ import annotations

from typing import Any

import httpx

from supervisor.errors import JobsupError


class DaemonUnreachable(JobsupError):
    """No answer at all from the daemon (as opposed to an answer refusing something)."""


class Client:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise DaemonUnreachable(
                f"cannot reach the jobsup daemon at {self.url} ({exc.__class__.__name__})",
                hint="start it with `jobsup serve`, or point --url / JOBSUP_URL at it",
            ) from None
        if response.status_code >= 400:
            try:
                body = response.json()
                message, hint = body.get("error") or str(body), body.get("hint")
            except ValueError:
                message, hint = response.text.strip() or response.reason_phrase, None
            if response.status_code == 401:  # the CLI's side of it, not the header's
                hint = ("the daemon has a token: set JOBSUP_TOKEN to it (the CLI sends it "
                        "as the bearer token)" if "Authorization" not in self._http.headers
                        else "JOBSUP_TOKEN is not the daemon's token")
            raise JobsupError(f"{message} (HTTP {response.status_code})", hint=hint)
        return response

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs).json()

    def get_all(self, path: str, **kwargs: Any) -> list[Any]:
        """Every page of a paged list (`GET /api/v1/jobs`): its pages' items in order,
        following each answer's `Link: rel="next"` (#30)."""
        items: list[Any] = []
        response = self.request("GET", path, **kwargs)
        while True:
            items.extend(response.json())
            following = response.links.get("next", {}).get("url")
            if not following:
                return items
            response = self.request("GET", following)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs).json()

    def close(self) -> None:
        self._http.close()
