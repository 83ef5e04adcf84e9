"""The observation pipeline of one tick: each job's readings (its process tree, GPUs and
output files, read with `supervisor/runtime/`'s readers, or from its shim's published
lines), its progress, and its ETA and disk runway forecast."""
