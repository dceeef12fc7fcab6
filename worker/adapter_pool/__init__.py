"""Adapters for one engine: their formats (PEFT files, MoE experts' two forms: peft_adapter.py,
moe_adapter.py, read and packed by host_adapter.py), their residency through three tiers, disk →
pinned host → GPU pages, prefetched ahead of need (pool.py says how), and what a worker can serve of
them (limits.py). Depends only on worker/model/ for the slot tensors it writes."""
