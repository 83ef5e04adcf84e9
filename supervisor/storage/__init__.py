"""The daemon's state: the database, its tables, and `store`, through which
every job state change goes."""
