"""Several base models per worker: which are resident on the device, warm in host memory, or cold
on disk (residency.py, checkpoint_cache.py), how they are read and copied in (loader.py), and when the
worker switches between them (queue_probe.py measures the queues, switch_policy.py decides)."""
