"""The observation pipeline of one tick: sample processes and GPUs, scan
output files, read progress files, forecast ETA and disk runway."""
