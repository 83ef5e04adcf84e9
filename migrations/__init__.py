"""Alembic migrations of the jobsup database (the daemon runs `upgrade head` at start)."""
