"""Where jobs run: the contract between the engine and a backend (`base.py`), what every
backend does to launch an attempt (`launch.py`), the backends by name (`registry.py`),
and the backends: `local` (`local.py`) and `slurm` (`slurm.py`, with `slurm_jobs.py`
and `slurm_query.py`). Daemon side: the job side they start is `supervisor/runtime/`."""
