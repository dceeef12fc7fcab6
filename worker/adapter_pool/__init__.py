"""Adapter residency for one engine: disk → pinned host → GPU slots, prefetched (pool.py says how)."""
