"""The job side: the per-job shim (stdlib only: it must start fast and outlive
the daemon), the /proc readers and file helpers it shares, and the launcher
that starts shims and stops their jobs."""
