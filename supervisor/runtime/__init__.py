"""The job side, standard library only (`tests/test_layout.py` checks it): the per-job
shim (it must start fast, in any Python environment, and outlive the daemon) and its
publisher of readings, the attempt files' contract (`files`, `observed`), the file
helpers (`fileio`), the /proc reader (`procfs`), one rank of a multi-rank job (`rank`),
and the readers the shim shares with the daemon: process trees (`sampler`), GPUs
(`gpu`: NVML's `pynvml` where it imports), output directories (`outputs`,
`outputs_state`, `dirwatch`: inotify) and item patterns (`patterns`)."""
