"""The EAGLE-3 pipeline steps as resumable workers: `python -m workers.<step> --help`.

generate -> extract -> vocab -> train. Each reports progress through the jobsup
progress file (JOBSUP_PROGRESS_FILE) and can be run alone, under jobsup or not.
Needs the `workers` extra (torch, transformers, safetensors).
"""
