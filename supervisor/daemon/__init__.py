"""The daemon process: the tick loop, recovery at start, and the app wiring
that runs the loop beside the HTTP API."""
