"""The job side: the per-job shim (stdlib only: it must start fast and outlive
the daemon), the /proc reader (`procfs`), the file helpers (`fileio`) and the
attempt files' contract (`files`) it shares with the daemon, and the launcher
that starts shims and stops their jobs."""
