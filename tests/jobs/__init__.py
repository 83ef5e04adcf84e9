"""Jobs the tests submit, as modules: each has a `main()` that reads `sys.argv` and runs
as `tests.helpers.job_module("<name>", *args)` (the script's path, so a job's working
directory does not matter), or as `python -m tests.jobs.<name>` from the repository."""
