"""jobsup: a supervisor and monitoring daemon for long-running ML jobs."""

__version__ = "0.1.0"
