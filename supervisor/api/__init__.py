"""The HTTP API: routes, the views it serves, submission, the auth guard and the
Prometheus metrics."""
