"""The contract between gateway and worker: Redis key names, the wire schema, job-state transitions,
configuration dataclasses and logging setup. Nothing here imports torch."""
