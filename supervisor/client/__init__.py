"""The command-line client: the `jobsup` CLI, its HTTP client, the live view
and the demo."""
