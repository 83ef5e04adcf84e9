"""The alerting pipeline: rules (pure functions of a job's observation),
the recorder that turns them into alert rows and messages, and the
notification outbox and its delivery."""
